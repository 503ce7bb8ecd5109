"""Reading one document (jobs/documents.py): files the kernel makes up when read are never documents."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from jobs.documents import DocumentError, read_document, read_uri_document

LIMIT = 1 << 20


@pytest.mark.parametrize("path", ["/proc/self/environ", "/proc/self/cmdline", "/sys/devices/system/cpu/online"])
def test_proc_and_sys_files_are_refused_though_they_look_regular(path: str) -> None:
    """/proc/self/environ reports a regular file of 0 bytes, and reading it gives this process's environment
    (credentials included): the size and the file type alone would let it through."""
    if not Path(path).exists():
        pytest.skip(f"{path} does not exist on this machine")
    with pytest.raises(DocumentError, match=r"is on a pseudo file system \((proc|sysfs)\)"):
        read_document(Path(path), LIMIT, None)


def test_a_symlink_into_proc_is_refused_naming_where_it_leads(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").symlink_to("/proc/self/environ")
    with pytest.raises(DocumentError, match=r"/proc/\d+/environ is on a pseudo file system \(proc\)"):
        read_document(tmp_path / "notes.txt", LIMIT, None)


def test_a_proc_mounted_elsewhere_is_refused_by_its_file_system(tmp_path: Path) -> None:
    """No path prefix gives it away: the file system of the file's device does."""
    mount_point = tmp_path / "elsewhere"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "proc", "proc", str(mount_point)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a proc file system here (needs root): {made.stderr.strip()}")
    try:
        with pytest.raises(DocumentError, match=r"is on a pseudo file system \(proc\)"):
            read_document(mount_point / "self" / "environ", LIMIT, None)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_a_file_uri_into_proc_is_refused() -> None:
    with pytest.raises(DocumentError, match=r"is on a pseudo file system \(proc\)"):
        read_uri_document("file:///proc/self/environ", LIMIT)


def test_an_ordinary_file_still_reads(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("An ordinary document.\n")
    assert read_document(tmp_path / "a.txt", LIMIT, None).text == "An ordinary document.\n"
