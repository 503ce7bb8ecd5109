"""Real document collections: files made at test time by their own libraries (fpdf2, pypdf, python-docx),
and GNU info manuals shipped by the OS; each summarised with the right text or rejected with a reason."""

from __future__ import annotations

import gzip
import io
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.config import InputConfig
from jobs.documents import load_task_text
from jobs.extract import MAX_CONTROL_SHARE
from jobs.manifest import read_manifest
from tests.helpers.cli import TINY_CONFIG, export_rows, kvbatch, refusal, write_jsonl
from tests.helpers.collection import (
    ACCEPTED,
    ARTICLE,
    DOCX_PARAGRAPHS,
    HTML,
    MARKDOWN,
    REJECTED,
    docx_bytes,
    make_collection,
)


def _info_manual() -> Path | None:
    """A GNU info manual from the OS: its index nodes hold NULs and every node starts with \\x1f."""
    found = sorted(Path("/usr/share/info").glob("*.info.gz"))
    return next((p for p in found if b"\x00" in gzip.decompress(p.read_bytes())), None)


@pytest.fixture(scope="module")
def collection(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_collection(tmp_path_factory.mktemp("collection") / "docs")


def _read(collection: Path, tmp_path: Path, names: list[str]):
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": n, "path": str(collection / n)} for n in names])
    return read_manifest(manifest, InputConfig())


def test_each_format_gives_the_text_a_reader_sees(collection: Path, tmp_path: Path) -> None:
    tasks, rejections = _read(collection, tmp_path, list(ACCEPTED))
    assert rejections == []
    by_id = {t.doc_id: t for t in tasks}
    for name, (fmt, expected) in ACCEPTED.items():
        task = by_id[name]
        text = load_task_text(task)  # extracted again, as a worker does, and checked against the fingerprint
        assert task.source_format == fmt, name
        assert task.n_chars == len(text) and task.n_bytes == (collection / name).stat().st_size
        if expected is not None:
            assert text == expected, name
    html = load_task_text(by_id["notice.html"])
    assert all(sentence in html for sentence in ARTICLE)
    assert not any(junk in html for junk in ("SCRIPT_SECRET", "tracker", "About us", "color: red", "Privacy policy"))


def test_legacy_encodings_are_detected_and_recorded(collection: Path, tmp_path: Path) -> None:
    tasks, _ = _read(collection, tmp_path, ["french-latin1.txt", "memo-cp1252.txt", "notes/release.md", "lease.pdf"])
    encodings = {t.doc_id: t.encoding for t in tasks}
    # Latin-1 and Windows-1252 agree on every letter of the French text: Western text is named cp1252
    assert encodings["french-latin1.txt"] == "cp1252"
    # the curly quotes are bytes 0x93/0x94/0x92, C1 controls in Latin-1: Windows-1252 (and 1250) read them
    assert encodings["memo-cp1252.txt"] == "cp1252"
    assert encodings["notes/release.md"] == "utf-8" and encodings["lease.pdf"] is None


#: language -> (text, the code page it is saved in); each must be read back exactly and recorded under that name
LEGACY_TEXTS = {
    "german": ("Der Bär läuft über die Straße. Größe und Übermaß sind schön.\n", "cp1252"),  # cp1250 has ä ö ü ß too
    "swedish": ("Smörgåsbord och kärlek på ön.\n", "cp1252"),  # å is ĺ in cp1250
    "french": ("Naïve café résumé, the façade of the coöperative.\n", "cp1252"),  # ï is ď in cp1250
    "czech": ("Příliš žluťoučký kůň úpěl ďábelské ódy.\n", "cp1250"),  # ť is no character of cp1252
    "polish": ("Zażółć gęślą jaźń. Łódź jest dużym miastem w Polsce.\n", "cp1250"),
    "russian": ("Привет, как дела? Всё хорошо.\n", "cp1251"),
}


@pytest.mark.parametrize(("text", "encoding"), LEGACY_TEXTS.values(), ids=LEGACY_TEXTS.keys())
def test_western_text_is_cp1252_and_central_european_text_stays_cp1250(tmp_path: Path, text: str, encoding: str) -> None:
    (tmp_path / "doc.txt").write_bytes(text.encode(encoding))
    tasks, rejections = _read(tmp_path, tmp_path, ["doc.txt"])
    assert rejections == [] and tasks[0].encoding == encoding
    assert load_task_text(tasks[0]) == text


def test_unreadable_files_are_rejected_with_the_reason(collection: Path, tmp_path: Path) -> None:
    tasks, rejections = _read(collection, tmp_path, list(REJECTED))
    assert tasks == []
    reasons = {r.doc_id: r.reason for r in rejections}
    for name, reason in REJECTED.items():
        assert reason in reasons[name], reasons[name]
    assert "ocrmypdf" in reasons["scan.pdf"] and "qpdf --decrypt" in reasons["locked.pdf"]
    assert f"over the {100 * MAX_CONTROL_SHARE:.0f} % a text file may hold" in reasons["program.bin"]


def test_a_gnu_info_manual_with_nul_bytes_is_read_as_text(tmp_path: Path) -> None:
    manual = _info_manual()
    if manual is None:
        pytest.skip("no GNU info manual with NUL bytes in /usr/share/info on this machine")
    tasks, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", [{"id": "info", "path": str(manual)}]), InputConfig())
    assert rejections == [], rejections
    text = load_task_text(tasks[0])
    assert "\x00" not in text and "\x1f" not in text and tasks[0].source_format == "text"
    assert len(text) > 0.95 * len(gzip.decompress(manual.read_bytes()).decode("utf-8"))


def test_inline_text_with_a_stray_control_character_is_cleaned(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "A long enough sentence about the\x07 annual report."}])
    tasks, rejections = read_manifest(manifest, InputConfig())
    assert rejections == [] and tasks[0].source == "A long enough sentence about the annual report."


