"""From a document file's bytes to the text a model reads: PDF, HTML, DOCX, or text in any common encoding.

Pure and deterministic, so the text extracted at submit time and again by a worker has the same fingerprint;
each format's library is imported only when a file of it is met. Binary is told from text by the share of
control bytes (MAX_CONTROL_SHARE), not by any NUL as `file` and git do: GNU info manuals hold up to 3 %
(NULs, \\x1f node markers), binary data 10 % or more (docs/input.md, "Document formats").
"""

from __future__ import annotations

import codecs
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from charset_normalizer import CharsetMatch, CharsetMatches


class ExtractError(ValueError):
    """No text can be had from these bytes; the message (to follow the file's name) says why and what to do."""


@dataclass(frozen=True)
class Extracted:
    text: str
    source_format: str  # pdf, docx, html, markdown, rst, text
    encoding: str | None  # Python's name of the text encoding; None for PDF and DOCX (binary containers)
    n_bytes: int  # of the bytes the text came from


#: Above this share of control bytes a file is binary, below it stray control characters are cleaned.
MAX_CONTROL_SHARE = 0.05

#: Bytes outside `file`'s text set: C0 controls but BEL, BS, TAB, LF, VT, FF, CR and ESC; and DEL.
_CONTROL_BYTES = bytes([*range(0x00, 0x07), *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F])
#: Characters removed from extracted text: every C0/C1 control but TAB, LF, FF and CR.
_STRAY_CONTROLS = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")

#: The legacy encodings a real collection holds. Searching every code page instead makes short texts
#: come out as EBCDIC or Urdu (charset-normalizer reads "Caf\xe9" as cp037).
LEGACY_ENCODINGS = (
    "cp1252", "cp1250", "cp1251", "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258",
    "latin_1", "iso8859_2", "iso8859_5", "iso8859_7", "iso8859_15", "koi8_r", "cp866", "mac_roman",
    "shift_jis", "euc_jp", "gb18030", "big5", "euc_kr",
)
#: The legacy encoding of Western European text, preferred where another reads the bytes no better.
WESTERN = "cp1252"
_UNICODE_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)

_FORMAT_OF_SUFFIX = {
    ".pdf": "pdf", ".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html",
    ".md": "markdown", ".markdown": "markdown", ".rst": "rst",
}
SUPPORTED = "text (any common encoding), Markdown, reStructuredText, HTML, PDF with a text layer or DOCX"


def extract(data: bytes, name: str, max_expanded_bytes: int | None) -> Extracted:
    """The text of a document file named `name` (a `.gz` already decompressed and still in the name).

    `max_expanded_bytes`: what a DOCX (a ZIP) may expand to, checked before it is expanded; None: no limit.
    """
    fmt = detect_format(data, name)
    if fmt == "pdf":
        return Extracted(_clean(_pdf_text(data)), fmt, None, len(data))
    if fmt == "docx":
        if max_expanded_bytes is not None:
            _check_expanded_size(data, max_expanded_bytes)
        return Extracted(_clean(_docx_text(data)), fmt, None, len(data))
    text, encoding = decode(data)
    if fmt == "html":
        text = _html_text(text)
    return Extracted(_clean(text), fmt, encoding, len(data))


def detect_format(data: bytes, name: str) -> str:
    """By magic bytes first (a PDF is a PDF whatever its name), then by extension."""
    suffix = PurePosixPath(name.lower().removesuffix(".gz")).suffix
    by_suffix = _FORMAT_OF_SUFFIX.get(suffix)
    if data.startswith(b"%PDF-") or (by_suffix == "pdf" and b"%PDF-" in data[:1024]):  # readers allow 1 KiB of junk
        return "pdf"
    if by_suffix == "pdf":
        raise ExtractError(f"is named {suffix} but is not a PDF (no %PDF- header): give the real file")
    if data.startswith(b"PK\x03\x04"):
        if _is_docx(data):
            return "docx"
        raise ExtractError(f"is a ZIP archive, not a document (supported: {SUPPORTED}): unpack it first")
    if by_suffix == "docx":
        raise ExtractError(f"is named {suffix} but is not a DOCX (a ZIP archive): give the real file")
    if by_suffix is None and _starts_like_html(data):
        return "html"
    return by_suffix or "text"


def _starts_like_html(data: bytes) -> bool:
    """`<!doctype html` or `<html` first, after any byte-order mark (UTF-8, 16 or 32) and whitespace."""
    head = data[:2048]
    if head.startswith(_UNICODE_BOMS):
        codec = "utf-32" if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)) else "utf-16"
        head = head.decode(codec, errors="ignore").encode("ascii", errors="ignore")
    return head.removeprefix(codecs.BOM_UTF8).lstrip()[:512].lower().startswith((b"<!doctype html", b"<html"))


