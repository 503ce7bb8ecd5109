"""Joining or starting Ray: a local instance binds to localhost only, without the dashboard."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray._private import ray_constants

#: Off: Ray resolves "127.0.0.1" to the loopback address instead of the machine's reachable IP.
_CLUSTER_MODE_ENV = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR


def _keep_loopback() -> None:
    """Make Ray keep 127.0.0.1 as this node's address instead of the host's routable IP.

    Ray turns `_node_ip_address="127.0.0.1"` into the host's routable IP, and its gRPC servers
    (GCS, raylet, workers, agents) then listen on every interface. With cluster mode off it keeps
    the loopback address and every listener binds 127.0.0.1. The constant is read when a node
    starts (this process); the environment variable reaches the processes Ray spawns.
    """
    os.environ[_CLUSTER_MODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def init_local_ray(**options: object) -> None:
    """Start a private local Ray that listens on loopback only, without the dashboard."""
    _keep_loopback()
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **options)


@contextmanager
def ray_session(address: str | None) -> Iterator[dict[str, float]]:
    """Connects to `address` (or $RAY_ADDRESS), else starts a private local instance; yields its resources."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    # token authentication stays on (it is the safe default); only its notice is silenced
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    options = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address and _is_loopback(address):
        # a loopback-only cluster: this driver must see itself at 127.0.0.1 too, or it never finds a raylet
        _keep_loopback()
        ray.init(address=address, _node_ip_address="127.0.0.1", **options)
    elif address:
        ray.init(address=address, **options)
    else:
        init_local_ray(**options)
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()