def test_a_file_named_pdf_that_is_not_one_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "fake.pdf").write_text("just text")
    _, rejections = read_manifest(write_jsonl(tmp_path / "m.jsonl", [{"id": "f", "path": "fake.pdf"}]), InputConfig())
    assert "is named .pdf but is not a PDF" in rejections[0].reason


def test_a_utf16_file_with_a_byte_order_mark_is_decoded(tmp_path: Path) -> None:
    (tmp_path / "u.txt").write_text("Hello there, wörld.", encoding="utf-16")
    tasks, _ = read_manifest(write_jsonl(tmp_path / "m.jsonl", [{"id": "u", "path": "u.txt"}]), InputConfig())
    assert load_task_text(tasks[0]) == "Hello there, wörld." and tasks[0].encoding == "utf-16"


def test_an_extensionless_html_file_with_a_byte_order_mark_is_read_as_html(tmp_path: Path) -> None:
    (tmp_path / "notice-utf8").write_bytes(b"\xef\xbb\xbf" + HTML.encode("utf-8"))
    (tmp_path / "notice-utf16").write_bytes(HTML.encode("utf-16"))  # BOM first, as Windows tools write it
    tasks, rejections = _read(tmp_path, tmp_path, ["notice-utf8", "notice-utf16"])
    assert rejections == [] and [t.source_format for t in tasks] == ["html", "html"]
    for task in tasks:
        text = load_task_text(task)
        assert all(sentence in text for sentence in ARTICLE)
        assert "SCRIPT_SECRET" not in text and "<" not in text  # the model gets the page's text, not its markup


