"""`kvbatch clean`: sweep scratch dirs left by workers that died (SIGKILL, node loss, OOM killer)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from storage.jobdir import DEFAULT_JOBS_DIR, JobDir, JobDirError, read_job
from storage.location import Where
from storage.scratch import OFFLOAD_ROOT_ENV, offload_root_of, shared_storage_offload_root, sweep_orphans


def clean_scratch(job_dir: Where | None, offload_root: Path | None, console: Console) -> int:
    """Sweeps `offload_root` (default: the job's, else $KVBATCH_OFFLOAD_ROOT); only JOB_DIR's job when given.
    With none of them, every root a job of this working directory's runs/ or a shared-storage job uses."""
    job_id = None
    if job_dir is not None:
        info = read_job(JobDir(job_dir))
        job_id = info.job_id
        offload_root = offload_root or offload_root_of(job_dir, info.config.get("cache", {}).get("offload_root"))
    offload_root = offload_root or (Path(os.environ[OFFLOAD_ROOT_ENV]) if os.environ.get(OFFLOAD_ROOT_ENV) else None)
    roots = [offload_root] if offload_root is not None else _default_roots(console)
    if not roots:
        console.print(f"nothing to clean: no job folder in {DEFAULT_JOBS_DIR.resolve()} and no "
                      f"{shared_storage_offload_root()} (give a JOB_DIR or --offload-root DIR)")
    for root in roots:
        swept = sweep_orphans(root, job_id)
        for d in swept:
            console.print(f"removed {d.path} ({d.bytes_freed / 2**20:.1f} MiB; owner {d.owner}: {d.reason})")
        total = sum(d.bytes_freed for d in swept)
        console.print(f"freed {len(swept)} dir(s), {total / 2**20:.1f} MiB under {root}")
    return 0


def _default_roots(console: Console) -> list[Path]:
    """The offload roots of the job folders in runs/ (submit's default -j) and the shared-storage jobs' folder,
    those that exist: sweeping one removes only dirs whose owner process is gone, whatever job they belong to."""
    roots = [shared_storage_offload_root()]
    for job_json in sorted(DEFAULT_JOBS_DIR.glob("*/job.json")) if DEFAULT_JOBS_DIR.is_dir() else []:
        try:
            config = read_job(JobDir(job_json.parent)).config
            roots.append(offload_root_of(job_json.parent, config.get("cache", {}).get("offload_root")))
        except JobDirError as e:
            console.print(f"[yellow]skipped {escape(str(job_json.parent))}: {escape(str(e))}")
    unique = dict.fromkeys(root.resolve() for root in roots if root.is_dir())
    return list(unique)
