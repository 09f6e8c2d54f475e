"""A cluster's shape as a JSON file: its nodes, each with its GPUs, their model and
memory, CPU cores, host memory and network. ``gpusched history export`` writes one
beside the trace it exports (``<trace>.cluster.json``), and ``gpusched simulate
--cluster FILE.json`` simulates that cluster (docs/trace-format.md, "Cluster files")."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpusched.libs.core.cluster import Cluster, Node

#: what ``gpusched history export`` appends to the trace's path for its cluster file
CLUSTER_FILE_SUFFIX = ".cluster.json"
#: the fields of a node, all required, in the order they are written
NODE_FIELDS = ("name", "gpus", "gpu_model", "gpu_mem_mb", "cpus", "host_mem_gb", "net_gbps")


class ClusterFileError(ValueError):
    """A cluster file that cannot be read; the message names the file and the field."""


def cluster_document(cluster: Cluster) -> dict[str, Any]:
    """``{"nodes": [{name, gpus, gpu_model, gpu_mem_mb, cpus, host_mem_gb, net_gbps}]}``."""
    return {"nodes": [{name: getattr(node, name) for name in NODE_FIELDS}
                      for node in cluster.nodes]}


def cluster_from_document(document: object, where: str = "cluster") -> Cluster:
    """The cluster a document of `cluster_document`'s form describes; anything else,
    an unknown key included, raises `ClusterFileError` naming it."""
    if not isinstance(document, Mapping) or set(document) != {"nodes"}:
        raise ClusterFileError(f"{where}: expected an object with the one key 'nodes'")
    raw = document["nodes"]
    if not isinstance(raw, list) or not raw:
        raise ClusterFileError(f"{where}: 'nodes' must be a non-empty list of nodes")
    nodes = [_node(item, f"{where}: nodes[{i}]") for i, item in enumerate(raw)]
    try:
        return Cluster(tuple(nodes))
    except ValueError as exc:  # e.g. two nodes of one name
        raise ClusterFileError(f"{where}: {exc}") from None


def load_cluster_file(path: str | Path) -> Cluster:
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ClusterFileError(f"cannot read cluster file {source}: {exc.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterFileError(f"{source}: not JSON: {exc.msg} at line {exc.lineno}") from None
    return cluster_from_document(document, str(source))


def write_cluster_file(path: str | Path, cluster: Cluster) -> None:
    Path(path).write_text(json.dumps(cluster_document(cluster), indent=2) + "\n",
                          encoding="utf-8")


def _node(item: object, where: str) -> Node:
    if not isinstance(item, Mapping):
        raise ClusterFileError(f"{where}: expected an object")
    missing = [name for name in NODE_FIELDS if name not in item]
    unknown = sorted(set(item) - set(NODE_FIELDS))
    if missing or unknown:
        what = [f"missing {', '.join(missing)}"] if missing else []
        what += [f"unknown {', '.join(map(str, unknown))}"] if unknown else []
        raise ClusterFileError(f"{where}: {'; '.join(what)} (fields: {', '.join(NODE_FIELDS)})")
    name, model = item["name"], item["gpu_model"]
    for field, value in (("name", name), ("gpu_model", model)):
        if not isinstance(value, str) or not value.strip():
            raise ClusterFileError(f"{where}.{field}: expected a non-empty string")
    return Node(
        name=name,
        gpus=_whole(item, "gpus", where, minimum=1),
        gpu_model=model,
        gpu_mem_mb=_whole(item, "gpu_mem_mb", where, minimum=1),
        cpus=_whole(item, "cpus", where, minimum=0),
        host_mem_gb=_number(item, "host_mem_gb", where),
        net_gbps=_number(item, "net_gbps", where),
    )


def _whole(item: Mapping[str, object], name: str, where: str, *, minimum: int) -> int:
    value = item[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ClusterFileError(f"{where}.{name}: expected a whole number >= {minimum}, "
                               f"got {value!r}")
    return value


def _number(item: Mapping[str, object], name: str, where: str) -> float:
    value = item[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ClusterFileError(f"{where}.{name}: expected a number >= 0, got {value!r}")
    return float(value)


__all__ = [
    "CLUSTER_FILE_SUFFIX",
    "NODE_FIELDS",
    "ClusterFileError",
    "cluster_document",
    "cluster_from_document",
    "load_cluster_file",
    "write_cluster_file",
]
