"""Per-task offload dirs through the real CLI and real Ray workers: isolated, always removed, orphans
swept, and a full disk turned into a shorter context instead of a lost batch (issue 5, "Must show").

A thread polls the offload root while a batch runs, so each test sees the task dirs (and their KV
block files) that existed during the batch, not only the empty root left afterwards. Results are read
from the job folder in this process: the export command is tests/test_export.py's.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from runner.observe.joblog import read_log
from runner.pool import PROBE_INTERVAL_S
from storage.scratch import OWNER_FILE, ROOT_MARKER
from tests.helpers.child_process import Child
from tests.helpers.cli import TINY_CONFIG, kvbatch, license_manifest, start_submit, wait_for
from tests.helpers.system import mounted_tmpfs

DISK = ["--set", "cache.strategy=tiered-disk"]
ONE_WORKER = ["--set", "workers.count=1"]
BLOCK_SUFFIX = ".kvblocks"
WIDE = {"COLUMNS": "1000"}  # rich wraps long paths at 80 columns when stdout is not a terminal

HOLD_LIVE_DIR = """
import sys, time
from pathlib import Path
from storage.scratch import task_scratch
with task_scratch(Path(sys.argv[1]), "live-job", "t000001", 1) as scratch:
    print(scratch, flush=True)
    time.sleep(600)
"""


def with_root(root: Path) -> list[str]:
    return ["--set", f"cache.offload_root={root}"]


def task_dirs(root: Path) -> list[Path]:
    """Every `<job_id>/<task_id>.<attempt>` dir under the root, whatever it holds."""
    return sorted(t for j in root.iterdir() if j.is_dir() for t in j.iterdir()) if root.exists() else []


def block_files(task_dir: Path) -> list[Path]:
    return list(task_dir.rglob(f"*{BLOCK_SUFFIX}"))


@dataclass
class Sighting:
    """What one task dir held while the batch ran."""

    owner: dict = field(default_factory=dict)
    had_blocks: bool = False


class RootWatcher:
    """Polls an offload root every few ms from a thread, recording every task dir it saw."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs: dict[tuple[str, str], Sighting] = {}  # (job id, "<task_id>.<attempt>") -> sighting
        self.stray: set[str] = set()  # anything outside <job>/<task>.<attempt>/ but the root marker
        self.jobs_at_once = 0  # most job ids holding task dirs at one instant
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _look(self) -> None:
        jobs_now = set()
        for folder, subdirs, files in os.walk(self.root):
            rel = Path(folder).relative_to(self.root).parts
            if len(rel) < 2:
                self.stray.update(str(Path(*rel, f)) for f in files if f != ROOT_MARKER)
                continue
            if rel[1].startswith("."):  # a task dir being made under its staging name: seen once it has its own
                continue
            sighting = self.dirs.setdefault((rel[0], rel[1]), Sighting())
            jobs_now.add(rel[0])
            if len(rel) == 2 and OWNER_FILE in files and not sighting.owner:
                try:
                    sighting.owner = json.loads((Path(folder) / OWNER_FILE).read_text())
                except (OSError, ValueError):
                    pass  # removed or being renamed into place right now: read it on the next look
            sighting.had_blocks |= any(f.endswith(BLOCK_SUFFIX) for f in files)
        self.jobs_at_once = max(self.jobs_at_once, len(jobs_now))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            time.sleep(0.002)

    def task_ids_with_blocks(self) -> set[str]:
        return {name.rsplit(".", 1)[0] for (_, name), s in self.dirs.items() if s.had_blocks}

    def __enter__(self) -> "RootWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def rows_by_doc(job: Path) -> dict[str, dict]:
    """The job's result rows, one a document, as `kvbatch results` exports them."""
    from storage.export import results_table

    return {r["doc_id"]: r for r in results_table(str(job), errors_only=False).to_pylist()}


def wait_for_task_dir_with_blocks(root: Path, proc: subprocess.Popen) -> Path:
    found: list[Path] = []

    def mid_task() -> bool:
        found[:] = [d for d in task_dirs(root) if (d / OWNER_FILE).is_file() and block_files(d)]
        return bool(found)

    assert wait_for(mid_task, proc, poll=0.002), "the batch ended before a task wrote KV blocks"
    return found[0]


