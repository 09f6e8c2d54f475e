"""The machine-speed figure every benchmark prints beside its own (see
``../shared/tools/machine_speed.py``: wall seconds scale by reference / figure)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: GPUSCHED_MACHINE_SPEED names the tool where ``../shared`` is not beside the checkout
TOOL = Path(os.environ.get("GPUSCHED_MACHINE_SPEED") or
            Path(__file__).resolve().parents[2] / "shared" / "tools" / "machine_speed.py")


def print_machine_speed() -> float | None:
    if not TOOL.exists():
        print(f"machine_speed_s unknown ({TOOL} not found)")
        return None
    spec = importlib.util.spec_from_file_location("machine_speed", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figure: float = module.machine_speed()
    reference: float = module.REFERENCE_S
    print(f"machine_speed_s {figure:.3f} (reference {reference}; "
          f"scale wall times by {reference / figure:.2f})")
    return figure
