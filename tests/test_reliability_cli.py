"""What users give the CLI reaches their screen, plots and listings as data, and a stop at any moment ends cleanly.

Doc ids and paths that look like Rich markup or mathtext, a file:// folder with a symlinked subfolder,
and SIGTERM while `kvbatch submit` is still starting Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from runner.cli import app
from runner.observe.report_plots import fallback_ladder, figure_png, latency_split
from runner.submit import EXIT_NO_SPACE
from storage.inputs import stage_input
from tests.helpers.cli import (
    REPO,
    TINY_CONFIG,
    done_summaries,
    kvbatch,
    license_manifest,
    start_submit,
    wait_for,
    write_jsonl,
)
from tests.helpers.results import done_row
from tests.helpers.system import fill_disk, mounted_tmpfs


def test_markup_in_a_doc_id_is_printed_as_it_is(tmp_path: Path) -> None:
    """The rejected row's id `bad[/x]` is a closing tag to Rich: it is shown, not parsed (MarkupError before)."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "bad[/x]", "text": " "}])
    result = CliRunner().invoke(app, ["submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job")])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 3, result.output
    assert "bad[/x]" in result.output and "row 1:" in result.output


def test_markup_in_a_path_of_an_error_is_printed_as_it_is(tmp_path: Path) -> None:
    missing = tmp_path / "no[/such]job"
    result = CliRunner().invoke(app, ["status", str(missing)])
    assert result.exit_code == 2, (result.exception, result.output)
    assert "error:" in result.output and str(missing) in result.output


def test_plots_draw_a_doc_id_with_dollars_as_text() -> None:
    """`$\\frac{$` is a broken formula to mathtext; as a tick label it is drawn as it is."""
    rows = [{**done_row(doc), "wall_s": 1.5, "input_tokens": 40, "cache_strategy": "dynamic"}
            for doc in ("$\\frac{$", "plain")]
    for plot in (latency_split, fallback_ladder):
        png = figure_png(plot(rows, []))
        assert png.startswith(b"\x89PNG")


def test_a_file_uri_folder_leaves_symlinked_subfolders_out_as_a_path_does(tmp_path: Path) -> None:
    docs, outside = tmp_path / "docs", tmp_path / "outside"
    docs.mkdir()
    outside.mkdir()
    (docs / "a.txt").write_text("a document")
    (outside / "b.txt").write_text("not in the folder")
    (docs / "linked").symlink_to(outside, target_is_directory=True)
    (docs / "loop").symlink_to(docs, target_is_directory=True)
    by_path = stage_input(str(docs), None, _workdir(tmp_path, "path"))
    by_uri = stage_input(f"file://{docs}/", None, _workdir(tmp_path, "uri"))
    assert by_uri.from_folder and by_uri.path.read_text().count("\n") == 1
    assert '"id": "a.txt"' in by_uri.path.read_text() and f'"path": "file://{docs}/a.txt"' in by_uri.path.read_text()
    assert by_uri.notes == by_path.notes
    assert "left out 2 symlinked folder(s)" in by_uri.notes[0] and "linked ->" in by_uri.notes[0]


def _workdir(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    return tmp_path / name


def _ray_started_by(pid: int) -> bool:
    """A Ray process (gcs_server, raylet, ...) that `pid` has started: ray.init is under way."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"ray" in (stat.parent / "cmdline").read_bytes():
                return True
        except (OSError, IndexError, ValueError):
            continue
    return False


def test_sigterm_while_ray_starts_exits_130_with_what_to_do(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "memo", "text": "The board approved the budget."}])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # a private local Ray: the submit starts it
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert wait_for(lambda: _ray_started_by(proc.pid), proc, timeout=120, poll=0.05), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert "task(s):" not in out, out  # the signal landed before the job ran: while Ray started
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "interrupted" in out and "Traceback" not in err, (out, err)


def test_disk_full_while_checkpointing_stops_resumably(tmp_path: Path, ray_address: str) -> None:
    names = ["BSD", "Artistic"]  # two short texts: the disk fills before any result, whatever their size
    manifest = license_manifest(tmp_path, names)
    with mounted_tmpfs(tmp_path / "small", "size=16m") as disk:
        job = disk / "job"
        proc = start_submit(manifest, job, ray_address, "--set", "workers.count=1", env={"PYTHONUNBUFFERED": "1"})
        try:  # full once the job folder is made, before the first result is published
            assert wait_for(lambda: (job / "job.json").is_file(), proc, timeout=120), proc.communicate()
            fill_disk(disk)
            assert not any((job / "results").glob("*.parquet")), "a result was published before the disk filled"
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == EXIT_NO_SPACE, (proc.returncode, out, err[-3000:])
        assert "Traceback" not in out + err, (out, err)
        assert f"free space then `kvbatch resume {job}`" in out + err, (out, err)
        (disk / "filler").unlink()
        kvbatch("resume", str(job), "--address", ray_address, check=0)
        assert sorted(done_summaries(job)) == sorted(n.lower() for n in names)


def test_a_full_disk_under_the_offload_root_as_the_workers_start_stops_resumably(tmp_path: Path,
                                                                                ray_address: str) -> None:
    """A worker's start writes its offload root's marker: on a full disk that is no setting to fix (it
    exited 2, "fix that setting"), but the stop a full job folder gives: exit 6, free space and resume."""
    job = tmp_path / "job"
    with mounted_tmpfs(tmp_path / "scratch", "size=1m") as disk:
        fill_disk(disk)
        offload_root = disk / "offload"
        ran = kvbatch("submit", str(license_manifest(tmp_path, ["BSD"])), "-c", str(TINY_CONFIG), "-j", str(job),
                      "--address", ray_address, "--set", f"cache.offload_root={offload_root}")
        said = ran.stdout + ran.stderr
        assert ran.returncode == EXIT_NO_SPACE, (ran.returncode, said)
        assert "Traceback" not in said and str(offload_root) in said, said
        assert f"free space then `kvbatch resume {job}`" in said, said
        (disk / "filler").unlink()
        kvbatch("resume", str(job), "--address", ray_address, check=0)
    assert list(done_summaries(job)) == ["bsd"]
