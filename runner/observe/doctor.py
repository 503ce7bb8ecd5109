"""`kvbatch doctor`: is this machine ready for a batch, and if not, what to change.

Each check is measured, not guessed (a pinned host→device copy, a real write and uncached read in the
offload root). A *problem* stops a batch (exit 1); a *warning* lets it run slower than it could (exit 0).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.markup import escape

from jobs.config import JobConfig
from storage.scratch import OFFLOAD_ROOT_ENV

GB = 1e9
GIB = 2**30
MIN_H2D_GBPS = 10.0
MIN_WRITE_MBPS = 300.0
MIN_READ_MBPS = 500.0
MIN_FREE_BYTES = 1 * GIB  # below this a disk-tier task cannot even start
LOW_FREE_BYTES = 20 * GIB
LOW_RAM_AVAILABLE = 4 * GIB
_IO_BLOCK = 4 * 2**20


class Level(StrEnum):
    OK = "ok"
    WARN = "warn"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str
    fix: str = ""


def check_torch(config: JobConfig) -> list[Check]:
    cuda_build = torch.version.cuda
    checks = [Check("torch", Level.OK, f"torch {torch.__version__}, "
                    + (f"CUDA {cuda_build} build" if cuda_build else "CPU-only build"))]
    if not torch.cuda.is_available():
        has_nvidia = Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None
        if config.model.device.startswith("cuda"):
            checks.append(Check("GPU", Level.PROBLEM, f"model.device is {config.model.device} but no GPU is usable",
                                "install a CUDA build of torch and check the driver (nvidia-smi), or set model.device=auto"))
        elif has_nvidia and not cuda_build:
            checks.append(Check("GPU", Level.WARN, "an NVIDIA GPU is present but torch is a CPU-only build",
                                "install a CUDA build: pip install torch (see README)"))
        else:
            checks.append(Check("GPU", Level.OK, "no GPU: workers run on CPU"))
        return checks
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        try:
            torch.ones(1, device=f"cuda:{i}").add_(1)
            free, total = torch.cuda.mem_get_info(i)
            checks.append(Check(f"GPU {i}", Level.OK, f"{props.name}, {total / GIB:.1f} GiB, {free / GIB:.1f} GiB free"))
        except RuntimeError as e:
            checks.append(Check(f"GPU {i}", Level.PROBLEM, f"{props.name} is not usable: {e}",
                                "check the driver and CUDA_VISIBLE_DEVICES; another process may hold it"))
            continue
        checks.append(check_h2d_bandwidth(i))
    return checks


def check_h2d_bandwidth(index: int, nbytes: int = 256 * 2**20, repeats: int = 5) -> Check:
    """Pinned host→device copy rate: what tiered caches pay to bring a layer back."""
    device = torch.device(f"cuda:{index}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    rate = nbytes * repeats / (time.perf_counter() - started) / GB
    detail = f"host→device copy (pinned) {rate:.1f} GB/s"
    if rate < MIN_H2D_GBPS:
        return Check(f"GPU {index} bandwidth", Level.WARN, detail + f", under {MIN_H2D_GBPS:g} GB/s",
                     "check the PCIe link (slot width, generation) and NUMA placement; tiered-host caches will be slow")
    return Check(f"GPU {index} bandwidth", Level.OK, detail)


def offload_root_for(config: JobConfig) -> Path:
    """`cache.offload_root`, else $KVBATCH_OFFLOAD_ROOT, else the default jobs folder (their scratch is under it)."""
    configured = config.cache.offload_root or os.environ.get(OFFLOAD_ROOT_ENV, "").strip()
    return Path(configured) if configured else Path("runs")


@contextmanager
def _scratch_dir(root: Path) -> Iterator[Path]:
    """A temporary dir in `root`, creating `root` if needed; removes whatever it created."""
    first_created = None
    for parent in [root, *root.parents]:
        if parent.exists():
            break
        first_created = parent
    root.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(prefix=".kvbatch-doctor-", dir=root))
    try:
        yield probe
    finally:
        shutil.rmtree(first_created or probe, ignore_errors=True)


def _write_read_rates(folder: Path, nbytes: int) -> tuple[float, float]:
    """MB/s writing `nbytes` (fsynced) and reading them back past the page cache."""
    path = folder / "probe.bin"
    block = os.urandom(_IO_BLOCK)  # incompressible, like zstd-compressed KV blocks
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(nbytes // _IO_BLOCK, 1)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    written = path.stat().st_size
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache
        started = time.perf_counter()
        while f.read(_IO_BLOCK):
            pass
        read_s = time.perf_counter() - started
    return written / write_s / 1e6, written / read_s / 1e6


def check_offload_root(root: Path, io_bytes: int) -> list[Check]:
    where = f"offload root {root}"
    try:
        with _scratch_dir(root) as probe:
            usage = shutil.disk_usage(probe)
            write_mbps, read_mbps = _write_read_rates(probe, io_bytes)
    except OSError as e:
        return [Check("offload root", Level.PROBLEM, f"{where} is not writable: {e.strerror or e}",
                      f"point cache.offload_root (or ${OFFLOAD_ROOT_ENV}) at a writable folder on a local disk")]
    checks = [Check("offload root", Level.OK, f"{where} is writable")]
    free = f"{usage.free / GIB:.1f} GiB free of {usage.total / GIB:.1f} GiB"
    if usage.free < MIN_FREE_BYTES:
        checks.append(Check("offload space", Level.PROBLEM, free, "free space there, or use a larger disk"))
    elif usage.free < LOW_FREE_BYTES:
        checks.append(Check("offload space", Level.WARN, free, "long documents on tiered-disk may not fit: free space"))
    else:
        checks.append(Check("offload space", Level.OK, free))
    speed = f"write {write_mbps:,.0f} MB/s, read {read_mbps:,.0f} MB/s ({io_bytes / 2**20:.0f} MiB, fsync, uncached)"
    if write_mbps < MIN_WRITE_MBPS or read_mbps < MIN_READ_MBPS:
        checks.append(Check("offload speed", Level.WARN,
                            speed + f"; slow for KV offload (want {MIN_WRITE_MBPS:g}+ / {MIN_READ_MBPS:g}+ MB/s)",
                            "put the offload root on a local NVMe drive"))
    else:
        checks.append(Check("offload speed", Level.OK, speed))
    return checks


def check_host_ram() -> Check:
    mem = psutil.virtual_memory()
    detail = f"{mem.total / GIB:.1f} GiB, {mem.available / GIB:.1f} GiB available"
    if mem.available < LOW_RAM_AVAILABLE:
        return Check("host RAM", Level.WARN, detail, "fewer workers (workers.count), or tiered-disk caches")
    return Check("host RAM", Level.OK, detail)


def run_checks(config: JobConfig, io_bytes: int = 64 * 2**20) -> list[Check]:
    return [*check_torch(config), *check_offload_root(offload_root_for(config), io_bytes), check_host_ram()]


def doctor(config: JobConfig, console: Console) -> int:
    """Prints every check and a verdict; 0 when nothing blocks a batch, 1 otherwise."""
    checks = run_checks(config)
    style = {Level.OK: "green", Level.WARN: "yellow", Level.PROBLEM: "red"}
    for c in checks:
        console.print(f"[{style[c.level]}]{c.level.value:>7}[/]  {c.name}: {escape(c.detail)}", highlight=False, soft_wrap=True)
    problems = [c for c in checks if c.level == Level.PROBLEM]
    warnings = [c for c in checks if c.level == Level.WARN]
    if problems:
        console.print(f"[red]verdict: {len(problems)} problem(s); fix before submitting:")
    elif warnings:
        console.print(f"[yellow]verdict: ready, with {len(warnings)} warning(s):")
    else:
        console.print("[green]verdict: ready")
    for c in problems + warnings:
        console.print(f"  - {c.name}: {escape(c.fix)}", highlight=False, soft_wrap=True)
    return 1 if problems else 0
