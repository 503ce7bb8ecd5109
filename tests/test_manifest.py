"""Manifest parsing and validation on real files: every format, every rejection reason."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.config import ConfigError, InputConfig
from jobs.documents import DocumentError, load_task_text, read_document, text_sha256
from jobs.manifest import ManifestError, Rejection, Task, read_manifest, tasks_from_table, tasks_to_table
from jobs.schema import MANIFEST_SCHEMA

REPO = Path(__file__).resolve().parents[1]
LICENSES = Path("/usr/share/common-licenses")
BSD = (LICENSES / "BSD").read_text()
MIT_LIKE = "Permission is hereby granted, free of charge, to any person.\n\nThe above notice shall be included."


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    """Rows as JSON objects; a str is written as a raw line (to make broken ones)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def only_rejection(rejections: list[Rejection]) -> Rejection:
    assert len(rejections) == 1, rejections
    return rejections[0]


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    d.mkdir()
    (d / "bsd.txt").write_text(BSD, encoding="utf-8")
    with gzip.open(d / "mit.txt.gz", "wt", encoding="utf-8") as f:
        f.write(MIT_LIKE)
    return d


CFG = InputConfig()


# ------------------------------------------------------------------ the three formats


def test_jsonl_text_and_path_rows_become_tasks_with_metadata_and_overrides(tmp_path: Path, docs: Path) -> None:
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "a", "text": "Hello world. Second sentence.", "lang": "en", "tags": ["x", 1]},
            {"id": 7, "path": "docs/bsd.txt", "max_new_tokens": 32, "prompt": "Summarise briefly."},
            {"id": "c", "path": "docs/mit.txt.gz", "author": None},
        ],
    )
    tasks, rejections = read_manifest(manifest, CFG)
    assert rejections == []
    a, b, c = tasks
    assert (a.task_id, a.doc_id, a.source_type, a.source) == ("t000001", "a", "text", "Hello world. Second sentence.")
    assert a.meta == {"lang": "en", "tags": ["x", 1]} and a.overrides == {}
    assert b.doc_id == "7" and b.source_type == "path" and b.source == str(docs / "bsd.txt")
    assert b.overrides == {"max_new_tokens": 32, "prompt": "Summarise briefly."} and b.meta == {}
    assert (b.n_chars, b.n_bytes, b.sha256) == (len(BSD), len(BSD.encode()), text_sha256(BSD))
    assert c.source == str(docs / "mit.txt.gz") and c.n_chars == len(MIT_LIKE) and c.meta == {"author": None}
    assert load_task_text(c) == MIT_LIKE


def test_csv_manifest_with_bom_quoted_multiline_text_and_string_overrides(tmp_path: Path, docs: Path) -> None:
    manifest = write_csv(
        tmp_path / "m.csv",
        ["id", "text", "path", "max_new_tokens", "prompt", "source"],
        [
            ["a", "Line one.\n\nLine, two.", "", "64", "", "web"],
            ["b", "", "docs/bsd.txt", "", "Short please.", ""],
        ],
    )
    manifest.write_bytes(b"\xef\xbb\xbf" + manifest.read_bytes())  # as Excel saves it
    tasks, rejections = read_manifest(manifest, CFG)
    assert rejections == []
    a, b = tasks
    assert a.source == "Line one.\n\nLine, two." and a.overrides == {"max_new_tokens": 64}
    assert a.meta == {"source": "web"} and b.meta == {"source": ""}
    assert b.source_type == "path" and b.overrides == {"prompt": "Short please."}


