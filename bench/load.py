"""Load: thousands of real-text documents through `kvbatch submit`, then how fast the job folder
reads back and how compact it stays.

Documents are cut from /usr/share/common-licenses at varied lengths (a few sentences to most of
the tiny config's context window, so each is one pass) and run with builtin:tiny-random and a few new tokens, so the figures are the
runner's (scheduling, checkpointing, compaction), not the model's. Printed side by side: the
batch's wall time and documents per second; `kvbatch status --json` (a fresh process) and
`load_state` (in process) against the batch time; the job folder's parts and bytes after the
final compaction against the manifest's size.

Run: python bench/load.py [--docs 5000] [--max-new-tokens 4] [--workers 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import LICENSES, REPO, kvbatch, submit

from storage.checkpoint import load_state

TINY_CONFIG = REPO / "configs" / "tiny.yaml"


def write_manifest(path: Path, n_docs: int) -> int:
    """JSONL of `n_docs` license excerpts, 200 to 3,000 characters, starting at varied offsets."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(LICENSES.iterdir()) if p.is_file()]
    with path.open("w", encoding="utf-8") as f:
        for i in range(n_docs):
            text = texts[i % len(texts)]
            length = 200 + (i * 7919) % 2800
            start = (i * 104729) % max(1, len(text) - 1)
            body = (text[start:] + text)[:length]
            f.write(json.dumps({"id": f"doc-{i:05d}", "text": body, "source": i % len(texts)}) + "\n")
    return path.stat().st_size


def folder_figures(job: Path) -> tuple[int, int]:
    parts = list(job.glob("*/part-*.parquet"))
    size = sum(p.stat().st_size for p in job.rglob("*") if p.is_file())
    return len(parts), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="folder to keep the manifest and job in")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="kvbatch-load-"))
    base.mkdir(parents=True, exist_ok=True)
    manifest, job = base / "manifest.jsonl", base / "job"
    manifest_bytes = write_manifest(manifest, args.docs)

    batch_s = submit(manifest, TINY_CONFIG, job, [f"summarize.max_new_tokens={args.max_new_tokens}",
                                                  f"workers.count={args.workers}"]).wall_s
    status_s, status = kvbatch(["status", str(job), "--json"])
    counts = json.loads(status)["counts"]
    started = time.perf_counter()
    state = load_state(job)
    load_s = time.perf_counter() - started
    parts, size = folder_figures(job)

    assert counts["done"] == args.docs and len(state.done_task_ids) == args.docs, counts
    rows = [
        ("documents", f"{args.docs}", ""),
        ("submit wall time (Ray start, model load, batch, compaction)", f"{batch_s:.1f} s", f"{args.docs / batch_s:.1f} docs/s"),
        ("`kvbatch status --json` (new process)", f"{status_s:.2f} s", f"{status_s / batch_s:.2%} of the batch"),
        ("load_state (in process)", f"{load_s * 1000:.0f} ms", f"{load_s / batch_s:.2%} of the batch"),
        ("part files after compaction", f"{parts}", f"{parts / args.docs:.4f} per document"),
        ("job folder bytes", f"{size / 1e6:.1f} MB", f"{size / manifest_bytes:.2f} x the manifest ({manifest_bytes / 1e6:.1f} MB)"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value:>10}  {ratio}")
    print(f"job folder: {job}")


if __name__ == "__main__":
    main()