def test_a_docx_that_expands_past_the_limit_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    """A zip bomb: a small DOCX whose document.xml inflates to more than input.max_document_bytes."""
    import zipfile

    limit = 2_000_000
    with zipfile.ZipFile(io.BytesIO(docx_bytes())) as real, zipfile.ZipFile(tmp_path / "bomb.docx", "w") as bomb:
        for member in real.infolist():
            data = real.read(member)
            if member.filename == "word/document.xml":  # whitespace between elements: still a valid document
                data = data.replace(b"</w:body>", b" " * (2 * limit) + b"</w:body>")
            bomb.writestr(member.filename, data, compress_type=zipfile.ZIP_DEFLATED)
    (tmp_path / "minutes.docx").write_bytes(docx_bytes())
    assert (tmp_path / "bomb.docx").stat().st_size < limit // 20  # the file's own size is far under the limit
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": n, "path": n} for n in ("bomb.docx", "minutes.docx")])
    tasks, rejections = read_manifest(manifest, InputConfig(max_document_bytes=limit))
    assert [t.doc_id for t in tasks] == ["minutes.docx"] and load_task_text(tasks[0]).startswith(DOCX_PARAGRAPHS[0])
    assert [r.doc_id for r in rejections] == ["bomb.docx"]
    reason = rejections[0].reason
    assert "bomb.docx is a DOCX that expands to" in reason and f"over input.max_document_bytes ({limit})" in reason


# ---------------------------------------------------------------- the whole CLI on a folder


