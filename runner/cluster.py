"""Joining or starting Ray: a local instance binds to localhost only, without the dashboard."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray


@contextmanager
def ray_session(address: str | None) -> Iterator[dict[str, float]]:
    """Connects to `address` (or $RAY_ADDRESS), else starts a private local instance; yields its resources."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    # token authentication stays on (it is the safe default); only its notice is silenced
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    options = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address:
        ray.init(address=address, **options)
    else:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **options)
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()
