"""Typed doors to the Ray calls that ship without annotations: this node's address, the cluster's
resources, its nodes.

Ray annotates most of its API but not these three; calling them from strictly typed code needs a
`type: ignore` each time. They are called here once each, with the result's type stated, so the
orchestration code that asks where it runs or what the cluster holds stays typed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cluster_resources", "node_ip", "nodes"]


def node_ip() -> str:
    """The address of the node this process runs on, as the cluster's other nodes reach it."""
    import ray.util

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # Ray leaves it unannotated


def cluster_resources() -> dict[str, float]:
    """The whole cluster's resources by name (`CPU`, `GPU`, `memory`, custom ones)."""
    import ray

    resources = ray.cluster_resources()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
    return {str(name): float(amount) for name, amount in resources.items()}


def nodes() -> list[dict[str, Any]]:
    """Every node the cluster knows (alive or not), as Ray describes it (`NodeManagerAddress`,
    `Resources`, `Alive`, `NodeID`, ...)."""
    import ray

    return [dict(node) for node in ray.nodes()]  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
