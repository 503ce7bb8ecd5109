"""Input users really have (scraped text, hand-edited CSV, ragged metadata) and the job-folder races
around `submit`: every row ends as a task or a named rejection, nothing crashes, nothing is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.config import InputConfig
from jobs.manifest import ManifestError, read_manifest, tasks_to_table

CFG = InputConfig()

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
