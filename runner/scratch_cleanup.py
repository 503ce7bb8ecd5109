"""`kvbatch clean`: sweep scratch dirs left by workers that died (SIGKILL, node loss, OOM killer)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from storage.jobdir import JobDir, read_job
from storage.location import Where
from storage.scratch import (
    OFFLOAD_ROOT_ENV,
    ScratchError,
    default_offload_root,
    sweep_orphans,
)


def clean_scratch(job_dir: Where | None, offload_root: Path | None, console: Console) -> int:
    """Sweeps `offload_root` (default: the job's, else $KVBATCH_OFFLOAD_ROOT); only JOB_DIR's job when given."""
    job_id = None
    if job_dir is not None:
        info = read_job(JobDir(job_dir))
        job_id = info.job_id
        configured = info.config.get("cache", {}).get("offload_root")
        offload_root = offload_root or (Path(configured) if configured else default_offload_root(job_dir))
    offload_root = offload_root or (Path(os.environ[OFFLOAD_ROOT_ENV]) if os.environ.get(OFFLOAD_ROOT_ENV) else None)
    if offload_root is None:
        raise ScratchError(f"nothing to clean: give a JOB_DIR, --offload-root DIR or set ${OFFLOAD_ROOT_ENV}")
    swept = sweep_orphans(offload_root, job_id)
    for d in swept:
        console.print(f"removed {d.path} ({d.bytes_freed / 2**20:.1f} MiB; owner {d.owner}: {d.reason})")
    total = sum(d.bytes_freed for d in swept)
    console.print(f"freed {len(swept)} dir(s), {total / 2**20:.1f} MiB under {offload_root}")
    return 0
