"""`kvbatch report`: one self-contained HTML page about a job (plots embedded as data URIs).

Like `status` it reads the job folder only, so it works on a finished or running job or a copied folder,
and the page has no external references: it can be mailed as is.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.markup import escape

from runner.observe.joblog import read_log
from runner.observe.progress import format_duration
from runner.observe.report_plots import MIB, PLOTS, by_strategy, fallback_path, figure_png, on_a_device
from runner.observe.status import JobStatus, job_status
from storage.export import results_table
from storage.jobdir import JobDir, JobInfo, read_job
from storage.location import Location, StorageError, Where
from storage.output import output_error, write_output

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: .9em; }
img { max-width: 100%; border: 1px solid #eee; }
.none { color: #888; font-style: italic; }
"""


#: The Documents table's search box: shows the rows holding every word typed (no page outside this file).
_FIND = """<script>
document.getElementById("find").addEventListener("input", event => {
  const words = event.target.value.toLowerCase().split(/\\s+/).filter(Boolean);
  for (const row of document.querySelectorAll("#documents tr:not(:first-child)")) {
    const text = row.textContent.toLowerCase();
    row.hidden = !words.every(word => text.includes(word));
  }
});
</script>"""


def _cell(value: Any) -> str:
    if value is None:
        return "<td></td>"
    if isinstance(value, float):
        return f'<td class="num">{value:,.3g}</td>' if abs(value) < 1000 else f'<td class="num">{value:,.0f}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value:,}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def _table(headers: list[str] | None, rows: Iterable[list[Any]], empty: str, table_id: str = "") -> str:
    """A table of `rows` under `headers` (None: no header row, e.g. for name/value pairs)."""
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="none">{html.escape(empty)}</p>'
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>" if headers else ""
    id_attribute = f' id="{table_id}"' if table_id else ""
    return f"<table{id_attribute}>{head}{body}</table>"


def _strategy_rows(rows: list[dict[str, Any]], device: bool) -> list[list[Any]]:
    def median(rs: list[dict[str, Any]], key: str, scale: float = 1) -> float | None:
        present = [r[key] / scale for r in rs if r[key] is not None]
        return statistics.median(present) if present else None

    return [[strategy, len(rs), median(rs, "wall_s"), median(rs, "ttft_s"), median(rs, "decode_tokens_per_s"),
             median(rs, "peak_host_rss_bytes", MIB), *([median(rs, "peak_device_bytes", MIB)] if device else []),
             sum(r["offload_bytes_written"] or 0 for r in rs) / MIB]
            for strategy, rs in by_strategy(rows).items()]


def _figure(title: str, question: str, fig: Figure | None) -> str:
    if fig is None:
        return f'<h3>{html.escape(title)}</h3><p class="none">nothing to plot yet for this job</p>'
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return (f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(title)}: {html.escape(question)}</figcaption></figure>")


