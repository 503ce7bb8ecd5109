"""A real document collection made at test time by the formats' own libraries (fpdf2, pypdf,
python-docx): what each accepted file's reader must give, and why each rejected one is refused."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

PAGE_1 = "Page one. The tenant pays the rent on the first day of every month."
PAGE_2 = "Page two. The landlord repairs the roof within thirty days of a written notice."
ARTICLE = (
    "The water supply to Elm Street will be interrupted on Tuesday from 9 am to 3 pm while the main pipe is replaced.",
    "Residents should store drinking water in advance. Tankers will be parked at the corner of Elm Street and Oak Avenue.",
)
HTML = f"""<!DOCTYPE html><html><head><title>Notice</title>
<script>var tracking = "SCRIPT_SECRET"; document.write("tracker");</script><style>.menu {{ color: red }}</style></head>
<body><nav><ul><li><a href="/">Home</a></li><li><a href="/about">About us</a></li><li><a href="/c">Contact</a></li></ul></nav>
<main><article><h1>Water supply interruption</h1><p>{ARTICLE[0]}</p><p>{ARTICLE[1]}</p></article></main>
<footer>Copyright 2024 City Council. Privacy policy.</footer></body></html>"""
LATIN1 = "Le café de la gare était fermé à cause de la grève. Les élèves ont mangé des crêpes près du théâtre.\n"
CP1252 = "\u201cThe memo\u201d \u2014 it\u2019s the manager\u2019s note about the \u20ac5 fee for late returns.\n" * 3
STRAY = "The committee met on Monday.\x00 It approved the budget for the new library\x1f and the park.\n" * 4
DOCX_PARAGRAPHS = ("Minutes of the board meeting", "The board approved the merger with Acme Ltd.")
MARKDOWN = "# Release notes\n\n- Faster start-up\n- **Fixed** the crash on empty files\n"


def pdf_bytes(pages: list[str]) -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 10, text)
    return bytes(pdf.output())


def scanned_pdf_bytes() -> bytes:
    """A page with a drawing and no text layer, as a scanner's PDF has."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.rect(20, 20, 100, 60, style="F")
    return bytes(pdf.output())


def encrypted_pdf_bytes() -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes(["A secret contract."]))))
    writer.encrypt(user_password="secret", algorithm="AES-256")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def docx_bytes() -> bytes:
    import docx

    document = docx.Document()
    document.add_heading(DOCX_PARAGRAPHS[0], level=1)
    document.add_paragraph(DOCX_PARAGRAPHS[1])
    table = document.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "Votes for", "7"
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


#: file name -> (format, the text the model must get, or None) for the accepted files
ACCEPTED = {
    "lease.pdf": ("pdf", f"{PAGE_1}\n\n{PAGE_2}"),
    "notice.html": ("html", None),  # main text checked below
    "minutes.docx": ("docx", f"{DOCX_PARAGRAPHS[0]}\n{DOCX_PARAGRAPHS[1]}\nVotes for\t7"),
    "notes/release.md": ("markdown", MARKDOWN),
    "french-latin1.txt": ("text", LATIN1),
    "memo-cp1252.txt": ("text", CP1252),
    "stray-nul.txt": ("text", STRAY.replace("\x00", "").replace("\x1f", "")),
}
#: file name -> what its rejection says
REJECTED = {
    "scan.pdf": "no text layer (a scanned document?)",
    "locked.pdf": "is an encrypted PDF that needs a password",
    "program.bin": "is binary:",
}


def make_collection(folder: Path) -> Path:
    """A folder mixing the formats a real collection holds, good and bad."""
    (folder / "notes").mkdir(parents=True)
    files = {
        "lease.pdf": pdf_bytes([PAGE_1, PAGE_2]),
        "notice.html": HTML.encode("utf-8"),
        "minutes.docx": docx_bytes(),
        "notes/release.md": MARKDOWN.encode("utf-8"),
        "french-latin1.txt": LATIN1.encode("latin-1"),
        "memo-cp1252.txt": CP1252.encode("cp1252"),
        "stray-nul.txt": STRAY.encode("utf-8"),
        "scan.pdf": scanned_pdf_bytes(),
        "locked.pdf": encrypted_pdf_bytes(),
        "program.bin": Path(shutil.which("ls") or "/bin/ls").read_bytes(),  # a real executable
        ".hidden.txt": b"left out of folder listings",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder
