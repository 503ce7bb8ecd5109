"""Every `-o` (`kvbatch report`, `kvbatch results`) writes where the name points: through a symlink (the link
stays), into a FIFO or a character device as it is (it was replaced by a plain file: as root, `-o /dev/null`
would have replaced the device node), into standard output as it is (`-`, `/dev/stdout`: a pipe, or the
file the shell opened, appended to), and a write that fails (a full disk) leaves no truncated file; the
temporary file beside the target has a random name, created exclusively, never through a planted symlink."""

from __future__ import annotations

import json
import os
import pty
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import REPO, TINY_CONFIG, kvbatch, write_jsonl
from tests.helpers.system import fill_disk, mounted_tmpfs

#: (command, output name): each -o the CLI has
OUTPUTS = [("report", "out.html"), ("results", "out.jsonl"), ("results", "out.csv"), ("results", "out.parquet")]
IDS = [f"{command}-{name}" for command, name in OUTPUTS]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A job whose every row is rejected (no Ray needed): a report and results to write."""
    tmp = tmp_path_factory.mktemp("outputs")
    manifest = write_jsonl(tmp / "m.jsonl", [{"id": "ghost", "path": "missing.txt", "team": "legal"},
                                             {"id": "empty", "text": ""}])
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(tmp / "job"), check=3)
    return tmp / "job"


def _write(job: Path, command: str, out: Path, check: int | None = 0):  # noqa: ANN202 - CompletedProcess
    return kvbatch(command, str(job), "-o", str(out), check=check)


def _device(path: Path, minor: int) -> Path:
    """A character device node of the memory driver (major 1: minor 3 is null, 7 is full) at `path`."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("cannot make a device node here (needs root or CAP_MKNOD)")
    return path


@pytest.mark.parametrize(("command", "name"), OUTPUTS, ids=IDS)
def test_an_output_through_a_symlink_writes_its_target_and_keeps_the_link(
        job: Path, tmp_path: Path, command: str, name: str) -> None:
    target = tmp_path / "elsewhere" / name
    target.parent.mkdir()
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / f"link-{name}"
    link.symlink_to(target)
    _write(job, command, link)
    assert link.is_symlink() and link.readlink() == target
    assert target.read_bytes() != b"old" and target.stat().st_size > 0
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the file written keeps its permissions
    assert sorted(p.name for p in target.parent.iterdir()) == [name]  # no temporary file left beside it


