"""`submit` and `resume`: from a manifest or a folder of documents (or a job folder) to a finished batch."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.markup import escape

from jobs.config import JobConfig, apply_settings, config_from_dict, without_retired_keys
from jobs.faults import FAULTS_ENV, parse_faults
from jobs.manifest import (
    ManifestError,
    Rejection,
    read_manifest,
    read_rows,
    table_json,
    tasks_from_table,
    tasks_to_table,
)
from jobs.schema import RESULT_SCHEMA, TaskState, empty_row
from jobs.task import Task
from runner import __version__
from runner.cluster import ray_session
from runner.coordinator import (
    EXIT_FAILED_TASKS,
    EXIT_INTERRUPTED,
    EXIT_LEASE_LOST,
    EXIT_NO_WORKERS,
    EXIT_OK,
    Coordinator,
)
from runner.engine.model_registry import conversion_ahead
from runner.pool import WorkerStartError
from runner.preflight import check_cluster, check_settings, prompt_measure
from storage.checkpoint import JobState, compact, load_state
from storage.inputs import FOLDER_MANIFEST_NAME, stage_input
from storage.jobdir import (
    DEFAULT_JOBS_DIR,
    JobDir,
    JobInfo,
    check_job_folder,
    check_new_job_folder,
    create_job,
    make_job_folder,
    new_job_id,
    read_job,
    read_manifest_table,
    update_job_config,
)
from storage.lease import LeaseLostError, job_lock
from storage.location import Where
from storage.lock import HeldLock
from storage.parts import CORRUPT_PART_ADVICE
from storage.scratch import check_offload_root, offload_root_of

EXIT_USAGE = 2
#: a disk the job writes to (its folder, the offload root) filled up: what was published stays, `resume`
#: continues once there is space
EXIT_NO_SPACE = 6
STOPPED_AFTER_THE_END = "[yellow]stopped after every document had ended: nothing was interrupted"


def _sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rejection_row(rejection: Rejection) -> dict:
    row = empty_row(RESULT_SCHEMA)
    row.update(
        doc_id=rejection.doc_id, task_id=rejection.task_id, status=TaskState.REJECTED.value,
        error_type="RejectedInput", error=rejection.reason, attempts=0, fallbacks=[],
        meta=table_json(rejection.meta), finished_at=time.time(),
    )
    return row


def report_rejections(console: Console, rejections: list[Rejection], limit: int = 20) -> None:
    if not rejections:
        return
    console.print(f"[yellow]{len(rejections)} manifest row(s) rejected (see `kvbatch results --errors`):")
    for r in rejections[:limit]:
        console.print(f"  row {r.row}: {escape(r.reason)}", highlight=False)
    if len(rejections) > limit:
        console.print(f"  ... and {len(rejections) - limit} more")


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops a submit or resume as Ctrl-C does, also before the coordinator takes it over."""
    raise KeyboardInterrupt


def _interruptible(run: Callable[[], int], job: JobDir, console: Console, retry_since: float | None = None) -> int:
    """Ctrl-C or SIGTERM outside the coordinator's run (while Ray starts, say): exit 130 with what to do,
    unless every document had ended (`_all_finished`); a full disk: exit 6, the same (published parts
    stay, a resume reruns only what has no result)."""
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return run()
    except KeyboardInterrupt:
        if job.job_json.exists() and (finished := _all_finished(job, retry_since)) is not None:
            console.print(STOPPED_AFTER_THE_END)
            return _final_report(job, finished, console)
        if job.job_json.exists():
            console.print(f"[yellow]interrupted; continue with: kvbatch resume {escape(str(job.path))}")
        else:
            console.print("[yellow]interrupted before the job folder was made: nothing ran; submit again")
        return EXIT_INTERRUPTED
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) and "No space left on device" not in str(e):
            raise
        console.print(f"[red]no space left on a disk the job writes to ({escape(str(e))}); what was published is kept: "
                      f"free space then `kvbatch resume {escape(str(job.path))}`")
        return EXIT_NO_SPACE
    finally:
        signal.signal(signal.SIGTERM, previous)


def _all_finished(job: JobDir, retry_since: float | None = None) -> JobState | None:
    """The job's state when no document is left to run, else None: a stop asked for after the last one
    ended is no interruption. With `retry_since` (resume --retry-failed) a failure recorded before
    then is still to run."""
    state = load_state(job.path)
    ended = set(state.done_task_ids | state.rejected_task_ids)
    results = state.results.to_pydict()
    ended |= {t for t, status, at in zip(results["task_id"], results["status"], results["finished_at"])
              if status == TaskState.FAILED.value and (retry_since is None or (at or 0) >= retry_since)}
    if any(t.task_id not in ended for t in tasks_from_table(read_manifest_table(job))):
        return None
    return state