def test_parquet_manifest_with_nulls_typed_metadata_and_pandas_nan(tmp_path: Path, docs: Path) -> None:
    table = pa.table(
        {
            "id": ["a", "b", "c"],
            "text": ["Alpha text.", None, "Gamma text."],
            "path": [None, "docs/bsd.txt", None],
            "max_new_tokens": [16.0, float("nan"), None],
            "year": [2001, 2002, None],
            "score": [0.5, 1.5, 2.5],
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    tasks, rejections = read_manifest(tmp_path / "m.parquet", CFG)
    assert rejections == []
    assert [t.doc_id for t in tasks] == ["a", "b", "c"]
    assert tasks[0].overrides == {"max_new_tokens": 16} and tasks[1].overrides == {} and tasks[2].overrides == {}
    assert tasks[1].source_type == "path" and tasks[2].meta == {"year": None, "score": 2.5}


def test_json_array_and_gzipped_manifests(tmp_path: Path, docs: Path) -> None:
    rows = [{"id": "a", "text": "First."}, {"id": "b", "path": "docs/bsd.txt"}, [1, 2]]
    (tmp_path / "arr.json").write_text(json.dumps(rows, indent=2))
    tasks, rejections = read_manifest(tmp_path / "arr.json", CFG)
    assert [t.doc_id for t in tasks] == ["a", "b"]
    assert only_rejection(rejections).reason.startswith("arr.json item 3: is not a JSON object")

    with gzip.open(tmp_path / "m.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "z", "path": "docs/mit.txt.gz"}) + "\n")
    tasks, _ = read_manifest(tmp_path / "m.jsonl.gz", CFG)
    assert tasks[0].n_chars == len(MIT_LIKE)

    with gzip.open(tmp_path / "m.csv.gz", "wt", newline="") as f:
        csv.writer(f).writerows([["id", "text"], ["q", "Gzipped CSV."]])
    tasks, _ = read_manifest(tmp_path / "m.csv.gz", CFG)
    assert tasks[0].source == "Gzipped CSV."


def test_relative_paths_resolve_against_the_manifest_folder_not_the_cwd(
    tmp_path: Path, docs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "path": "docs/bsd.txt"}])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "docs").mkdir()
    (elsewhere / "docs" / "bsd.txt").write_text("a different file")
    monkeypatch.chdir(elsewhere)
    tasks, _ = read_manifest(Path("..") / "m.jsonl", CFG)
    assert tasks[0].source == str(docs / "bsd.txt") and tasks[0].n_chars == len(BSD)


# ------------------------------------------------------------------ rejections


def test_bad_jsonl_lines_are_rejected_and_the_rest_go_on(tmp_path: Path) -> None:
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "ok1", "text": "Fine."},
            '{"id": "broken", "text": ',
            "[1, 2, 3]",
            '{"id": "twice", "text": "a", "text": "b"}',
            "",
            "[" * 100_000,
            {"text": "no id"},
            {"id": "  ", "text": "blank id"},
            {"id": 1.5, "text": "float id"},
            {"id": "a\nb", "text": "control character in id"},
            {"id": "ok2", "text": "Also fine."},
        ],
    )
    with manifest.open("ab") as f:
        f.write(b'{"id": "latin1", "text": "caf\xe9"}\n')
    tasks, rejections = read_manifest(manifest, CFG)
    assert [t.doc_id for t in tasks] == ["ok1", "ok2"]
    assert [t.task_id for t in tasks] == ["t000001", "t000011"]
    by_row = {r.row: r.reason for r in rejections}
    assert set(by_row) == {2, 3, 4, 6, 7, 8, 9, 10, 12}  # line 5 is blank: skipped, not rejected
    assert by_row[2].startswith("m.jsonl line 2: is not valid JSON")
    assert "expected a JSON object" in by_row[3]
    assert "key 'text' appears twice" in by_row[4]
    assert "nested too deeply" in by_row[6]
    assert "has no 'id'" in by_row[7] and "has no 'id'" in by_row[8]
    assert "must be a string or an integer" in by_row[9]
    assert "control characters" in by_row[10]
    assert "not valid UTF-8" in by_row[12]
    assert all(r.doc_id is None for r in rejections)


