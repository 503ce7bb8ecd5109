"""The progress line tells the truth while a batch runs: busy workers (not tasks) out of the workers, tokens
counted as they are decoded (a pace and an ETA before the first document ends), done/total and the
elapsed time on an 80-column terminal, and the one-time model conversion said before the wait."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from pathlib import Path

import pytest
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
    rejected = [{"id": "empty", "text": " "}, {"id": "nothing"}]  # not documents to run: never in the counts
    manifest = write_jsonl(tmp_path / "m.jsonl",
                           [*rejected, *({"id": f"d{i}", "text": f"{i}. {text}"} for i in range(4))])
    cache = tmp_path / "models"  # nothing converted yet
    job = tmp_path / "job"
    proc = kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job),
                   "--set", "workers.count=1", "--set", "batch.max_sequences=4",
                   "--set", f"summarize.max_new_tokens={NEW_TOKENS}", "--set", "summarize.min_context_tokens=1024",
                   "--set", "summarize.no_repeat_summary_ngram=0",
                   "--set", "summarize.loop_stop.enabled=false",
                   "--set", f'summarize.generation={{"min_new_tokens": {NEW_TOKENS}}}',
                   env={"KVBATCH_PROGRESS_INTERVAL_S": "0.5", "KVBATCH_CACHE_DIR": str(cache), "COLUMNS": "1000"})
    assert proc.returncode in (0, 3), proc.stderr  # what rejected rows make of the exit code is not this test's
    out = proc.stdout
    lines = [line for line in out.splitlines() if line.startswith("progress: ")]
    parsed = [LINE.match(line) for line in lines]
    assert lines and all(parsed), out
    assert all(int(m[5]) <= int(m[6]) == 1 for m in parsed), out  # 4 tasks in flight, 1 worker
    # the counts agree: 4 to run, counted as 4 (the 2 rejected rows are said apart, before and after)
    assert "2 manifest row(s) rejected" in out and "4 task(s): 0 already finished, 4 to run" in out, out
    assert all(m[2] == "4" for m in parsed) and "done 4, failed 0, rejected 2" in out, out
    before_the_first = [m for m in parsed if m[1] == "0" and float(m[3]) > 0]
    assert before_the_first, out  # tokens counted as they were decoded, not when a document ended
    assert any(re.fullmatch(r"[\d:]+", m[4]) for m in before_the_first), out  # an ETA once a rate was measured
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
    assert [r["output_tokens"] for r in rows if r["status"] == "done"] == [NEW_TOKENS] * 4


#: Every field a bar line may show; a line is these, whole, two spaces apart.
FIELDS = [re.compile(p) for p in (r"\d+/\d+ documents", r"elapsed [\d:]+", r"━*─*", r"ETA (estimating|[\d:]+)",
                                   r"[\d.]+ tok/s", r"failed \d+", r"active \d+/\d+ workers", r"fallbacks \d+")]


def _drawn_lines(screen: io.StringIO) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()).replace("\r", "\n")
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def test_every_bar_line_fits_80_columns_with_whole_fields() -> None:
    """The bar was cut mid-word ("fall…"): a field that does not fit is left out whole, the counts and the
    elapsed time first."""
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=80, color_system=None)
    asked = threading.Event()

    def decoded() -> int:
        asked.set()
        return 43210

    with BatchProgress(console, 12345, 0, 16, {f"t{i}": 100 for i in range(12345)}, lambda: 16, decoded,
                       plain_interval_s=10) as progress:
        for i in range(1234):
            progress.record(f"t{i}", "failed", 60, 1)  # the longest details: failures and fallbacks
        assert asked.wait(30)  # a tick: the workers were asked for their tokens
    lines = _drawn_lines(screen)
    assert lines and lines[-1].startswith("1234/12345 documents  elapsed 0:0"), lines
    for line in lines:
        assert len(line) <= 80, line
        assert all(any(f.fullmatch(part) for f in FIELDS) for part in line.split("  ")), line
    assert "tok/s" in lines[-1] and "ETA" in lines[-1]


def test_the_eta_comes_from_the_measured_decode_rate_and_says_estimating_until_then() -> None:
    """Before the first token the ETA says `estimating`, and after it until a second sample gives a rate;
    then the tokens left at the rate measured between samples, not at tokens / (time since the start,
    prefill and start-up included), which said "ETA 1:07:02" for a batch that ended at 1:11."""
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    counts = iter([0, 0, 100, 200, 300])  # prefill (nothing decoded), then 100 tokens a sample
    samples: list[tuple[float, int]] = []
    lines_at: dict[int, str] = {}
    fourth = threading.Event()

    def decoded() -> int:
        value = next(counts, 300)
        if len(samples) in (1, 3):  # the bar as drawn before this sample: 0 tokens, then 1 sample of tokens
            lines_at[len(samples)] = _drawn_lines(screen)[-1]
        samples.append((time.monotonic(), value))
        if len(samples) == 4:
            fourth.set()
        return value

    progress = BatchProgress(console, 2, 0, 1, {"t0": 500, "t1": 500}, lambda: 1, decoded, plain_interval_s=10)
    with progress:
        assert fourth.wait(60)
    assert "ETA estimating" in lines_at[1] and "ETA estimating" in lines_at[3], lines_at
    first = next(s for s in samples if s[1] > 0)
    last = samples[-1]
    rate = (last[1] - first[1]) / (last[0] - first[0])
    assert progress.eta_s() == pytest.approx((1000 - last[1]) / rate, rel=0.01)
