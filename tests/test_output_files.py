"""Every `-o` (`kvbatch report`, `kvbatch results`) writes where the name points: through a symlink (the link
stays), into a FIFO or a character device as it is (it was replaced by a plain file: as root, `-o /dev/null`
would have replaced the device node), and a write that fails (a full disk) leaves no truncated file."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from tests.helpers.cli import TINY_CONFIG, kvbatch, write_jsonl
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