def test_submit_a_folder_resume_and_export_the_text(collection: Path, tmp_path: Path, ray_address: str) -> None:
    """`kvbatch submit DIR` on the mixed folder; one document fails by an injected error, `resume
    --retry-failed` finishes it; `results --with-text` shows exactly what each model was given."""
    job = tmp_path / "job"
    faults = json.dumps([{"doc": "lease.pdf", "fault": "error"}])
    proc = kvbatch("submit", str(collection), "-c", str(TINY_CONFIG), "-j", str(job), "--address", ray_address,
                   "--set", "retry.max_attempts=1", "--set", "workers.count=1", env={"KVBATCH_FAULTS": faults},
                   check=3)  # 3: a document failed
    assert f"{len(ACCEPTED) + len(REJECTED)} document(s) in {collection}" in " ".join(proc.stdout.split())
    listed = [json.loads(line) for line in (job / "input-manifest.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in listed) == sorted([*ACCEPTED, *REJECTED])  # id = relative path; .hidden.txt left out
    assert json.loads((job / "job.json").read_text())["manifest"]["path"] == str(job / "input-manifest.jsonl")
    assert {r["doc_id"]: r["status"] for r in export_rows(job)}["lease.pdf"] == "failed"

    kvbatch("resume", str(job), "--retry-failed", "--address", ray_address, check=3)
    rows = {r["doc_id"]: r for r in export_rows(job, "--with-text")}
    assert {d for d, r in rows.items() if r["status"] == "done"} == set(ACCEPTED)
    assert {d for d, r in rows.items() if r["status"] == "rejected"} == set(REJECTED)
    for name, (fmt, expected) in ACCEPTED.items():
        row = rows[name]
        assert row["source_format"] == fmt and row["summary"] and row["n_chars"] == len(row["text"])
        if expected is not None:
            assert row["text"] == expected, name
    assert rows["memo-cp1252.txt"]["encoding"] in ("cp1252", "cp1250") and rows["lease.pdf"]["encoding"] is None
    for name, reason in REJECTED.items():
        assert reason in rows[name]["error"] and rows[name]["text"] is None


@pytest.fixture(scope="module")
def glob_job(collection: Path, tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> Path:
    """`kvbatch submit DIR --glob '*.pdf'`: one PDF done, two rejected."""
    job = tmp_path_factory.mktemp("glob") / "job"
    kvbatch("submit", str(collection), "--glob", "*.pdf", "-c", str(TINY_CONFIG), "-j", str(job),
            "--address", ray_address, "--set", "workers.count=1", check=3)
    return job


def test_submit_a_folder_with_glob(collection: Path, glob_job: Path, tmp_path: Path) -> None:
    rows = {r["doc_id"]: r["status"] for r in export_rows(glob_job)}
    assert rows == {"lease.pdf": "done", "scan.pdf": "rejected", "locked.pdf": "rejected"}
    proc = refusal("submit", str(collection), "--glob", "*.odt", "-c", str(TINY_CONFIG), "-j", str(tmp_path / "none"))
    assert "has no documents matching --glob '*.odt'" in proc.stderr


def test_results_read_parts_written_before_the_format_columns(glob_job: Path, tmp_path: Path) -> None:
    """A job whose result parts predate source_format, encoding and n_chars exports them as null."""
    job = Path(shutil.copytree(glob_job, tmp_path / "job"))  # the glob test reads the job as it was written
    for part in (job / "results").glob("part-*.parquet"):
        pq.write_table(pq.read_table(part).drop_columns(["source_format", "encoding", "n_chars"]), part)
    manifest_table = pq.read_table(job / "manifest.parquet").drop_columns(["source_format", "encoding"])
    pq.write_table(manifest_table, job / "manifest.parquet")
    row = {r["doc_id"]: r for r in export_rows(job, "--with-text")}["lease.pdf"]
    assert row["status"] == "done" and row["source_format"] is None and row["n_chars"] is None
    assert row["text"] == ACCEPTED["lease.pdf"][1]


# ---------------------------------------------------------------- what a folder listing leaves out


def _listed_ids(staged) -> list[str]:  # noqa: ANN001
    return [json.loads(line)["id"] for line in staged.path.read_text().splitlines()]


@pytest.fixture(scope="module")
def folder_with_an_earlier_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/ holding one document and a real job folder an earlier `submit docs -j docs/runs/first` made there."""
    docs = tmp_path_factory.mktemp("earlier") / "docs"
    (docs / "notes").mkdir(parents=True)
    (docs / "notes" / "empty.md").write_text("")  # rejected, so no submit here needs Ray
    first = kvbatch("submit", str(docs), "-c", str(TINY_CONFIG), "-j", str(docs / "runs" / "first"))
    assert (docs / "runs" / "first" / "job.json").is_file(), first.stderr
    return docs


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_a_folder_listing_leaves_out_earlier_kvbatch_job_folders(
    folder_with_an_earlier_job: Path, tmp_path: Path, as_uri: bool
) -> None:
    from storage.inputs import stage_input

    docs = folder_with_an_earlier_job
    source = f"file://{docs}/" if as_uri else str(docs)
    staged = stage_input(source, None, tmp_path)
    assert _listed_ids(staged) == ["notes/empty.md"]
    assert staged.notes == ("left out 1 kvbatch job folder(s): runs/first",)


def test_submit_names_the_job_folders_it_leaves_out_and_refuses_a_job_folder_as_documents(
    folder_with_an_earlier_job: Path, tmp_path: Path
) -> None:
    docs = folder_with_an_earlier_job
    proc = kvbatch("submit", str(docs), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "second"))
    assert "left out 1 kvbatch job folder(s): runs/first" in proc.stdout, proc.stdout + proc.stderr
    listed = [json.loads(line)["id"] for line in (tmp_path / "second" / "input-manifest.jsonl").read_text().splitlines()]
    assert listed == ["notes/empty.md"]
    refused = refusal("submit", str(docs / "runs" / "first"), "-c", str(TINY_CONFIG), "-j", str(tmp_path / "third"))
    assert f"is a kvbatch job folder, not a folder of documents: continue it with `kvbatch resume {docs / 'runs' / 'first'}`" \
        in " ".join(refused.stderr.split())
    assert not (tmp_path / "third").exists()


def test_a_symlinked_subfolder_is_left_out_and_named(tmp_path: Path) -> None:
    from storage.inputs import stage_input

    docs, elsewhere = tmp_path / "docs", tmp_path / "elsewhere"
    docs.mkdir()
    elsewhere.mkdir()
    (docs / "a.md").write_text(MARKDOWN)
    (elsewhere / "b.md").write_text(MARKDOWN)
    (docs / "linked").symlink_to(elsewhere, target_is_directory=True)
    (docs / "loop").symlink_to(docs, target_is_directory=True)  # a link that would list the folder forever
    (docs / "b-link.md").symlink_to(elsewhere / "b.md")  # a linked file is a document like any other
    (tmp_path / "work").mkdir()
    staged = stage_input(str(docs), None, tmp_path / "work")
    assert _listed_ids(staged) == ["a.md", "b-link.md"]
    assert staged.notes == (
        f"left out 2 symlinked folder(s), not followed: linked -> {elsewhere}, loop -> {docs}; "
        "submit the target folder itself, or name its files in a manifest",
    )