def wait_until_dead(pid: int, timeout_s: float = 30) -> None:
    try:
        process = psutil.Process(pid)
        deadline = time.monotonic() + timeout_s
        while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"pid {pid} still alive after SIGKILL"
            time.sleep(0.01)
    except psutil.NoSuchProcess:
        pass


def fill(path: Path, nbytes: int, timeout_s: float = 30) -> None:
    """Allocate `nbytes` to a file, waiting while the running task holds too much of the disk for it."""
    deadline = time.monotonic() + timeout_s
    with open(path, "wb") as f:
        while True:
            try:
                os.posix_fallocate(f.fileno(), 0, nbytes)
                return
            except OSError as e:
                if e.errno != errno.ENOSPC or time.monotonic() > deadline:
                    raise
                time.sleep(0.001)


def test_no_task_dir_survives_success_failure_timeout_or_oom(ray_address, tmp_path):
    """One worker, one task at a time (longest first): the hang, on the shortest document, comes last, so
    no task waits for its restarted worker, and it is never a batch-mate's loss (which is not an attempt)."""
    root = tmp_path / "kv"
    faults = [
        {"doc": "cc0-1.0", "fault": "io"},  # fails every attempt
        {"doc": "bsd", "fault": "hang"},  # times out every attempt; its worker is killed
        {"doc": "apache-2.0", "fault": "oom", "rungs": ["tiered-disk"]},  # moves to the next rung
    ]
    job = tmp_path / "job"
    with RootWatcher(root) as watcher:
        kvbatch("submit", str(license_manifest(tmp_path, ["GPL-3", "BSD", "CC0-1.0", "Apache-2.0"])),
                "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address, *with_root(root),
                "--set", "cache.strategy=auto", "--set", "cache.ladder=[tiered-disk, dynamic]",
                "--set", "retry.max_attempts=1", "--set", "summarize.min_context_tokens=1024", *ONE_WORKER,
                "--set", "batch.max_sequences=1",
                # long enough that GPL-3 (nine chunks, 1.8 s in a quiet serial run) does not time out on a
                # loaded machine: only the hang does, and the wait for it costs no CPU
                "--set", "retry.task_timeout_s=12", env={"KVBATCH_FAULTS": json.dumps(faults)}, check=3)
    rows = rows_by_doc(job)
    assert rows["gpl-3"]["status"] == "done" and rows["gpl-3"]["cache_strategy"] == "tiered-disk"
    assert rows["gpl-3"]["offload_bytes_written"] > 0
    assert rows["cc0-1.0"]["status"] == "failed" and rows["cc0-1.0"]["error_type"] == "OSError"
    assert rows["bsd"]["status"] == "failed" and rows["bsd"]["error_type"] == "TimeoutError"
    assert rows["apache-2.0"]["status"] == "done" and rows["apache-2.0"]["cache_strategy"] == "dynamic"
    assert rows["apache-2.0"]["fallbacks"] == ["cache:tiered-disk->dynamic (OutOfMemoryError)"]
    # every task wrote KV blocks into its own dir before it ended, however it ended ...
    assert watcher.task_ids_with_blocks() == {r["task_id"] for r in rows.values()}
    assert not watcher.stray
    # ... and none of those dirs is left
    assert task_dirs(root) == []
    assert sorted(p.name for p in root.iterdir()) == [ROOT_MARKER]