@pytest.mark.parametrize("control", ["\u202e", "\u202a", "\u2066", "\u2069", "\u200f", "\u061c"])
def test_an_id_with_a_bidi_control_is_rejected_like_a_c0_control(tmp_path: Path, control: str) -> None:
    """U+202E (right-to-left override) in an id made `status` show it reversed; ids are refused with it."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"invoice-{control}fdp.exe", "text": "A memo."},
                                                  {"id": "ok", "text": "Another memo."},
                                                  {"id": "family-\U0001f468\u200d\U0001f469", "text": "A joiner is fine."}])
    tasks, rejections = read_manifest(manifest, CFG)
    assert [t.doc_id for t in tasks] == ["ok", "family-\U0001f468\u200d\U0001f469"]
    [rejection] = rejections
    assert f"bidirectional text controls (U+{ord(control):04X})" in rejection.reason, rejection.reason
    assert rejection.doc_id is None  # nor is the row named by it


def test_duplicate_ids_keep_the_first_including_unicode_normalised_forms(tmp_path: Path) -> None:
    composed, decomposed = "caf\u00e9", unicodedata.normalize("NFD", "caf\u00e9")
    assert composed != decomposed
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "a", "text": "first"},
            {"id": "a", "text": "second"},
            {"id": composed, "text": "x"},
            {"id": decomposed, "text": "y"},
            {"id": "bad", "text": ""},
            {"id": "bad", "text": "the first 'bad' row was rejected but still owns the id"},
        ],
    )
    tasks, rejections = read_manifest(manifest, CFG)
    assert [(t.doc_id, t.source) for t in tasks] == [("a", "first"), (composed, "x")]
    dup_a, dup_cafe, empty, dup_bad = rejections
    assert (dup_a.row, dup_a.doc_id) == (2, "a")
    assert dup_a.reason == "m.jsonl line 2 (id 'a'): duplicate id: line 1 already has the same id; ids must be unique, rename one"
    assert dup_cafe.doc_id == decomposed and "equal after Unicode normalisation" in dup_cafe.reason
    assert "line 3" in dup_cafe.reason
    assert "is empty" in empty.reason and dup_bad.row == 6 and "line 5 already has" in dup_bad.reason


def test_text_and_path_must_come_exactly_once_and_text_must_have_content(tmp_path: Path, docs: Path) -> None:
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "both", "text": "x", "path": "docs/bsd.txt"},
            {"id": "neither", "title": "nothing"},
            {"id": "empty", "text": ""},
            {"id": "blank", "text": " \n\t "},
            {"id": "nul", "text": "abc\u0000def"},
            {"id": "number", "text": 42},
            {"id": "emptypath", "path": ""},
        ],
    )
    _, rejections = read_manifest(manifest, CFG)
    reasons = {r.doc_id: r.reason for r in rejections}
    assert "has both 'text' and 'path'" in reasons["both"]
    assert "has neither 'text' nor 'path'" in reasons["neither"]
    assert "'text' is empty" in reasons["empty"] and "'text' is empty" in reasons["blank"]
    assert "'text' is binary: 1 of its 7 bytes" in reasons["nul"]  # 1 NUL in 7 characters is no stray one
    assert "'text' must be a string" in reasons["number"]
    assert {r.doc_id: r.meta for r in rejections}["neither"] == {"title": "nothing"}  # passed through to errors
    assert "'path' must be a non-empty string" in reasons["emptypath"]
    assert reasons["both"].startswith("m.jsonl line 1 (id 'both'): ")


def test_unusable_document_files_are_rejected_with_the_path_and_a_fix(tmp_path: Path, docs: Path) -> None:
    (docs / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (docs / "utf16-no-bom.txt").write_bytes("Hello there".encode("utf-16-le"))
    (docs / "blank.txt").write_text("\n\n   \n")
    (docs / "zero.txt").write_bytes(b"")
    (docs / "broken.gz").write_bytes(b"this is not gzip at all")
    os.mkfifo(docs / "pipe")
    (docs / "subdir").mkdir()
    (docs / "dangling").symlink_to(docs / "nowhere.txt")
    rows = [
        {"id": "missing", "path": "docs/nope.txt"},
        {"id": "binary", "path": "docs/binary.bin"},
        {"id": "utf16-no-bom", "path": "docs/utf16-no-bom.txt"},
        {"id": "blank", "path": "docs/blank.txt"},
        {"id": "zero", "path": "docs/zero.txt"},
        {"id": "broken", "path": "docs/broken.gz"},
        {"id": "fifo", "path": "docs/pipe"},
        {"id": "dir", "path": "docs/subdir"},
        {"id": "device", "path": "/dev/zero"},
        {"id": "dangling", "path": "docs/dangling"},
        {"id": "mem", "path": "/proc/self/mem"},  # "regular", but the kernel's: never read
        {"id": "good", "path": "docs/bsd.txt"},
    ]
    started = time.monotonic()
    tasks, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", rows), CFG)
    assert time.monotonic() - started < 10  # the FIFO and /dev/zero were never read
    assert [t.doc_id for t in tasks] == ["good"]
    reasons = {r.doc_id: r.reason for r in rejections}
    assert f"file {docs / 'nope.txt'} does not exist" in reasons["missing"]
    assert "is binary: 100 of its 1024 bytes (9.8 %) are control bytes" in reasons["binary"]
    assert "is binary" in reasons["utf16-no-bom"] and "UTF-16 without a byte-order mark" in reasons["utf16-no-bom"]
    assert "is empty" in reasons["blank"] and "is empty" in reasons["zero"]
    assert "is not a valid gzip file" in reasons["broken"]
    assert "is a FIFO" in reasons["fifo"]
    assert "is a directory" in reasons["dir"]
    assert "is a device" in reasons["device"]
    assert "nowhere.txt does not exist" in reasons["dangling"]
    assert "is on a pseudo file system (proc)" in reasons["mem"]
    assert reasons["missing"].startswith("m.jsonl line 1 (id 'missing'): 'path' 'docs/nope.txt': ")


def test_a_file_without_read_permission_is_rejected(tmp_path: Path) -> None:
    """Run as an unprivileged user when the tests run as root, since root reads any file."""
    shared = Path(tempfile.mkdtemp(prefix="kvbatch-perm-"))
    try:
        shared.chmod(0o755)
        secret = shared / "secret.txt"
        secret.write_text("top secret")
        secret.chmod(0o000)
        code = (
            "import os, sys; from pathlib import Path; from jobs.documents import read_document, DocumentError\n"
            "if os.geteuid() == 0: os.setuid(65534)  # nobody, after the imports it needs\n"
            "try: read_document(Path(sys.argv[1]), 1000, None)\n"
            "except DocumentError as e: print(e)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(secret)], cwd=REPO, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == f"file {secret} cannot be opened (Permission denied): check that it exists and is readable"
    finally:
        secret.unlink()
        shared.rmdir()


def test_documents_outside_documents_root_are_rejected_however_they_escape(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "inside.txt").write_text("Inside the root.")
    outside = tmp_path / "outside.txt"
    outside.write_text("Outside the root.")
    (root / "link.txt").symlink_to(outside)
    (root / "linkdir").symlink_to(tmp_path)
    (root / "inner-link.txt").symlink_to(root / "sub" / "inside.txt")
    manifest = write_jsonl(
        root / "m.jsonl",
        [
            {"id": "abs", "path": str(outside)},
            {"id": "dotdot", "path": "sub/../../outside.txt"},
            {"id": "symlink", "path": "link.txt"},
            {"id": "symlinkdir", "path": "linkdir/outside.txt"},
            {"id": "missing-outside", "path": "../nope.txt"},
            {"id": "inside", "path": "sub/../sub/inside.txt"},
            {"id": "inner-link", "path": "inner-link.txt"},
            {"id": "inline", "text": "Inline text is not a path."},
        ],
    )
    tasks, rejections = read_manifest(manifest, InputConfig(documents_root=str(root)))
    assert [t.doc_id for t in tasks] == ["inside", "inner-link", "inline"]
    assert tasks[1].source == str(root / "sub" / "inside.txt")
    reasons = {r.doc_id: r.reason for r in rejections}
    assert set(reasons) == {"abs", "dotdot", "symlink", "symlinkdir", "missing-outside"}
    for reason in reasons.values():
        assert f"is outside input.documents_root {root}" in reason
    assert f"(resolves to {outside})" in reasons["symlink"]
    # without a root the same manifest reads the outside files
    tasks, _ = read_manifest(manifest, InputConfig())
    assert {"abs", "dotdot", "symlink"} <= {t.doc_id for t in tasks}


def test_documents_root_that_is_not_a_directory_is_a_config_error(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "x"}])
    with pytest.raises(ConfigError, match="input.documents_root .*nope is not a directory"):
        read_manifest(manifest, InputConfig(documents_root=str(tmp_path / "nope")))


def test_size_limit_refuses_huge_files_before_reading_them(tmp_path: Path) -> None:
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.truncate(2 * 1024**3)  # 2 GiB, sparse: if it were read, the NUL check would fire instead
    with gzip.open(tmp_path / "bomb.txt.gz", "wb") as f:
        f.write(b"a" * 5_000_000)
    (tmp_path / "small.txt").write_text("x" * 900)
    rows = [
        {"id": "huge", "path": "huge.txt"},
        {"id": "bomb", "path": "bomb.txt.gz"},
        {"id": "inline", "text": "y" * 1001},
        {"id": "small", "path": "small.txt"},
        {"id": "limit", "text": "z" * 1000},
    ]
    started = time.monotonic()
    tasks, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", rows), InputConfig(max_document_bytes=1000))
    assert time.monotonic() - started < 5
    assert [t.doc_id for t in tasks] == ["small", "limit"]
    reasons = {r.doc_id: r.reason for r in rejections}
    assert f"is {2 * 1024**3} bytes, over input.max_document_bytes (1000)" in reasons["huge"]
    assert "decompresses to more than input.max_document_bytes (1000 bytes)" in reasons["bomb"]
    assert "'text' is 1001 bytes, over input.max_document_bytes (1000)" in reasons["inline"]


def test_overrides_are_validated_and_other_fields_are_metadata(tmp_path: Path) -> None:
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "zero", "text": "x", "max_new_tokens": 0},
            {"id": "negative", "text": "x", "max_new_tokens": -5},
            {"id": "fraction", "text": "x", "max_new_tokens": 1.5},
            {"id": "word", "text": "x", "max_new_tokens": "many"},
            {"id": "bool", "text": "x", "max_new_tokens": True},
            {"id": "blankprompt", "text": "x", "prompt": "   "},
            {"id": "listprompt", "text": "x", "prompt": ["a"]},
            {"id": "ok", "text": "x", "max_new_tokens": "12", "prompt": "P", "temperature": 0.7, "nested": {"k": [1]}},
        ],
    )
    tasks, rejections = read_manifest(manifest, CFG)
    assert [(t.doc_id, t.overrides, t.meta) for t in tasks] == [
        ("ok", {"max_new_tokens": 12, "prompt": "P"}, {"temperature": 0.7, "nested": {"k": [1]}})
    ]
    reasons = {r.doc_id: r.reason for r in rejections}
    for doc in ("zero", "negative", "fraction", "word", "bool"):
        assert "'max_new_tokens' must be a positive integer" in reasons[doc]
    assert "'prompt' must be a non-empty string" in reasons["blankprompt"]
    assert "'prompt' must be a non-empty string" in reasons["listprompt"]


def test_bad_csv_rows_are_rejected_with_their_row_number(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(
        b'id,text,lang\n'
        b'a,Good row,en\n'
        b'b,Too,many,fields\n'
        b'c,too few\n'
        b'd,"bad"quote,en\n'
        b'e,caf\xe9,fr\n'
        b'\n'
        b',No id here,en\n'
        b'f,"Multi\nline",en\n'
        b'g,"unterminated,en\n'
    )
    tasks, rejections = read_manifest(manifest, CFG)
    assert [(t.doc_id, t.source) for t in tasks] == [("a", "Good row"), ("f", "Multi\nline")]
    by_row = {r.row: r.reason for r in rejections}
    assert "has 4 fields but the header has 3" in by_row[3]
    assert "has 2 fields but the header has 3" in by_row[4]
    assert "is not valid CSV" in by_row[5] and "quoting" in by_row[5]
    assert "not valid UTF-8" in by_row[6]
    assert "has no 'id'" in by_row[7]
    assert "is not valid CSV (unexpected end of data" in by_row[9]
    assert by_row[3].startswith("m.csv row 3: ")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("m.txt", b'{"id": "a", "text": "x"}\n', "unknown extension"),
        ("m.parquet.gz", b"x", "unknown extension"),
        ("m.csv", b"", "is empty"),
        ("m.csv", b"name,text\nx,y\n", "has no 'id' column"),
        ("m.csv", b"id,title\nx,y\n", "neither a 'text' nor a 'path' column"),
        ("m.csv", b"id,text,id\n1,2,3\n", "column 'id' appears twice"),
        ("m.csv", b",id,text\n0,a,b\n", "column 1 of the header has no name"),
        ("m.jsonl", b"\n\n   \n", "has no documents"),
        ("m.json", b"[1, 2", "is not a valid JSON array"),
        ("m.parquet", b"PAR1 not really parquet", "is not a readable Parquet file"),
        # mtime=0: the same bytes (and test id) in every xdist worker that collects it
        ("m.jsonl.gz", gzip.compress(b'{"id": "a", "text": "x"}\n' * 50, mtime=0)[:40], "cannot be read"),
    ],
)
def test_unusable_manifest_files_raise_manifest_error(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ManifestError, match=message) as err:
        read_manifest(tmp_path / name, CFG)
    assert str(tmp_path / name) in str(err.value)


def test_missing_manifest_and_truncated_parquet_raise_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(tmp_path / "nope.jsonl", CFG)
    pq.write_table(pa.table({"id": ["a"] * 100, "text": ["Some text."] * 100}), tmp_path / "full.parquet")
    data = (tmp_path / "full.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError, match="is not a readable Parquet file"):
        read_manifest(tmp_path / "cut.parquet", CFG)


def test_overlong_jsonl_line_is_rejected_without_stopping_the_batch(tmp_path: Path) -> None:
    max_bytes = 1000
    line_limit = 6 * max_bytes + (1 << 20)
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [{"id": "big", "text": "w" * (line_limit + 10)}, {"id": "after", "text": "Still read."}],
    )
    tasks, rejections = read_manifest(manifest, InputConfig(max_document_bytes=max_bytes))
    assert [t.doc_id for t in tasks] == ["after"] and tasks[0].task_id == "t000002"
    assert f"is longer than {line_limit} bytes" in only_rejection(rejections).reason


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    content=st.one_of(
        st.binary(max_size=400),
        st.lists(st.sampled_from(['{"id": "a", "text": "x"}', '{"id":', "\x00", '"', ",", "\n", "id,text", "\xe9", "[", "{}"]), max_size=30).map(
            lambda parts: "".join(parts).encode("utf-8", errors="surrogatepass")
        ),
    ),
    suffix=st.sampled_from([".jsonl", ".csv", ".json", ".parquet"]),
)
def test_hostile_manifest_bytes_never_escape_as_anything_but_manifest_error(
    tmp_path: Path, content: bytes, suffix: str
) -> None:
    manifest = tmp_path / f"hostile{suffix}"
    manifest.write_bytes(content)
    try:
        tasks, rejections = read_manifest(manifest, CFG)
    except ManifestError as e:
        assert str(manifest) in str(e)
        return
    for rejection in rejections:
        assert rejection.reason.startswith(f"hostile{suffix} ") and rejection.row >= 1
    assert len({t.task_id for t in tasks} | {r.task_id for r in rejections}) == len(tasks) + len(rejections)


# ------------------------------------------------------------------ job folder table and re-reading


def test_tasks_round_trip_through_a_parquet_file(tmp_path: Path, docs: Path) -> None:
    manifest = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "a", "text": "Ünïcödé text ✓.", "max_new_tokens": 5, "meta": {"deep": [1, None]}},
            {"id": "b", "path": "docs/mit.txt.gz", "prompt": "P", "n": 3},
        ],
    )
    tasks, _ = read_manifest(manifest, CFG)
    table = tasks_to_table(tasks)
    assert table.schema.equals(MANIFEST_SCHEMA)
    pq.write_table(table, tmp_path / "manifest.parquet")
    assert tasks_from_table(pq.read_table(tmp_path / "manifest.parquet")) == tasks
    assert json.loads(table.column("meta")[0].as_py()) == {"meta": {"deep": [1, None]}}
    with pytest.raises(ManifestError, match="lacks column\\(s\\) sha256"):
        tasks_from_table(table.drop_columns(["sha256"]))


def test_parquet_metadata_of_any_type_survives_the_round_trip(tmp_path: Path) -> None:
    import datetime as dt
    import decimal

    table = pa.table(
        {
            "id": ["a"],
            "text": ["x"],
            "when": pa.array([dt.datetime(2024, 5, 1, 12, 30)], pa.timestamp("s")),
            "price": pa.array([decimal.Decimal("1.25")], pa.decimal128(5, 2)),
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    tasks, _ = read_manifest(tmp_path / "m.parquet", CFG)
    stored = tasks_from_table(tasks_to_table(tasks))
    assert stored[0].meta == {"when": "2024-05-01T12:30:00", "price": "1.25"}


def test_rejected_parquet_rows_keep_metadata_of_every_type_the_task_table_takes(tmp_path: Path) -> None:
    import datetime as dt
    import decimal

    from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch

    metadata = {
        "day": pa.array([dt.date(2024, 5, 1)] * 2, pa.date32()),
        "when": pa.array([dt.datetime(2024, 5, 1, 12, 30)] * 2, pa.timestamp("s")),
        "raw": pa.array([b"\x00ab"] * 2, pa.binary()),
        "price": pa.array([decimal.Decimal("1.25")] * 2, pa.decimal128(5, 2)),
    }
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["x", "y"], **metadata}), tmp_path / "ok.parquet")
    tasks, _ = read_manifest(tmp_path / "ok.parquet", CFG)
    stored = tasks_from_table(tasks_to_table(tasks))[0].meta  # what a task row keeps of the same values
    assert stored == {"day": "2024-05-01", "when": "2024-05-01T12:30:00", "raw": "\x00ab", "price": "1.25"}
    # the same rows with no document: every one is rejected, so no model runs
    pq.write_table(pa.table({"id": ["a", "b"], "text": pa.nulls(2, pa.string()), **metadata}), tmp_path / "m.parquet")
    proc = kvbatch("submit", str(tmp_path / "m.parquet"), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "job"))
    assert "Traceback" not in proc.stderr and "2 manifest row(s) rejected" in proc.stdout, proc.stderr
    rows = export_rows(tmp_path / "job", "--errors")
    assert [r["doc_id"] for r in rows] == ["a", "b"] and all(r["status"] == "rejected" for r in rows)
    assert all({key: r[key] for key in stored} == stored for r in rows), rows


def test_load_task_text_rereads_files_and_refuses_changed_ones(tmp_path: Path, docs: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "path": "docs/bsd.txt"}, {"id": "t", "text": "Inline."}])
    (path_task, text_task), _ = read_manifest(manifest, CFG)
    assert load_task_text(path_task) == BSD and load_task_text(text_task) == "Inline."

    (docs / "bsd.txt").write_text(BSD.replace("copyright", "COPYRIGHT"))  # same size, different content
    with pytest.raises(DocumentError, match="'a' .* changed since the job was submitted \\(sha256 differs\\)"):
        load_task_text(path_task)
    (docs / "bsd.txt").write_text(BSD + "more")
    with pytest.raises(DocumentError, match="changed since the job was submitted \\(it is now larger"):
        load_task_text(path_task)
    (docs / "bsd.txt").unlink()
    with pytest.raises(DocumentError, match="'a' can no longer be read: file .* does not exist"):
        load_task_text(path_task)


def test_read_document_reads_gzip_and_plain_files(docs: Path) -> None:
    assert read_document(docs / "mit.txt.gz", 10_000, None).text == MIT_LIKE
    assert read_document(docs / "bsd.txt", len(BSD.encode()), docs.resolve()).text == BSD
    with pytest.raises(DocumentError, match="path .* contains a NUL character"):
        read_document(docs / "a\x00b", 100, None)


def test_task_is_immutable() -> None:
    task = Task("t000001", "a", "text", "x", 1, 1, text_sha256("x"), {}, {})
    with pytest.raises(AttributeError):
        task.doc_id = "b"  # type: ignore[misc]


# ---------------------------------------------------------------- rows users really have: scraped text, hand-edited CSV

#: A JSON-escaped lone surrogate, as scrapers emit when they cut a UTF-16 pair in half.
LONE = "\\ud800"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"id": "a", "text": "hi %s there"}', "'text'"),
        ('{"id": "a%s", "text": "hi"}', "'id'"),
        ('{"id": "a", "text": "hi", "prompt": "Sum %s up"}', "'prompt'"),
        ('{"id": "a", "text": "hi", "source": "web %s"}', "metadata 'source'"),
        ('{"id": "a", "text": "hi", "tags": {"k%s": [1]}}', "metadata 'tags'"),
        ('{"id": "a", "path": "doc%s.txt"}', "'path'"),
    ],
    ids=["text", "id", "prompt", "metadata", "nested-metadata-key", "path"],
)
def test_a_lone_surrogate_escape_is_a_rejected_row_naming_the_field(tmp_path: Path, line: str, field: str) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(line % LONE + "\n" + '{"id": "b", "text": "fine"}\n', encoding="utf-8")
    tasks, rejections = read_manifest(manifest, CFG)
    assert [t.doc_id for t in tasks] == ["b"]
    [rejection] = rejections
    assert rejection.reason.startswith("m.jsonl line 1")
    assert f"{field} contains a lone UTF-16 surrogate" in rejection.reason and "\\ud800" in rejection.reason
    # what is kept of the row (id, metadata) is valid UTF-8: it can be stored and exported
    json.dumps({"id": rejection.doc_id, "meta": rejection.meta}, ensure_ascii=False).encode("utf-8")
    tasks_to_table(tasks)


def test_csv_with_an_unterminated_quote_is_refused_naming_its_line(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text('id,text\na,"hello\nb,world\nc,more text\n', encoding="utf-8")
    with pytest.raises(ManifestError) as refused:
        read_manifest(manifest, CFG)
    message = str(refused.value)
    assert "m.csv line 2" in message and "quote" in message and "lines 2-4" in message


def test_csv_rows_swallowed_by_a_quote_that_closes_late_are_not_lost_silently(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text('id,text\na,"hello\nb,world\nc,"more" text\nd,last\n', encoding="utf-8")
    with pytest.raises(ManifestError, match="m.csv line 2"):
        read_manifest(manifest, CFG)


def test_a_bad_csv_row_on_one_line_stays_a_rejection_of_that_row(tmp_path: Path) -> None:
    manifest = tmp_path / "m.csv"
    manifest.write_text('id,text\na,"bad"quote\nb,"multi\nline"\nc,"last\n', encoding="utf-8")
    tasks, rejections = read_manifest(manifest, CFG)
    assert [t.doc_id for t in tasks] == ["b"]
    assert [(r.row, "line 2" in r.reason) for r in rejections] == [(2, True), (4, False)]
    assert "line 5" in rejections[1].reason  # the unterminated quote on the last line is named


def test_a_row_prompt_that_leaves_no_room_for_the_document_is_rejected_naming_the_row(tmp_path: Path) -> None:
    """A 300k-token `prompt` passed the manifest and failed every pass at run time (exit 3): measured with the
    model's tokenizer (chat template included), as summarize.prompt is, it is a rejected row at submit."""
    from jobs.config import load_config
    from runner.preflight import prompt_measure

    config = load_config(REPO / "configs" / "tiny.yaml")  # context_tokens 1024, max_new_tokens 16
    measure = prompt_measure(config)
    assert measure is not None
    rows = [
        {"id": "huge", "text": "A memo.", "prompt": "Summarise this carefully. " * 60000},
        {"id": "fits", "text": "A memo.", "prompt": "Summarise in one line: " + "word " * 800},
        {"id": "too-long", "text": "A memo.", "prompt": "word " * 1000},
        {"id": "answer-eats-it", "text": "A memo.", "prompt": "word " * 600, "max_new_tokens": 200},
        {"id": "plain", "text": "A memo."},
    ]
    tasks, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", rows), CFG,
                                      context_tokens=config.summarize.context_tokens, prompt_measure=measure)
    assert [t.doc_id for t in tasks] == ["fits", "plain"]
    reasons = {r.doc_id: r.reason for r in rejections}
    assert reasons.keys() == {"huge", "too-long", "answer-eats-it"}
    assert reasons["huge"].startswith("m.jsonl line 1 (id 'huge'): 'prompt' takes ")
    for doc_id, answer in (("huge", 16), ("too-long", 16), ("answer-eats-it", 200)):
        assert f"with an answer of up to {answer} tokens" in reasons[doc_id], reasons[doc_id]
        assert "summarize.context_tokens (1024)" in reasons[doc_id]
