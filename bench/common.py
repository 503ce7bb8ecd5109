"""What the benches that drive the real CLI share: `kvbatch` run as a user runs it, its exit checked,
and the job folder read back, with the batch phase and the mean batch measured one way for all; and
an older revision of this repository checked out beside it, for a bench that runs both side by side.

The batch phase runs from the last `worker_ready` to `batch_end` in job.log: Ray start-up and the
workers' model loads before it are fixed costs paid once per batch, and compaction and Ray's
shut-down come after it. A bench that needs the worker's own figures reads them from the result
rows (`JobRun.rows`, deduplicated as `kvbatch results` reads them).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runner.observe.joblog import read_log
from storage.checkpoint import load_state

LICENSES = Path("/usr/share/common-licenses")
TAIL_CHARS = 2000


@contextmanager
def revision_tree(revision: str) -> Iterator[Path]:
    """`revision` of this repository checked out (`git worktree add --detach`) in a temporary folder,
    removed again afterwards: a tree a subprocess can put first on sys.path to run that revision's code
    with this checkout's virtual environment."""
    folder = Path(tempfile.mkdtemp(prefix=f"kvbench-{revision}-"))
    tree = folder / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), revision], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def write_manifest(path: Path, documents: list[dict[str, Any]]) -> Path:
    """A JSONL manifest of `documents` (each an `id` and a `text` or `path`)."""
    path.write_text("".join(json.dumps(d) + "\n" for d in documents), encoding="utf-8")
    return path


@contextmanager
def local_ray(cpus: int) -> Iterator[str]:
    """One local Ray that several submits share (`--address`), so none pays Ray's start-up: its address."""
    import ray

    from runner.cluster import init_local_ray

    init_local_ray(num_cpus=cpus, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


class Unfinished(Exception):
    """A command still running at its time limit (it was killed): a figure of its own, not a crash."""


def kvbatch(args: list[str], watch: Callable[[], None] | None = None, tree: Path = REPO,
            limit_s: float | None = None) -> tuple[float, str]:
    """Run `kvbatch <args>` (the checkout at `tree`, this one unless another revision is compared, from
    its root) and return its wall seconds and stdout; `watch` is called every 50 ms while it runs. A
    non-zero exit ends the bench with the command's output, since every figure after it would be
    wrong; one still running after `limit_s` is killed (`Unfinished`). The output goes to files, not
    pipes, so a chatty command cannot fill a pipe and stall while `watch` polls."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=tree, stdout=out, stderr=err, text=True)
        while proc.poll() is None:
            if watch is not None:
                watch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)  # returns at the exit, so the wall time is not rounded up to a poll
            if limit_s is not None and proc.poll() is None and time.perf_counter() - started > limit_s:
                proc.kill()
                proc.wait()
                raise Unfinished(f"kvbatch {' '.join(args[:2])} still running after {limit_s:g} s: killed")
        elapsed = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"kvbatch {' '.join(args[:2])} exited {proc.returncode}:\n{stdout[-TAIL_CHARS:]}\n"
                         f"{stderr[-TAIL_CHARS:]}")
    return elapsed, stdout


@dataclass(frozen=True)
class JobRun:
    """A finished `kvbatch submit`: its wall time, its job.log and its result rows."""

    job: Path
    started_at: float  # time.time() when the command started
    wall_s: float
    log: list[dict[str, Any]]
    rows: list[dict[str, Any]]

    def first(self, event: str) -> dict[str, Any]:
        return next(e for e in self.log if e.get("event") == event)

    @property
    def ready(self) -> list[dict[str, Any]]:
        """The `worker_ready` events, one a worker, each with the worker's model load seconds."""
        return [e for e in self.log if e.get("event") == "worker_ready"]

    @property
    def batch_started_at(self) -> float:
        """When the last worker was ready: the batch phase starts here."""
        return max(e["ts"] for e in self.ready)

    @property
    def batch_s(self) -> float:
        """The batch phase: last worker ready -> batch_end."""
        return self.first("batch_end")["ts"] - self.batch_started_at

    @property
    def docs_per_hour(self) -> float:
        return len(self.rows) / self.batch_s * 3600

    @property
    def summaries(self) -> dict[str, str]:
        return {r["doc_id"]: r["summary"] for r in self.rows if r["status"] == "done"}

    @property
    def mean_batch(self) -> float:
        """Mean sequences per decode step, each document's `batch_size` weighted by its decode tokens."""
        steps = [(r["batch_size"], decoded_tokens(r)) for r in self.rows if r["status"] == "done"]
        return sum(b * n for b, n in steps) / max(sum(n for _, n in steps), 1)


def decoded_tokens(row: dict[str, Any]) -> float:
    """Tokens a document's decode steps made over all its passes (map chunks and merges included)."""
    return (row["decode_tokens_per_s"] or 0.0) * (row["decode_s"] or 0.0)


def submit(manifest: Path, config: Path, job: Path, settings: list[str], address: str | None = None,
           watch: Callable[[], None] | None = None, tree: Path = REPO, limit_s: float | None = None) -> JobRun:
    """`kvbatch submit` of `manifest` with `--set` for each of `settings` (later ones win), on the Ray
    at `address` (None: its own local Ray), run from the checkout at `tree`, killed past `limit_s`
    (`Unfinished`); every result must be done."""
    args = ["submit", str(manifest), "-c", str(config), "-j", str(job), *(a for s in settings for a in ("--set", s))]
    if address is not None:
        args += ["--address", address]
    started_at = time.time()
    wall_s, _ = kvbatch(args, watch, tree, limit_s)
    rows = load_state(job).results.to_pylist()
    failed = [f"{r['doc_id']}: {r['status']} ({r['error_type']}: {r['error']})" for r in rows if r["status"] != "done"]
    if failed:
        raise SystemExit(f"{job}: {len(failed)} document(s) not done:\n" + "\n".join(failed))
    return JobRun(job, started_at, wall_s, read_log(job / "job.log"), rows)