def decode(data: bytes) -> tuple[str, str]:
    """Text and the encoding it was in: UTF-8, UTF-16/32 with a byte-order mark, else a legacy encoding."""
    from charset_normalizer import from_bytes

    if data.startswith(_UNICODE_BOMS):
        best = from_bytes(data).best()  # the byte-order mark names the encoding
    else:
        refuse_binary(data)
        try:
            return data.decode("utf-8-sig"), "utf-8"
        except UnicodeDecodeError:
            best = _western_first(from_bytes(data, cp_isolation=list(LEGACY_ENCODINGS)))
    if best is None:
        raise ExtractError(
            "fits no text encoding (UTF-8, UTF-16 with a byte-order mark, or a legacy one such as "
            f"Windows-1252 or Shift-JIS), so it is binary: give a {SUPPORTED} file"
        )
    return str(best), WESTERN if WESTERN in best.could_be_from_charset else codecs.lookup(best.encoding).name


def _western_first(matches: CharsetMatches) -> CharsetMatch | None:
    """charset-normalizer's pick, but Windows-1252 wherever it reads the bytes at least as well: Western
    text is mostly letters Windows-1250 has at the same bytes, which charset-normalizer then names first,
    though a legacy file is far more often Western (Czech or Polish text still reads best as cp1250)."""
    best = matches.best()
    western = next((m for m in matches if WESTERN in m.could_be_from_charset), None)
    if best is not None and western is not None and (
        western.percent_chaos <= best.percent_chaos and western.percent_coherence >= best.percent_coherence
    ):
        return western
    return best


def refuse_binary(data: bytes) -> None:
    """Refuse bytes whose share of control bytes only binary data has."""
    controls = len(data) - len(data.translate(None, _CONTROL_BYTES))
    if data and controls / len(data) > MAX_CONTROL_SHARE:
        raise ExtractError(
            f"is binary: {controls} of its {len(data)} bytes ({100 * controls / len(data):.1f} %) are control "
            f"bytes such as NUL, over the {100 * MAX_CONTROL_SHARE:.0f} % a text file may hold (it may also be "
            f"UTF-16 without a byte-order mark): give a {SUPPORTED} file"
        )


def clean_text(text: str) -> str:
    """Inline text under the same rule as files: a few stray control characters removed, binary refused."""
    refuse_binary(text.encode("utf-8", "surrogatepass"))
    return _clean(text)


def _clean(text: str) -> str:
    return _STRAY_CONTROLS.sub("", text)


def _is_docx(data: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return "word/document.xml" in archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def _pdf_text(data: bytes) -> str:
    """Text per page in reading order, pages separated by a blank line."""
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):  # an empty user password opens many "protected" PDFs
            raise ExtractError(
                "is an encrypted PDF that needs a password: decrypt it (e.g. qpdf --decrypt "
                "--password=PASSWORD in.pdf out.pdf) and give the decrypted copy"
            )
        pages = [page.extract_text() or "" for page in reader.pages]
    except ExtractError:
        raise
    except Exception as e:  # noqa: BLE001 - pypdf raises many types (PdfReadError, KeyError, ...) on damaged files
        raise ExtractError(f"is not a readable PDF ({type(e).__name__}: {e}): repair or re-export it") from None
    if not any(page.strip() for page in pages):
        raise ExtractError(
            f"is a PDF with {len(pages)} page(s) but no text layer (a scanned document?): "
            "run OCR on it first (e.g. ocrmypdf in.pdf out.pdf) and give the result"
        )
    return "\n\n".join(page.strip() for page in pages if page.strip())


def _check_expanded_size(data: bytes, max_bytes: int) -> None:
    """Refuse a ZIP whose members add up to more than `max_bytes` (a zip bomb), from its directory alone:
    zipfile fails a member whose data runs past its declared size instead of growing it."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        expanded = sum(member.file_size for member in archive.infolist())
    if expanded > max_bytes:
        raise ExtractError(
            f"is a DOCX that expands to {expanded} bytes, over input.max_document_bytes ({max_bytes}) "
            "(a zip bomb, or a document with huge embedded files): split the document or raise input.max_document_bytes"
        )


def _docx_text(data: bytes) -> str:
    """Paragraphs and tables of the body in document order; a table row's cells separated by tabs."""
    from docx import Document
    from docx.table import Table

    try:
        blocks = []
        for block in Document(io.BytesIO(data)).iter_inner_content():
            if isinstance(block, Table):
                blocks.extend("\t".join(cell.text for cell in row.cells) for row in block.rows)
            else:
                blocks.append(block.text)
    except Exception as e:  # noqa: BLE001 - python-docx raises KeyError, lxml and zip errors on damaged files
        raise ExtractError(f"is not a readable DOCX ({type(e).__name__}: {e}): repair or re-save it") from None
    return "\n".join(blocks)


def _html_text(html: str) -> str:
    """The page's main text: no navigation, scripts, styles or footers."""
    import trafilatura

    text = trafilatura.extract(html, include_comments=False, include_tables=True)
    if not text:
        raise ExtractError("is an HTML page in which no main text was found: give a page with an article or body text")
    return text
