"""The progress line tells the truth while a batch runs: busy workers (not tasks) out of the workers, tokens
counted as they are decoded (a pace and an ETA before the first document ends), done/total and the
elapsed time on an 80-column terminal, and the one-time model conversion said before the wait."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

from rich.console import Console

from runner.observe.joblog import read_log
from runner.observe.progress import BatchProgress
from tests.helpers.cli import TINY_CONFIG, kvbatch, write_jsonl

NEW_TOKENS = 300
LINE = re.compile(r"^progress: (\d+)/(\d+) documents  elapsed [\d:]+  ([\d.]+) tok/s  ETA (\S+)  failed \d+  "
                  r"active (\d+)/(\d+) workers  fallbacks \d+$")


def test_a_batch_shows_its_pace_before_any_document_ends(tmp_path: Path) -> None:
    """Four documents decode side by side on one worker (a private Ray: the workers see this environment),
    each for 300 tokens: they end together, so every line before that is the pace of tokens in flight."""
    text = "The committee reviewed the quarterly figures and agreed to publish them next week. " * 6
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"d{i}", "text": f"{i}. {text}"} for i in range(4)])
    cache = tmp_path / "models"  # nothing converted yet
    job = tmp_path / "job"
    proc = kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job),
                   "--set", "workers.count=1", "--set", "batch.max_sequences=4",
                   "--set", f"summarize.max_new_tokens={NEW_TOKENS}", "--set", "summarize.min_context_tokens=1024",
                   "--set", "summarize.no_repeat_summary_ngram=0",
                   "--set", "summarize.loop_stop.enabled=false",
                   "--set", f'summarize.generation={{"min_new_tokens": {NEW_TOKENS}}}',
                   env={"KVBATCH_PROGRESS_INTERVAL_S": "0.5", "KVBATCH_CACHE_DIR": str(cache), "COLUMNS": "1000"},
                   check=0)
    out = proc.stdout
    lines = [line for line in out.splitlines() if line.startswith("progress: ")]
    parsed = [LINE.match(line) for line in lines]
    assert lines and all(parsed), out
    assert all(int(m[5]) <= int(m[6]) == 1 for m in parsed), out  # 4 tasks in flight, 1 worker
    before_the_first = [m for m in parsed if m[1] == "0" and float(m[3]) > 0]
    assert before_the_first, out  # tokens counted as they were decoded, not when a document ended
    assert all(m[4] != "unknown" for m in before_the_first), out
    assert parsed[-1][1] == parsed[-1][2] == "4" and parsed[-1][4] == "0:00"
    # the one-time conversion is said before the wait: by submit, or by the settings check that needs the
    # tokenizer first (runner/preflight.py's merge room), on stderr before anything started
    announced = [i for i, line in enumerate(out.splitlines()) if line.startswith("first run on this machine: ")]
    checked = [line for line in proc.stderr.splitlines() if line.startswith("kvbatch: extracting the SmolLM2 tokenizer")]
    assert announced or checked, out + proc.stderr
    assert "SmolLM2 tokenizer" in out + proc.stderr and str(cache) in out + proc.stderr, out + proc.stderr
    assert checked or announced[0] < out.splitlines().index(lines[0])
    assert any(cache.glob("smollm2-*-tokenizer")), "the conversion announced was not the one the workers made"
    samples = [e for e in read_log(job / "job.log") if e["event"] == "progress"]
    assert samples and samples[-1]["decode_tokens"] >= 4 * (NEW_TOKENS - 1) and samples[-1]["done"] == 4
    rows = [json.loads(line) for line in kvbatch("results", str(job), check=0).stdout.splitlines()]
    assert [r["output_tokens"] for r in rows] == [NEW_TOKENS] * 4


def test_done_total_and_elapsed_stay_on_an_80_column_terminal() -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=80, color_system=None)
    with BatchProgress(console, 5, 0, 2, {f"t{i}": 100 for i in range(5)}, lambda: 2, lambda: 4321,
                       plain_interval_s=10) as progress:
        for i in range(3):
            progress.record(f"t{i}", "failed", 60, 1)  # the longest details: failures and fallbacks
        time.sleep(1.5)  # a tick: the workers are asked for their tokens
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()).replace("\r", "\n").strip().splitlines()[-1]
    assert len(last) <= 80 and re.match(r"3/5 documents 0:00:0\d ", last), last
    assert "tok/s" in last