def submit(source: str | list[Any], pattern: str | None, config: JobConfig, job_dir: Where | None,
           address: str | None, strict: bool, console: Console, job_id: str | None = None) -> int:
    """`source`: a manifest or a folder of documents, local or on shared storage, or the rows themselves
    (`kvbatch.submit`); `pattern`: --glob; `job_id`: when the caller made its default folder itself."""
    job_id = job_id or new_job_id()
    job = JobDir(job_dir or DEFAULT_JOBS_DIR / job_id)
    return _interruptible(lambda: _submit(job, job_id, source, pattern, config, address, strict, console), job, console)


@dataclass(frozen=True)
class _Given:
    """What submit was given, read: its tasks and rejected rows, how job.json names it, what to say of it."""

    tasks: list[Task]
    rejections: list[Rejection]
    manifest_path: str
    manifest_sha256: str
    notes: tuple[str, ...] = ()  # what a folder's listing left out
    listed: str | None = None  # "N document(s) in FOLDER -> MANIFEST" for a folder
    copies: dict[str, bytes] | None = None  # files kept in the job folder (a folder's manifest)


def _staged(source: str, pattern: str | None, config: JobConfig, job: JobDir) -> _Given:
    """A manifest or a folder, local or on shared storage, read through a local manifest file."""
    with tempfile.TemporaryDirectory(prefix="kvbatch-manifest-") as workdir:
        staged = stage_input(source, pattern, Path(workdir), job.path.local_path if job.path.is_local else None)
        try:
            tasks, rejections = read_manifest(staged.path, config.input, staged.uri_base,
                                              config.summarize.context_tokens, prompt_measure(config))
        except ManifestError as e:  # name the manifest as the user gave it, not its local copy
            raise ManifestError(str(e).replace(str(staged.path), staged.shown)) from None
        if not staged.from_folder:
            manifest_path = staged.shown if staged.uri_base is not None else str(staged.path.resolve())
            return _Given(tasks, rejections, manifest_path, _sha256_of(staged.path), staged.notes)
        manifest_path = str(job.path / FOLDER_MANIFEST_NAME)
        listed = f"{len(tasks) + len(rejections)} document(s) in {source} -> {manifest_path}"
        return _Given(tasks, rejections, manifest_path, _sha256_of(staged.path), staged.notes, listed,
                      {FOLDER_MANIFEST_NAME: staged.path.read_bytes()})


#: how job.json names documents a program gave as rows
GIVEN_ROWS = "rows given to kvbatch.submit"


def _given_rows(rows: list[Any], config: JobConfig) -> _Given:
    """Rows a program gave (`kvbatch.submit`), read as a manifest's are, no file written; relative paths
    from the working directory."""
    tasks, rejections = read_rows(rows, config.input, Path.cwd(), config.summarize.context_tokens,
                                  prompt_measure(config))
    read = table_json({"tasks": tasks_to_table(tasks).to_pylist(), "rejected": [asdict(r) for r in rejections]})
    return _Given(tasks, rejections, GIVEN_ROWS, hashlib.sha256(read.encode("utf-8", "surrogatepass")).hexdigest())


def _submit(job: JobDir, job_id: str, source: str | list[Any], pattern: str | None, config: JobConfig,
            address: str | None, strict: bool, console: Console) -> int:
    check_new_job_folder(job)
    check_settings(config)
    check_offload_root(offload_root_of(job.path, config.cache.offload_root))
    given = _staged(source, pattern, config, job) if isinstance(source, str) else _given_rows(source, config)
    tasks, rejections = given.tasks, given.rejections
    if strict and rejections:
        report_rejections(console, rejections)
        console.print("[red]--strict: nothing was started; fix the rows above and submit again")
        return EXIT_USAGE
    info = JobInfo(
        job_id=job_id, created=time.time(), version=__version__, config=config.model_dump(mode="json"),
        manifest_path=given.manifest_path, manifest_sha256=given.manifest_sha256,
    )
    rejected = pa.Table.from_pylist([_rejection_row(r) for r in rejections], schema=RESULT_SCHEMA)
    with _checked_cluster(config, address, needed=bool(tasks)):
        make_job_folder(job)
        # the first line once there is a job: a refusal before it creates nothing and names no job
        console.print(f"job {job_id} -> {escape(str(job.path))}", highlight=False)
        for note in given.notes:
            console.print(note, style="yellow", markup=False, highlight=False)
        if given.listed:
            console.print(given.listed, markup=False, highlight=False)
        report_rejections(console, rejections)
        # the lock first: a second submit to the same folder refuses instead of writing over this one
        with job_lock(job.lock) as lock:
            create_job(job, info, tasks_to_table(tasks), rejected, given.copies)
            return _execute(job, info, config, address, retry_since=None, console=console, lock=lock)


def resume(job_dir: Where, retry_failed: bool, settings: Mapping[str, Any], address: str | None,
           console: Console, how: str = "--set") -> int:
    """`settings`: dotted keys and values to change in the job's config (`how` names them in an error)."""
    job = JobDir(job_dir)
    retry_since = time.time() if retry_failed else None
    return _interruptible(lambda: _resume(job, retry_since, settings, how, address, console), job, console,
                          retry_since)


