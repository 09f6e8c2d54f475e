"""Optional dependencies and the package extras that bring them.

The simulator and the services install without them; the code that needs one imports
it where it is used and, when it is missing, fails with `MissingExtraError`, whose
message names the extra to install (``pip install 'gpusched[train]'``).
"""

from __future__ import annotations

import importlib.util

#: torch: the built-in training worker, the progress predictor (policy ones), CPU profiling
TRAIN = "train"
#: nvidia-ml-py: a node agent reading real NVIDIA GPUs
NVIDIA = "nvidia"


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra."""


def missing_message(module: str, extra: str, purpose: str) -> str:
    return f"{purpose} needs {module}: pip install 'gpusched[{extra}]'"


def require(module: str, extra: str, purpose: str) -> None:
    """Raise `MissingExtraError` unless ``module`` can be imported (without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(missing_message(module, extra, purpose))
