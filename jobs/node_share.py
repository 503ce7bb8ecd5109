"""How many workers share one node's RAM and one GPU, so that `auto` KV budgets are split among them.

Each worker sizes an `auto` budget from what is free when it starts, so sharers would each claim all of it.
The count follows Ray's SPREAD: exact on one node, on the small side across uneven ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def node_capacity(resources: Mapping[str, float], cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many workers one node's resources hold (`gpus_per_worker` 0: they take no GPU)."""
    fits = math.floor(resources.get("CPU", 0) / cpus_per_worker + 1e-9)
    if gpus_per_worker > 0:
        fits = min(fits, math.floor(resources.get("GPU", 0) / gpus_per_worker + 1e-9))
    return max(fits, 0)


def workers_that_fit(nodes: list[Mapping[str, float]], cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many workers the nodes hold at once: a worker needs its CPUs and GPUs on one node."""
    return sum(node_capacity(n, cpus_per_worker, gpus_per_worker) for n in nodes)


def workers_per_node(count: int, nodes: list[Mapping[str, float]], cpus_per_worker: float,
                     gpus_per_worker: float) -> int:
    """The most of `count` workers that one node gets when they are spread one per node in turn over
    the nodes with room; at least 1 (a worker that fits nowhere shares with nobody it can see)."""
    room = [node_capacity(n, cpus_per_worker, gpus_per_worker) for n in nodes]
    rounds = 0  # after k rounds a node holds min(its room, k): the last round begun is the most on one node
    while rounds < max(room, default=0) and sum(min(r, rounds) for r in room) < count:
        rounds += 1
    return max(rounds, 1)


def workers_per_device(node_workers: int, gpus_per_worker: float) -> int:
    """Of a node's workers, how many share one GPU: a whole GPU (or more) each is one; a fraction f
    packs 1/f to a GPU; none reserved (0) means every worker of the node sees the same GPUs."""
    if gpus_per_worker <= 0:
        return node_workers
    if gpus_per_worker >= 1:
        return 1
    return max(1, min(node_workers, math.floor(1 / gpus_per_worker + 1e-9)))
