"""Starting the workers: an error raised while a worker starts is the job's config error (exit 2, one
line, no retry); a worker Ray cannot place within `workers.start_timeout_s` is a clear error; SIGTERM
while the workers start ends the run at once, and the job resumes."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from jobs.config import ModelConfig
from runner.engine.model_loader import load_model
from runner.observe.joblog import read_log
from tests.helpers.cli import TINY_CONFIG, done_summaries, kvbatch, start_submit, wait_for, write_jsonl


def _manifest(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short note about a meeting."},
                                              {"id": "b", "text": "Minutes of the second meeting."}])


def _events(job: Path) -> list[str]:
    return [entry["event"] for entry in read_log(job / "job.log")] if (job / "job.log").exists() else []


@contextmanager
def _held(cpus: int) -> Iterator[Callable[[], None]]:
    """`cpus` CPUs of the test cluster (it has 2) held by another actor, so no worker is placed on
    them until the returned `release()` (or the end) lets them go."""
    import ray

    @ray.remote(num_cpus=cpus)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote(), timeout=120)

    def release() -> None:
        ray.kill(holder, no_restart=True)

    try:
        yield release
    finally:
        release()


@pytest.fixture
def cpus_held(ray_address: str) -> Iterator[None]:
    with _held(2):
        yield


def _saved_tiny_model(folder: Path) -> Path:
    tiny = load_model(ModelConfig(name="builtin:tiny-random", device="cpu"))
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


def test_a_model_whose_weights_do_not_load_is_a_config_error_of_the_job(tmp_path: Path, ray_address: str) -> None:
    """config.json and the tokenizer are fine (submit's checks pass), the weights file is garbage."""
    model = _saved_tiny_model(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"these are not weights")
    job = tmp_path / "job"
    # the error is not waited out: the submit ends well within workers.start_timeout_s (600 s here)
    proc = kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job),
                   "--address", ray_address, "--set", f"model.name={model}", "--set", "workers.count=1",
                   "--set", "workers.start_timeout_s=600", timeout=300, check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a worker could not start: "), proc.stderr
    assert str(model) in lines[0] and f"kvbatch resume {job}" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr and "ActorDiedError" not in proc.stderr
    assert "a worker could not start" in next(e for e in read_log(job / "job.log")
                                              if e["event"] == "workers_not_started")["error"]
    assert not (job / "results").exists() or not any((job / "results").iterdir())  # no task ran, none retried


def test_a_restarted_worker_whose_start_raises_stops_the_batch_with_that_line(tmp_path: Path, ray_address: str) -> None:
    """The weights go bad while the first worker runs; the task hangs, its worker is killed and
    restarted, and the restart cannot load them: one line, exit 2, not 300 s of waiting for it."""
    model = _saved_tiny_model(tmp_path / "model")
    job = tmp_path / "job"
    hang = json.dumps([{"doc": "a", "fault": "hang", "attempts": [1]}])
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A short note about a meeting."}])
    proc = start_submit(manifest, job, ray_address, "--set", f"model.name={model}", "--set", "retry.task_timeout_s=5",
                        env={"KVBATCH_FAULTS": hang})
    try:
        assert wait_for(lambda: "worker_ready" in _events(job), proc, timeout=120)
        (model / "model.safetensors").write_bytes(b"these are not weights")
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a worker could not start: ModelLoadError"), err
    assert "worker_restart_failed" in _events(job)


def test_a_worker_ray_cannot_place_within_the_start_timeout_is_a_clear_error(
        tmp_path: Path, ray_address: str, cpus_held: None) -> None:
    job = tmp_path / "job"
    proc = kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job),
                   "--address", ray_address, "--set", "workers.start_timeout_s=3", timeout=60, check=4)
    assert "no worker started within workers.start_timeout_s=3 s" in " ".join(proc.stdout.split()), proc.stdout
    assert f"continue with: kvbatch resume {job}" in " ".join(proc.stdout.split())
    assert "Traceback" not in proc.stderr
    assert "workers_not_started" in _events(job)


@pytest.fixture(scope="module")
def stopped_then_resumed(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job for both ends of a start: a submit of two workers SIGTERMed while Ray can place none, then
    resumed with room for one of them (one CPU released), which runs the batch after the start timeout."""
    job = tmp_path_factory.mktemp("start") / "job"
    with _held(1) as release_one, _held(1):
        proc = start_submit(_manifest(job.parent), job, ray_address, "--set", "workers.count=2")
        try:
            assert wait_for(lambda: "batch_start" in _events(job), proc, timeout=120)
            time.sleep(1.0)  # the pool waits for Ray to place its workers, which it cannot
            ready_before_stop = "worker_ready" in _events(job)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
        finally:
            proc.kill()
        stops = [e["during"] for e in read_log(job / "job.log") if e["event"] == "batch_interrupted"]
        release_one()
        resumed = kvbatch("resume", str(job), "--address", ray_address, "--set", "workers.start_timeout_s=20",
                          timeout=300)
    done = set(done_summaries(job)) if resumed.returncode == 0 else None
    return {"job": job, "ready_before_stop": ready_before_stop, "returncode": proc.returncode, "out": out,
            "err": err, "stops": stops, "resumed": resumed, "done": done}


def test_sigterm_while_the_workers_start_ends_the_run_at_once_and_the_job_resumes(stopped_then_resumed: dict) -> None:
    run, job = stopped_then_resumed, stopped_then_resumed["job"]
    assert not run["ready_before_stop"]
    assert run["returncode"] == 130, run["out"] + run["err"]
    assert f"continue with: kvbatch resume {job}" in " ".join(run["out"].split())
    assert "Traceback" not in run["err"]
    assert run["stops"] == ["worker start"]
    assert run["resumed"].returncode == 0, run["resumed"].stdout + run["resumed"].stderr
    assert run["done"] == {"a", "b"}


def test_the_batch_runs_on_the_workers_that_started_within_the_timeout(stopped_then_resumed: dict) -> None:
    """Two workers asked for, room for one: after workers.start_timeout_s the batch runs on that one."""
    job = stopped_then_resumed["job"]
    assert stopped_then_resumed["done"] == {"a", "b"}, stopped_then_resumed["resumed"].stderr
    late = [e for e in read_log(job / "job.log") if e["event"] == "workers_not_started"]
    assert [(e["started"], e["wanted"]) for e in late] == [(1, 2)]
    assert _events(job).count("worker_ready") == 1
