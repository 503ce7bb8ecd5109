"""`kvbatch report` from a real small job with fallbacks, a failure, a restarting worker and a rejected row.

The same job shows the per-stage memory and latency columns of the result rows, the alerts that
end up in job.log, and the metrics that reach Ray's Prometheus endpoint.
"""

from __future__ import annotations

import base64
import html
import json
import shutil
import struct
import subprocess
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from runner.observe.joblog import read_log
from runner.observe.report_plots import PLOTS, fallback_path, throughput_over_time
from storage.export import results_table
from tests.helpers.cli import LICENSES, TINY_CONFIG, export_rows, kvbatch, refusal, write_jsonl

FAULTS = [
    {"doc": "cc0", "fault": "oom", "rungs": ["dynamic"]},  # one cache fallback: dynamic -> tiered-disk
    {"doc": "apache", "fault": "oom", "context_above": 512},  # every rung at 1024 tokens, then 512 fits
    {"doc": "artistic", "fault": "io"},  # fails at every context size
    {"doc": "memo", "fault": "crash", "attempts": [1, 2]},  # its worker dies twice
]


class _Page(HTMLParser):
    """The images and the text of every table cell of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str]] = []
        self.cells: list[str] = []
        self.external: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        if tag == "img":
            self.images.append(attributes)
        if tag in ("td", "th"):
            self._in_cell = True
            self.cells.append("")
        for key in ("src", "href"):
            if attributes.get(key, "").startswith(("http:", "https:", "//", "file:")):
                self.external.append(attributes[key])

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.cells[-1] += data


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def job(ray_address, tmp_path_factory) -> dict:
    """A job with failures, fallbacks and a crashing document, one task per worker at a time (a worker loss
    is then one document's, so the per-document restart alert names it)."""
    tmp = tmp_path_factory.mktemp("report")
    rows = [
        {"id": "bsd", "path": str(LICENSES / "BSD")},
        {"id": "cc0", "path": str(LICENSES / "CC0-1.0")},
        {"id": "apache", "path": str(LICENSES / "Apache-2.0")},
        {"id": "artistic", "path": str(LICENSES / "Artistic")},
        {"id": "memo", "text": "The board approved the budget on Monday; two engineers join in March."},
        {"id": "ghost", "path": "no-such-file.txt"},
    ]
    job_dir = tmp / "job"
    submit = kvbatch("submit", str(write_jsonl(tmp / "manifest.jsonl", rows)), "-c", str(TINY_CONFIG),
                     "-j", str(job_dir), "--address", ray_address, "--set", "batch.max_sequences=1",
                     env={"KVBATCH_FAULTS": json.dumps(FAULTS)},
                     check=3)
    report = kvbatch("report", str(job_dir), check=0)
    page = _Page()
    page.feed((job_dir / "report.html").read_text(encoding="utf-8"))
    return {"dir": job_dir, "submit": submit, "report": report, "page": page,
            "html": (job_dir / "report.html").read_text(encoding="utf-8"),
            "rows": {r["doc_id"]: r for r in export_rows(job_dir)}}


def test_the_report_embeds_every_plot_as_an_image(job):
    assert f"report -> {job['dir'] / 'report.html'}" in job["report"].stderr
    page = job["page"]
    assert [img["alt"] for img in page.images] == [title for title, _, _ in PLOTS]
    for img in page.images:
        prefix = "data:image/png;base64,"
        assert img["src"].startswith(prefix), img["alt"]
        width, height = png_size(base64.b64decode(img["src"][len(prefix):]))
        assert width >= 600 and height >= 150, (img["alt"], width, height)
    assert page.external == []  # self-contained: nothing to fetch


def test_a_report_written_to_stdout_is_the_page_alone(job):
    """`report -o /dev/stdout | ...`: the page goes into the pipe whole, the line saying where it went to
    stderr (it was printed into the page's stream)."""
    report = kvbatch("report", str(job["dir"]), "-o", "/dev/stdout", check=0)
    assert report.stdout.lstrip().lower().startswith("<!doctype html") and "report ->" not in report.stdout
    assert report.stdout.rstrip().endswith("</html>")
    assert "report -> /dev/stdout" in report.stderr


def test_the_report_tables_name_failures_fallbacks_and_alerts(job):
    cells = job["page"].cells
    assert "artistic" in cells and "OSError" in cells  # the failed document
    assert "ghost" in cells and "rejected" in cells  # the rejected row
    assert "dynamic → tiered-disk" in cells  # cc0's ladder
    assert "dynamic → tiered-disk → ctx 512 → dynamic" in cells  # apache's
    assert "worker_restarts" in cells and "repeated_fallbacks" in cells
    assert any(c.startswith("6: done 4, failed 1, rejected 1") for c in cells), cells


def test_the_report_lists_every_document_with_its_summary(job):
    cells = job["page"].cells
    start = cells.index("summary (or error)") + 1  # the Documents table, after its header row
    listed = [cells[i:i + 5] for i in range(start, start + 5 * len(job["rows"]), 5)]
    assert [row[0] for row in listed] == ["bsd", "cc0", "apache", "artistic", "memo", "ghost"]  # manifest order
    for doc, status, _, _, text in listed:
        row = job["rows"][doc]
        assert status == row["status"] and text == (row["summary"] if status == "done" else row["error"]), doc
        assert text


def test_a_cpu_job_has_no_device_columns_and_no_empty_header_row(job):
    assert "median peak device MiB" not in job["page"].cells and "median peak host RSS MiB" in job["page"].cells
    assert "<th></th>" not in job["html"]


def test_throughput_comes_from_tokens_as_they_were_decoded(job):
    samples = [e for e in read_log(job["dir"] / "job.log") if e["event"] == "progress"]
    assert samples and samples[-1]["decode_tokens"] > 0
    assert throughput_over_time([], samples) is not None  # a plot before any document has ended


#: Which axes of each plot hold a quantity (the others name categories): those start at zero.
QUANTITY_AXES = {"Time against document length": "xy", "Peak memory against document length": "xy",
                 "Memory by stage": "y", "Fallback ladder": "x", "Throughput over time": "xy", "Latency split": "x"}


def test_every_plot_starts_its_quantities_at_zero(job):
    rows = results_table(job["dir"], errors_only=False).to_pylist()  # what the report draws from
    samples = [e for e in read_log(job["dir"] / "job.log") if e["event"] == "progress"]
    assert set(QUANTITY_AXES) == {title for title, _, _ in PLOTS}
    for title, _, plot in PLOTS:
        fig = plot(rows, samples)
        assert fig is not None, title
        for ax in fig.axes:
            lows = {"x": ax.get_xlim()[0], "y": ax.get_ylim()[0]}
            assert all(lows[axis] == 0 for axis in QUANTITY_AXES[title]), (title, lows)


def test_rows_carry_memory_per_stage_and_the_latency_split(job):
    done = [r for r in job["rows"].values() if r["status"] == "done"]
    assert {r["doc_id"] for r in done} == {"bsd", "cc0", "apache", "memo"}
    # memo's one pass was lost with each crash (it strikes before the pass leaves its worker): the third
    # attempt ran it, and the row's timings are of that run
    memo = job["rows"]["memo"]
    assert memo["attempts"] == 3 and memo["passes"] == 1 and memo["passes_reused"] == 0
    for r in done:
        assert r["queue_wait_s"] >= 0 and r["prefill_s"] > 0 and r["decode_s"] > 0
        assert r["prefill_s"] >= r["ttft_s"]
        if r["chunks"] == 1:  # a map-reduced document's passes may run side by side: their times overlap
            assert r["prefill_s"] + r["decode_s"] <= r["wall_s"]
        assert r["load_host_rss_bytes"] > 0
        assert r["prefill_host_rss_bytes"] >= r["load_host_rss_bytes"] * 0.5
        assert r["decode_peak_host_rss_bytes"] > 0 and r["peak_host_rss_bytes"] >= r["decode_peak_host_rss_bytes"]
        for key in ("load_device_bytes", "prefill_device_bytes", "decode_peak_device_bytes", "peak_device_bytes"):
            assert r[key] is None  # a CPU device has no separate device memory
    # map-reduce over chunks means several prefill passes: their time adds up
    assert job["rows"]["apache"]["chunks"] > 1 and job["rows"]["apache"]["prefill_s"] > job["rows"]["apache"]["ttft_s"]


def test_alerts_for_a_restarting_worker_and_repeated_fallbacks(job):
    alerts = [e for e in read_log(job["dir"] / "job.log") if e["event"] == "alert"]
    # memo's task moves to whichever worker is free after each crash: the document is what repeats
    [restarts] = [a for a in alerts if a["kind"] == "worker_restarts" and "took down" in a["message"]]
    assert restarts["restarts"] == 2 and restarts["reason"] == "WorkerDied" and restarts["doc_id"] == "memo"
    fell_back = {a["doc_id"]: a for a in alerts if a["kind"] == "repeated_fallbacks"}
    assert set(fell_back) == {"apache", "artistic"}  # cc0 fell back once: no alert
    assert "alert (worker_restarts): document 'memo' took down a worker 2 times" in job["submit"].stdout


def test_metrics_reach_the_ray_prometheus_endpoint(job):
    import ray

    job_id = json.loads((job["dir"] / "job.json").read_text())["job_id"]
    [node] = [n for n in ray.nodes() if n["Alive"]]
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    wanted = ("ray_kvbatch_tasks_total", "ray_kvbatch_fallbacks_total", "ray_kvbatch_worker_restarts_total",
              "ray_kvbatch_tokens_total", "ray_kvbatch_kv_offload_bytes_total")
    deadline = time.monotonic() + 30
    while True:
        lines = [line for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines()
                 if f'job_id="{job_id}"' in line]
        if all(any(line.startswith(name) for line in lines) for name in wanted) or time.monotonic() > deadline:
            break
        time.sleep(1)
    series = {line.split("{")[0] + ("/failed" if 'status="failed"' in line else ""): float(line.rsplit(" ", 1)[1])
              for line in lines if 'kind="cache"' not in line and 'kind="context"' not in line}
    assert series.get("ray_kvbatch_tasks_total/failed") == 1.0, lines
    assert series.get("ray_kvbatch_worker_restarts_total") == 2.0, lines
    fallbacks = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("ray_kvbatch_fallbacks_total"))
    assert fallbacks == sum(len(r["fallbacks"] or []) for r in job["rows"].values())


