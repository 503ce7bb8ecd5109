"""One document to summarise, as validated at submit time and stored in the job folder's manifest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    task_id: str
    doc_id: str
    source_type: str  # "text" | "path"
    source: str  # the text itself, or the resolved absolute path (or storage URI)
    n_chars: int  # of the extracted text the model is given
    n_bytes: int  # of the document as read: the file (decompressed for .gz), or the inline text's UTF-8
    sha256: str  # of the extracted text's UTF-8; a path task's file is checked against it before it runs
    overrides: dict  # max_new_tokens: int, prompt: str (only those given)
    meta: dict  # every other manifest field, passed through to the results
    source_format: str | None = None  # pdf, html, docx, markdown, rst, text; None in jobs made before formats
    encoding: str | None = None  # of a text file (utf-8, cp1252...); None for inline text, PDF, DOCX