def _resume(job: JobDir, retry_since: float | None, settings: Mapping[str, Any], how: str, address: str | None,
            console: Console) -> int:
    check_job_folder(job)
    with job_lock(job.lock) as lock:  # job.json is the running coordinator's until this is held
        info = read_job(job)
        config = config_from_dict(apply_settings(without_retired_keys(info.config), settings, how),
                                  f"{job.job_json} with {how}")
        check_settings(config)
        check_offload_root(offload_root_of(job.path, config.cache.offload_root))
        if settings:
            update_job_config(job, config.model_dump(mode="json"))
        console.print(f"job {info.job_id} <- {escape(str(job.path))}", highlight=False)
        return _execute(job, info, config, address, retry_since, console, lock)


@contextmanager
def _checked_cluster(config: JobConfig, address: str | None, needed: bool) -> Iterator[None]:
    """Connected to Ray, the settings checked against its nodes (submit: before the job folder exists,
    so a setting the cluster cannot run creates nothing). Not `needed` (every row rejected): no Ray."""
    if not needed:
        yield
        return
    try:
        with ray_session(address):
            signal.signal(signal.SIGTERM, _stop_on_sigterm)  # ray.init put its own there: sys.exit(15)
            check_cluster(config)
            yield
    except SystemExit as e:  # SIGTERM inside ray.init, after it set its handler
        if e.code != signal.SIGTERM:
            raise
        raise KeyboardInterrupt from None


def _execute(job: JobDir, info: JobInfo, config: JobConfig, address: str | None, retry_since: float | None,
             console: Console, lock: HeldLock) -> int:
    """Run the job's open tasks under the job lock the caller holds (every write is fenced with it);
    `retry_since`: failed documents run again too (resume --retry-failed, asked at that time)."""
    faults = parse_faults(os.environ.get(FAULTS_ENV))
    offload_root = offload_root_of(job.path, config.cache.offload_root)
    tasks = tasks_from_table(read_manifest_table(job))
    state = load_state(job.path)
    for part in state.corrupt:
        console.print(f"[yellow]skipped a damaged checkpoint part: {escape(str(part))}")
    if state.corrupt:
        console.print(f"  {CORRUPT_PART_ADVICE}", highlight=False)
    finished = state.done_task_ids | state.rejected_task_ids
    if retry_since is None:
        finished |= state.failed_task_ids
    open_tasks = [t for t in tasks if t.task_id not in finished]
    total = len(tasks)  # the documents to run: rejected rows are said apart (report_rejections, _final_report)
    console.print(f"{len(tasks)} task(s): {len(tasks) - len(open_tasks)} already finished, {len(open_tasks)} to run")
    code = EXIT_OK
    if open_tasks:
        if (conversion := conversion_ahead(config.model.name)) is not None:
            console.print(conversion, style="yellow", markup=False, highlight=False)
        with _checked_cluster(config, address, needed=True):  # submit's session, or resume's own
            coordinator = Coordinator(job, info.job_id, config, offload_root, faults, console, lock)
            try:
                code = coordinator.run(open_tasks, total - len(open_tasks), total)
            except WorkerStartError as e:
                if e.full_disk is not None:  # no setting is wrong: the stop of a full job folder (exit 6)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(e.full_disk)) from None
                raise WorkerStartError(f"{e}; fix that setting and continue with: kvbatch resume {job.path} "
                                       "--set key=value") from None
    if code == EXIT_INTERRUPTED and _all_finished(job, retry_since) is not None:
        console.print(STOPPED_AFTER_THE_END)
        code = EXIT_OK
    if code in (EXIT_INTERRUPTED, EXIT_NO_WORKERS):
        what = "interrupted" if code == EXIT_INTERRUPTED else "stopped without workers"
        console.print(f"[yellow]{what}; continue with: kvbatch resume {escape(str(job.path))}")
        return code
    if code == EXIT_LEASE_LOST:
        return code
    try:
        compact(job.path, lock.check)
    except LeaseLostError as e:
        console.print(f"[red]{escape(str(e))}")
        return EXIT_LEASE_LOST
    state = load_state(job.path)
    return _final_report(job, state, console)


def _final_report(job: JobDir, state: JobState, console: Console) -> int:
    done, failed, rejected = len(state.done_task_ids), len(state.failed_task_ids), len(state.rejected_task_ids)
    console.print(f"done {done}, failed {failed}, rejected {rejected}; results in {escape(str(job.results))}")
    console.print(f"export: kvbatch results {escape(str(job.path))} -o summaries.jsonl")
    if not failed and not rejected:
        return EXIT_OK
    # one rule for the CLI and the API: a run that left any document undone, failed or rejected, exits 3
    if rejected and not done and not failed:
        what = "every document was rejected, none was summarised"
    else:
        what = ", ".join(f"{n} document(s) {word}" for n, word in ((failed, "failed"), (rejected, "rejected")) if n)
    console.print(f"[red]{what}: kvbatch results {escape(str(job.path))} --errors")
    return EXIT_FAILED_TASKS