#: Appended to a copy of the report: once the page has loaded, what the browser laid out, as JSON in the DOM.
_WHAT_IT_SHOWS = """
<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(img => {
    const box = img.getBoundingClientRect();
    return {alt: img.alt, complete: img.complete, natural: [img.naturalWidth, img.naturalHeight],
            shown: [Math.round(box.width), Math.round(box.height)]};
  });
  const out = document.createElement("pre");
  out.id = "what-it-shows";
  out.textContent = JSON.stringify({title: document.title, text: document.body.innerText, images,
                                    width: document.documentElement.scrollWidth, viewport: window.innerWidth});
  document.body.appendChild(out);
});
</script>
"""


def chromium_shows(page: Path, tmp_path: Path) -> dict:
    """What real headless chromium lays out for `page`: its title, visible text and images."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed to check the report in a real browser: apt-get install chromium (.ci/run does)"
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _WHAT_IT_SHOWS + "</body>"), encoding="utf-8")
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1200,900", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    marker = '<pre id="what-it-shows">'
    assert marker in proc.stdout, f"the page's load handler never ran; chromium said:\n{proc.stderr[-2000:]}"
    return json.loads(html.unescape(proc.stdout.split(marker, 1)[1].split("</pre>", 1)[0]))


def test_the_report_renders_in_headless_chromium(job, tmp_path):
    shown = chromium_shows(job["dir"] / "report.html", tmp_path)
    job_id = json.loads((job["dir"] / "job.json").read_text())["job_id"]
    assert shown["title"] == f"kvbatch report {job_id}"
    assert [img["alt"] for img in shown["images"]] == [title for title, _, _ in PLOTS]
    for img in shown["images"]:  # every plot decoded and laid out at a readable size
        assert img["complete"] and img["natural"][0] >= 600 and img["natural"][1] >= 150, img
        assert img["shown"][0] >= 600 and img["shown"][1] >= 150, img
    text = shown["text"]
    for visible in (f"kvbatch job {job_id}", "6: done 4, failed 1, rejected 1", "artistic", "OSError", "ghost",
                    "dynamic → tiered-disk → ctx 512 → dynamic", "worker_restarts"):
        assert visible in text, visible
    for row in job["rows"].values():  # every summary is on the page, whole
        assert row["status"] != "done" or " ".join(row["summary"].split()) in " ".join(text.split()), row["doc_id"]
    assert shown["width"] <= shown["viewport"], "the page scrolls sideways"


def test_a_job_with_nothing_run_still_gets_a_report(tmp_path):
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "ghost", "path": "missing.txt"}])
    job_dir = tmp_path / "job"
    kvbatch("submit", str(manifest), "-c", str(TINY_CONFIG), "-j", str(job_dir), check=3)  # every row rejected
    kvbatch("report", str(job_dir), "-o", str(tmp_path / "r.html"), check=0)
    page = _Page()
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    page.feed(text)
    assert page.images == [] and text.count("nothing to plot yet") == len(PLOTS)
    assert "ghost" in page.cells


def test_report_of_a_missing_job_is_a_usage_error(tmp_path):
    proc = refusal("report", str(tmp_path / "nope"))
    message = " ".join(proc.stderr.split())  # the console wraps long lines
    assert f"{tmp_path / 'nope'} is not a job folder" in message and "Traceback" not in message


def test_fallback_paths_read_as_a_ladder():
    notes = ["cache:dynamic->tiered-disk (OutOfMemoryError)", "cache:tiered-disk->exhausted (OutOfMemoryError)",
             "context:1024->512 (OutOfMemoryError)"]
    assert fallback_path({"fallbacks": notes, "cache_strategy": "dynamic"}) == "dynamic → tiered-disk → ctx 512 → dynamic"
    assert fallback_path({"fallbacks": notes[2:], "cache_strategy": None}) == "ctx 512"
    assert fallback_path({"fallbacks": [], "cache_strategy": "tiered-host"}) == "tiered-host"
