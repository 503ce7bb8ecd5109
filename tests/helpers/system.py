"""Real pieces of the machine a test needs: its free RAM, a free loopback port, a server it waits for,
a small tmpfs."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

#: the bucket of the `s3` fixture's moto server (tests/conftest.py)
BUCKET = "kvbatch-test"


def half_available_ram() -> int:
    """Half the RAM available now: what one worker alone takes as its `auto` host budget."""
    return int(psutil.virtual_memory().available * 0.5)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(port: int, server: subprocess.Popen, timeout: float = 30) -> None:
    """Returns once `server` accepts connections on `port` on loopback; fails if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "the test server did not start"
            time.sleep(0.2)


@contextmanager
def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A real tmpfs (`mount -o OPTIONS`) for the test; skips with the reason where mounting is not allowed."""
    mount_point.mkdir(exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command on this machine to make a small filesystem")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill_disk(folder: Path) -> None:
    """Writes `folder/filler` until not one more byte fits on its filesystem."""
    with open(folder / "filler", "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