def _summary_rows(info: JobInfo, status: JobStatus, alerts: int) -> list[list[Any]]:
    """The Summary table: the job, its config's main keys, and `status`'s figures (the same as the CLI's)."""
    c = status["counts"]
    cfg = info.config
    batch = status["batch"]
    return [
        ["job id", info.job_id], ["job folder", status["job_dir"]],
        ["created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created))],
        ["state", f"running ({status['coordinator']})" if status["coordinator"] else "not running"],
        ["model", cfg["model"]["name"]], ["cache strategy (config)", cfg["cache"]["strategy"]],
        ["context tokens", cfg["summarize"]["context_tokens"]],
        ["documents", (f"{status['total']}: done {c['done']}, failed {c['failed']}, rejected {c['rejected']}, "
                       f"running {c['running']}, pending {c['pending']}")],
        ["latest run", (f"{format_duration(status['run_elapsed_s'])}, "
                        f"{status['throughput_docs_per_s'] * 60:.2f} docs/min, {status['tokens_per_s']:.1f} tok/s")],
        ["fallbacks", f"{status['fallbacks']['total']} in {status['fallbacks']['tasks']} task(s)"],
        ["batch occupancy", "n/a" if batch["mean_sequences"] is None else
         f"{batch['mean_sequences']:.1f} sequences per decode step, {batch['padding_share']:.0%} padding"],
        ["alerts", alerts],
    ]


def render_report(job_dir: Where) -> str:
    """The HTML page of a job, as a string."""
    job = JobDir(job_dir)
    info = read_job(job)
    status = job_status(job_dir, slowest=10)
    rows = results_table(job_dir, errors_only=False).to_pylist()
    events = read_log(job.log)
    alerts = [e for e in events if e.get("event") == "alert"]
    samples = [e for e in events if e.get("event") == "progress"]
    device = on_a_device(rows)
    failures = [[r["doc_id"], r["status"], r["error_type"], r["error"], r["attempts"],
                 "; ".join(r["fallbacks"] or [])] for r in rows if r["status"] != "done"]
    fell_back = [[r["doc_id"], r["status"], fallback_path(r), r["context_tokens"]]
                 for r in rows if r["fallbacks"]]
    slowest = [[r["doc_id"], r["wall_s"], r["input_tokens"], r["cache_strategy"]] for r in status["slowest"]]
    alert_rows = [[time.strftime("%H:%M:%S", time.localtime(a["ts"])), a.get("kind"), a.get("message")]
                  for a in alerts]
    documents = [[r["doc_id"], r["status"], r["input_tokens"], r["output_tokens"],
                  r["summary"] if r["status"] == "done" else r["error"]] for r in rows]
    sections = [
        f"<h1>kvbatch job {html.escape(info.job_id)}</h1>",
        "<h2>Summary</h2>", _table(None, _summary_rows(info, status, len(alerts)), ""),
        "<h2>Documents</h2>",
        '<p><input id="find" type="search" placeholder="find in documents and summaries" size="40"></p>',
        _table(["document", "status", "input tokens", "output tokens", "summary (or error)"], documents,
               "no document has ended yet", "documents"),
        "<h2>Plots</h2>", *(_figure(title, question, plot(rows, samples)) for title, question, plot in PLOTS),
        "<h2>Per cache strategy</h2>",
        _table(["strategy", "documents", "median wall s", "median TTFT s", "median decode tok/s",
                "median peak host RSS MiB", *(["median peak device MiB"] if device else []), "offload written MiB"],
               _strategy_rows(rows, device), "no finished documents yet"),
        "<h2>Failures</h2>",
        _table(["document", "status", "error type", "error", "attempts", "fallbacks"], failures,
               "no failed or rejected documents"),
        "<h2>Fallbacks</h2>",
        _table(["document", "status", "ladder", "final context tokens"], fell_back, "no task fell back"),
        "<h2>Slowest documents</h2>",
        _table(["document", "wall s", "input tokens", "cache strategy"], slowest, "no finished documents yet"),
        "<h2>Alerts</h2>", _table(["time", "kind", "message"], alert_rows, "no alerts"),
        "<h2>Config</h2>", f"<pre>{html.escape(json.dumps(info.config, indent=2))}</pre>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>kvbatch report {html.escape(info.job_id)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(sections)}<p class=\"none\">generated {time.ctime()}</p>{_FIND}</body></html>\n"
    )


def write_report(job_dir: Where, output: Path | None, console: Console) -> int:
    """Writes the page (default JOB_DIR/report.html) and says where it is; exit code 0."""
    page = render_report(job_dir).encode("utf-8")
    if output is not None:
        out: Path | Location = output
        write_output(output, lambda handle: handle.write(page))
    else:
        out = JobDir(job_dir).path / "report.html"
        try:
            out.write_bytes_atomic(page)
        except StorageError:
            raise
        except OSError as e:
            raise output_error(out, e) from None
    console.print(f"report -> {escape(str(out))}  (open it in a browser; it is one self-contained file)", highlight=False, soft_wrap=True)
    return 0
