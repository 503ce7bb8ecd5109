"""A folder built once and published whole (storage/folder_once.py): what converts the builtin models.

Several processes building the same folder at once are in tests/test_models.py
(`test_concurrent_first_loads_convert_once`), through the real model loader.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.folder_once import build_folder_once


def test_failed_conversion_leaves_nothing_and_stale_temps_are_swept(tmp_path: Path) -> None:
    dest = tmp_path / "converted"
    said: list[str] = []

    def broken(out: Path) -> None:
        (out / "half-written").write_bytes(b"x" * 100)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_folder_once(dest, broken, "building (test)", said.append)
    assert not dest.exists()
    assert not list(tmp_path.glob(".converted.tmp-*"))

    stale = tmp_path / ".converted.tmp-killed"  # what a kill -9 mid-build leaves behind
    stale.mkdir()
    calls = []

    def good(out: Path) -> None:
        calls.append(out)
        (out / "weights").write_text("ok")

    assert build_folder_once(dest, good, "building (test)", said.append) == dest
    assert build_folder_once(dest, good, "building (test)", said.append) == dest
    assert len(calls) == 1
    assert (dest / "weights").read_text() == "ok"
    assert not stale.exists()
    assert said[0] == "building (test)" and said[-1].startswith("done in ") and said.count("building (test)") == 2