def test_a_worker_killed_mid_task_leaves_its_dir_and_the_restarted_worker_sweeps_it(ray_address, tmp_path):
    root = tmp_path / "kv"
    job = tmp_path / "job"
    proc = start_submit(license_manifest(tmp_path, ["GPL-3", "GPL-2"]), job, ray_address, *DISK, *ONE_WORKER,
                        *with_root(root))
    try:
        left = wait_for_task_dir_with_blocks(root, proc)
        pid = json.loads((left / OWNER_FILE).read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until_dead(pid)
        assert block_files(left), "a SIGKILLed worker cannot remove its own dir"
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    rows = rows_by_doc(job)
    killed_task = left.name.rsplit(".", 1)[0]
    [killed] = [r for r in rows.values() if r["task_id"] == killed_task]
    log = [e for e in read_log(job / "job.log") if e.get("task_id") == killed_task or e["event"] == "worker_lost"]
    assert killed["status"] == "done" and killed["attempts"] == 2, (killed, log)
    assert not left.exists()  # swept by the worker Ray restarted in place of the killed one
    assert task_dirs(root) == []


def test_kvbatch_clean_removes_a_dead_workers_dir_never_a_live_ones(ray_address, tmp_path):
    root = tmp_path / "kv"
    job = tmp_path / "job"
    proc = start_submit(license_manifest(tmp_path, ["GPL-3"]), job, ray_address, *DISK, *ONE_WORKER, *with_root(root))
    try:
        left = wait_for_task_dir_with_blocks(root, proc)
        pid = json.loads((left / OWNER_FILE).read_text())["pid"]
        # the worker frozen first (a coordinator's death could otherwise end it gracefully, cleaning its dir),
        # then the coordinator, so nothing restarts the worker, then the worker itself
        os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        proc.wait()
        wait_until_dead(pid)
    finally:
        proc.kill()
    live = Child(HOLD_LIVE_DIR, str(root))
    try:
        live_dir = Path(live.read_line())
        assert left.is_dir() and live_dir.is_dir()
        dead = [d for d in task_dirs(root) if d != live_dir]  # every pass the dead worker ran at once
        assert left in dead
        out = kvbatch("clean", "--offload-root", str(root), env=WIDE, check=0).stdout
        assert all(f"removed {d}" in out for d in dead) and f"freed {len(dead)} dir(s)" in out, out
        assert not any(d.exists() for d in dead)
        assert (live_dir / OWNER_FILE).is_file(), "kvbatch clean touched a dir whose owner is alive"
    finally:
        live.kill()
    out = kvbatch("clean", str(job), env=WIDE, check=0).stdout  # only this job's dirs: the live one is another job's
    assert "freed 0 dir(s)" in out and live_dir.exists()
    out = kvbatch("clean", "--offload-root", str(root), env=WIDE, check=0).stdout
    assert f"removed {live_dir}" in out and task_dirs(root) == []


def task_owners(root: Path) -> dict[Path, int]:
    """Task dir -> pid of the worker that owns it, for every task dir owned now."""
    owners = {}
    for task_dir in task_dirs(root):
        try:
            owners[task_dir] = json.loads((task_dir / OWNER_FILE).read_text())["pid"]
        except (OSError, ValueError):
            pass  # not owned yet, or removed right now
    return owners


def wait_for_long_owned_dir(root: Path, proc: subprocess.Popen, seconds: float, job_id: str) -> tuple[Path, int]:
    """A task dir of `job_id` and its owner's pid, once one has been owned for `seconds`: its task has run that
    long."""
    first_seen: dict[Path, float] = {}
    found: list[tuple[Path, int]] = []

    def long_owned() -> bool:
        now = time.monotonic()
        found[:] = [(d, pid) for d, pid in task_owners(root).items()
                    if d.parent.name == job_id and now - first_seen.setdefault(d, now) >= seconds]
        return bool(found)

    assert wait_for(long_owned, proc, poll=0.01), f"the batch ended before a task dir was owned for {seconds:g}s"
    return found[0]


def test_two_concurrent_jobs_on_one_root_never_see_each_others_files(ray_address, tmp_path):
    names = ["GPL-3", "GPL-2", "LGPL-2.1"]
    # tasks long enough to outlast the wait below; the reference on one worker too: a worker's torch thread
    # count can flip a near-tie over many tokens
    # (a merge of two 64-token summaries needs more than tiny.yaml's 256-token smallest context)
    longer = ["--set", "summarize.max_new_tokens=64", "--set", "summarize.min_context_tokens=512"]
    reference = tmp_path / "reference"
    kvbatch("submit", str(license_manifest(tmp_path, names)), "-c", str(TINY_CONFIG), "-j", str(reference),
            "--address", ray_address, "--set", "cache.strategy=dynamic", *ONE_WORKER, *longer, check=0)
    root = tmp_path / "kv"
    jobs = [tmp_path / "job-a", tmp_path / "job-b"]
    with RootWatcher(root) as watcher:
        # the barrier: job a's worker is stopped inside a task until job b's worker holds a task dir too, so
        # the two jobs overlap however fast or slow the machine is. It is stopped once the coordinator has
        # seen the task begin (it asks every PROBE_INTERVAL_S; a stopped worker would not answer and be hung).
        # Job b starts once job a's first task has: its start overlaps that wait, and its tasks, as long as
        # job a's, cannot end before job a's worker is stopped
        first = start_submit(license_manifest(tmp_path, names), jobs[0], ray_address, *DISK, *ONE_WORKER,
                             *with_root(root), *longer)
        assert wait_for(lambda: task_owners(root), first, poll=0.01), "job a ended before it owned a task dir"
        a_id = json.loads((jobs[0] / "job.json").read_text())["job_id"]
        second = start_submit(license_manifest(tmp_path, names), jobs[1], ray_address, *DISK, *ONE_WORKER,
                              *with_root(root), *longer)
        paused_dir, paused = wait_for_long_owned_dir(root, first, PROBE_INTERVAL_S + 3, a_id)
        os.kill(paused, signal.SIGSTOP)
        try:
            b_owns_one = lambda: {d.parent for d in task_owners(root)} - {paused_dir.parent}  # noqa: E731
            assert wait_for(b_owns_one, second, poll=0.002), "job b ended before it owned a task dir"
            assert paused_dir.is_dir(), "job a's task dir went while its worker was stopped"
        finally:
            os.kill(paused, signal.SIGCONT)
        for p in (first, second):
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, out + err
    job_ids = {json.loads((job / "job.json").read_text())["job_id"]: job for job in jobs}
    assert watcher.jobs_at_once == 2, "the two jobs never had task dirs at the same time"
    assert not watcher.stray
    pids: dict[str, set[int]] = {job_id: set() for job_id in job_ids}
    for (job_id, name), sighting in watcher.dirs.items():
        assert job_id in job_ids, f"a dir of an unknown job: {job_id}/{name}"
        assert sighting.owner.get("job_id") == job_id, f"{job_id}/{name} is owned by {sighting.owner}"
        pids[job_id].add(sighting.owner["pid"])
    assert not set.intersection(*pids.values()), "one worker process wrote into both jobs' dirs"
    expected = {doc: r["summary"] for doc, r in rows_by_doc(reference).items()}
    for job_id, job in job_ids.items():
        rows = rows_by_doc(job)
        # both jobs run the same task ids: only the job id keeps their dirs apart
        assert {name.rsplit(".", 1)[0] for j, name in watcher.dirs if j == job_id} == {r["task_id"] for r in rows.values()}
        assert {doc: r["summary"] for doc, r in rows.items()} == expected
        assert all(r["cache_strategy"] == "tiered-disk" for r in rows.values())
    assert task_dirs(root) == []


def test_a_small_disk_refuses_passes_that_cannot_fit_and_they_run_shorter(ray_address, tmp_path):
    # tiny-random keeps 1 KiB of KV a token: a chunk's pass of 1024 tokens (1 MiB) does not fit a 1 MiB
    # disk (with its reserve), one of 512 tokens does; a pass claims what it will write, so BSD's one pass
    # (~600 tokens with its answer) fits at the full context
    with mounted_tmpfs(tmp_path / "small", f"size={2**20}") as disk:
        root = disk / "kvbatch"
        job = tmp_path / "job"
        kvbatch("submit", str(license_manifest(tmp_path, ["GPL-3", "BSD"])), "-c", str(TINY_CONFIG),
                "-j", str(job), "--address", ray_address, *DISK, *with_root(root), check=0)
        rows = rows_by_doc(job)
        for row in rows.values():
            assert row["status"] == "done", row
            assert row["cache_strategy"] == "tiered-disk" and row["offload_bytes_written"] > 0
        long, short = rows["gpl-3"], rows["bsd"]
        assert long["context_tokens"] == 512 and long["fallbacks"] == [
            "cache:tiered-disk->exhausted (ScratchSpaceError)", "context:1024->512 (ScratchSpaceError)"]
        assert short["context_tokens"] == 1024 and short["chunks"] == 1 and short["fallbacks"] == []
        log = (job / "job.log").read_text()
        assert f"offload root {root.resolve()} has" in log and "Use a shorter context" in log
        assert task_dirs(root) == []


def test_a_disk_too_small_for_any_context_fails_those_tasks_clearly(ray_address, tmp_path):
    with mounted_tmpfs(tmp_path / "small", f"size={256 * 2**10}") as disk:
        root = disk / "kvbatch"
        job = tmp_path / "job"
        proc = kvbatch("submit", str(license_manifest(tmp_path, ["BSD", "CC0-1.0"])), "-c", str(TINY_CONFIG),
                       "-j", str(job), "--address", ray_address, *with_root(root), *ONE_WORKER,
                       "--set", "cache.strategy=auto", "--set", "cache.ladder=[dynamic, tiered-disk]",
                       "--set", "cache.device_kv_budget_bytes=600000", "--set", "summarize.min_context_tokens=1024",
                       check=3)
        rows = rows_by_doc(job)
        # BSD's KV fits the device budget and never needs the disk; CC0's needs the disk, which is too small
        # even for the smallest allowed context (min_context_tokens = context_tokens: nothing shorter to try)
        assert rows["bsd"]["status"] == "done" and rows["bsd"]["cache_strategy"] == "dynamic"
        cc0 = rows["cc0-1.0"]
        assert cc0["status"] == "failed" and cc0["error_type"] == "ScratchSpaceError", cc0
        assert f"offload root {root.resolve()} has" in cc0["error"] and "needs" in cc0["error"]
        assert "1 document(s) failed" in proc.stdout
        assert task_dirs(root) == []


def test_a_disk_that_fills_up_mid_task_is_cleaned_and_the_task_retried_shorter(ray_address, tmp_path):
    # A 2 MiB disk: the guard lets a 1024-token task start (1 MiB planned). Once it has written blocks,
    # another process takes all but 720 KiB, less than a 1024-token pass writes (~860 KiB compressed)
    # but more than the guard wants for 512 tokens (512 KiB + a 102 KiB reserve).
    with mounted_tmpfs(tmp_path / "small", f"size={2 * 2**20}") as disk:
        root = disk / "kvbatch"
        job = tmp_path / "job"
        # one pass at a time, so the pass writing when the disk fills is the one that meets it (no next pass
        # is refused room first)
        proc = start_submit(license_manifest(tmp_path, ["GPL-3"]), job, ray_address, *DISK, *with_root(root),
                            "--set", "batch.max_sequences=1")
        try:
            task_dir = wait_for_task_dir_with_blocks(root, proc)
            # all but 720 KiB of what the task's own files do not hold (the root marker and owner file: a page each)
            fill(disk / "filler", shutil.disk_usage(disk).total - 720 * 2**10 - 2 * 4096)
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, out + err
        [row] = rows_by_doc(job).values()
        assert row["status"] == "done" and row["context_tokens"] == 512, row
        # ENOSPC is a memory-class failure: the ladder is exhausted at once, then the context shrinks
        assert row["fallbacks"] == ["cache:tiered-disk->exhausted (OSError)", "context:1024->512 (OSError)"], row
        assert "No space left on device" in (job / "job.log").read_text()
        assert not task_dir.exists() and task_dirs(root) == []


def test_ctrl_c_mid_task_leaves_the_offload_root_holding_only_its_marker(ray_address, tmp_path):
    """ray.kill is asynchronous: the batch's last sweep must wait until the killed workers are gone."""
    root = tmp_path / "kv"
    job = tmp_path / "job"
    proc = start_submit(license_manifest(tmp_path, ["GPL-3", "GPL-2", "LGPL-3"]), job, ray_address, *DISK,
                        "--set", "workers.count=2", *with_root(root))
    try:
        in_flight = wait_for_task_dir_with_blocks(root, proc)
        owner_pid = json.loads((in_flight / OWNER_FILE).read_text())["pid"]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert not psutil.pid_exists(owner_pid) or psutil.Process(owner_pid).status() == psutil.STATUS_ZOMBIE
    assert sorted(p.name for p in root.iterdir()) == [ROOT_MARKER], task_dirs(root)
    assert "kvbatch resume" in out