@pytest.mark.parametrize(("command", "name"), OUTPUTS, ids=IDS)
def test_an_output_into_a_fifo_streams_into_it(job: Path, tmp_path: Path, command: str, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    _write(job, command, fifo)
    reader.join(timeout=60)
    assert stat.S_ISFIFO(fifo.stat().st_mode), "the FIFO was replaced by a plain file"
    assert received and received[0], "nothing came through the FIFO"
    if name.endswith(".jsonl"):
        assert sorted(json.loads(line)["doc_id"] for line in received[0].decode().splitlines()) == ["empty", "ghost"]


@pytest.mark.parametrize(("command", "name"), OUTPUTS, ids=IDS)
def test_an_output_into_a_null_device_keeps_the_device(job: Path, tmp_path: Path, command: str, name: str) -> None:
    null = _device(tmp_path / f"null-{name}", 3)
    _write(job, command, null)
    assert stat.S_ISCHR(null.stat().st_mode), "the device node was replaced by a plain file"


@pytest.mark.parametrize(("command", "name"), OUTPUTS, ids=IDS)
def test_an_output_into_a_full_device_is_one_line_and_keeps_the_device(
        job: Path, tmp_path: Path, command: str, name: str) -> None:
    full = _device(tmp_path / f"full-{name}", 7)
    proc = _write(job, command, full, check=2)
    assert f"cannot write {full} (No space left on device)" in " ".join(proc.stderr.split()), proc.stderr
    assert "Traceback" not in proc.stderr
    assert stat.S_ISCHR(full.stat().st_mode)




@pytest.mark.parametrize(("command", "name"), OUTPUTS, ids=IDS)
def test_an_output_on_a_full_disk_leaves_no_truncated_file(job: Path, tmp_path: Path, command: str, name: str) -> None:
    with mounted_tmpfs(tmp_path / "small", "size=1m") as disk:
        kept = disk / f"kept-{name}"
        kept.write_text("the previous export")
        fill_disk(disk)
        for out in (disk / name, kept):
            proc = _write(job, command, out, check=2)
            assert f"cannot write {out} (No space left on device)" in " ".join(proc.stderr.split()), proc.stderr
            assert "Traceback" not in proc.stderr
        assert kept.read_text() == "the previous export"  # the old file is left whole
        assert sorted(p.name for p in disk.iterdir()) == sorted(["filler", kept.name])  # no partial file


# ---------------------------------------------------------------- the temporary file beside the target

#: the CLI in a child that first plants, in the folder it writes to, a symlink named as kvbatch named its
#: temporary file before (".NAME.<pid>.tmp", with this very pid) and pointing at a victim file
PLANTED_LINK_CLI = """
import os, sys
folder, victim, name = sys.argv[1:4]
os.chdir(folder)
os.symlink(victim, f".{name}.{os.getpid()}.tmp")
sys.argv = ["kvbatch", *sys.argv[4:]]
from runner.cli import main
main()
"""


@pytest.mark.parametrize("name", ["r2.jsonl", "r2.csv", "r2.parquet"])
def test_a_symlink_planted_at_a_temporary_name_in_a_shared_folder_is_never_written_through(
        job: Path, tmp_path: Path, name: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # sticky and writable by all, as /tmp
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own text")
    proc = subprocess.run([sys.executable, "-c", PLANTED_LINK_CLI, str(shared), str(victim), name,
                           "results", str(job), "-o", name],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "the victim's own text"
    planted = [p for p in shared.iterdir() if p.is_symlink()]
    assert len(planted) == 1 and planted[0].readlink() == victim  # the link is left as it was
    written = shared / name
    assert written.is_file() and not written.is_symlink() and written.stat().st_size > 0
    assert sorted(p.name for p in shared.iterdir()) == sorted([name, planted[0].name])  # no temporary file left


def test_temporary_names_are_drawn_at_random_and_a_taken_one_is_never_opened(tmp_path: Path, monkeypatch) -> None:
    """Every name a planter could guess is taken by a symlink: the write draws until a free one comes."""
    from storage import output

    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    draws = iter(["aa", "aa", "bb", "cc"])
    monkeypatch.setattr(output.secrets, "token_hex", lambda n: next(draws))
    for taken in ("aa", "bb"):
        (tmp_path / f".out.jsonl.{taken}.tmp").symlink_to(victim)
    output.write_output(tmp_path / "out.jsonl", lambda handle: handle.write(b"rows\n"))
    assert (tmp_path / "out.jsonl").read_text() == "rows\n" and victim.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.jsonl.aa.tmp", ".out.jsonl.bb.tmp", "out.jsonl",
                                                         "victim.txt"]


# ---------------------------------------------------------------- stdout as it is

#: every name of standard output -o takes
STDOUT_NAMES = ["-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"]


def _results_into(job: Path, stdout, *args: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    return subprocess.run([sys.executable, "-m", "runner", "results", str(job), *args], stdout=stdout,
                          stderr=subprocess.PIPE, cwd=REPO, timeout=300)


@pytest.mark.parametrize("name", STDOUT_NAMES)
def test_stdout_names_write_into_a_pipe(job: Path, name: str) -> None:
    proc = _results_into(job, subprocess.PIPE, "-o", name)
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(line)["doc_id"] for line in proc.stdout.decode().splitlines()) == ["empty", "ghost"]


@pytest.mark.parametrize("name", STDOUT_NAMES)
@pytest.mark.parametrize("mode", ["a", "w"], ids=["appended", "after-a-header"])
def test_stdout_names_write_into_the_file_the_shell_opened_after_what_it_holds(
        job: Path, tmp_path: Path, name: str, mode: str) -> None:
    """`... -o /dev/stdout >> log` appends; `{ echo HEADER; kvbatch results JOB -o /dev/stdout; } > f` keeps the
    header: the file is written where its descriptor stands, never replaced (same inode)."""
    log = tmp_path / "log"
    with log.open(mode + "b") as handle:
        handle.write(b"HEADER\n")
        handle.flush()
        inode = os.fstat(handle.fileno()).st_ino
        proc = _results_into(job, handle, "-o", name)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "HEADER" and sorted(json.loads(line)["doc_id"] for line in lines[1:]) == ["empty", "ghost"]
    assert log.stat().st_ino == inode


@pytest.mark.parametrize("name", ["-", "/dev/stdout"])
def test_parquet_streams_into_a_pipe(job: Path, name: str) -> None:
    proc = _results_into(job, subprocess.PIPE, "-o", name, "--format", "parquet")
    assert proc.returncode == 0, proc.stderr
    table = pq.read_table(pa.BufferReader(proc.stdout))
    assert sorted(table.column("doc_id").to_pylist()) == ["empty", "ghost"]


def test_parquet_is_not_written_onto_a_terminal(job: Path) -> None:
    main, terminal = pty.openpty()
    try:
        proc = _results_into(job, terminal, "-o", "-", "--format", "parquet")
    finally:
        os.close(terminal)
        os.close(main)
    assert proc.returncode == 2
    assert "is a terminal and parquet is binary" in " ".join(proc.stderr.decode().split())
