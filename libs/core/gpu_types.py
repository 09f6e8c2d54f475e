"""GPU types: the name by which a cluster groups its GPUs, the family a type belongs
to, and our own stated relative speed of each family (docs/gpu-types.md).

A node's ``gpu_model`` is free text (``"V100"``, an NVML name such as ``"Tesla
V100-SXM2-16GB"``, Alibaba's ``"V100M32"``); its *type* is that text normalised
(:func:`type_key`: lower case, vendor words dropped), so ``"V100"`` and ``"v100"`` are one
type, and its *family* the known GPU generation the type names (:func:`family`: the
longest known family name the type starts with, ``"v100-sxm2-16gb"`` -> ``"v100"``).

:data:`OUR_RELATIVE_SPEEDS` is our own choice, not a measurement: one round figure per
family for how fast a model trains on it against the GPU class of the project's analytic
profiles (a V100-class GPU, 1.0). It is the last of the three sources of a model's
speed on a type (``gpusched.libs.core.type_speed``), used where neither Gavel's
throughputs nor a measured profile knows the pair. K80 and P100 are near the geometric
mean of Gavel's ratios over its job types (0.30 and 0.94 against V100); the others are
round figures of the order public training benchmarks report.
"""

from __future__ import annotations

from gpusched.libs.core.profiles.measured import gpu_type_key

#: the type of a node whose GPU model nobody named: the analytic profiles' own class
GENERIC = "generic"
#: our own relative training speed per GPU family against a V100-class GPU (1.0)
OUR_RELATIVE_SPEEDS: dict[str, float] = {
    GENERIC: 1.0,
    "k80": 0.3,
    "p100": 0.9,
    "t4": 0.5,
    "v100": 1.0,
    "a10": 0.8,
    "a100": 2.0,
    "h100": 3.5,
}


def type_key(gpu_model: str) -> str:
    """The type of a node's ``gpu_model``: :func:`gpu_type_key` where it leaves a key,
    else the text lower-cased (``"NVIDIA"`` alone names no type but is one)."""
    try:
        return gpu_type_key(gpu_model)
    except ValueError:
        return gpu_model.strip().lower() or GENERIC


def family(key: str) -> str | None:
    """The known family of a type (``"a100-sxm4-40gb"`` -> ``"a100"``, ``"a10g"`` ->
    ``"a10"``), the longest that the type starts with; None for an unknown type."""
    found = [name for name in OUR_RELATIVE_SPEEDS if key.startswith(name)]
    return max(found, key=len) if found else None


def known_families() -> str:
    """The known families, for an error message."""
    return ", ".join(name.upper() for name in OUR_RELATIVE_SPEEDS if name != GENERIC)


__all__ = ["GENERIC", "OUR_RELATIVE_SPEEDS", "family", "known_families", "type_key"]
