"""The report's plots, each a matplotlib Figure drawn from a job's result rows and its job.log `progress` lines,
or None when the job has nothing to draw for it. Quantities start their axes at zero, so a bar or a point
reads against nothing, not against the smallest value."""

from __future__ import annotations

import io
import statistics
from collections import Counter
from typing import Any

import matplotlib

matplotlib.use("Agg")
# labels come from user data (doc ids, strategies): a `$` in one must be drawn, not parsed as mathtext
matplotlib.rcParams["text.parse_math"] = False
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.figure import Figure  # noqa: E402

from jobs.fallback import Fallback, FallbackKind

Row = dict[str, Any]
Sample = dict[str, Any]  # a job.log `progress` line: ts, done, total, decode_tokens, elapsed_s
MIB = 2**20
_MARKERS = "osD^vP*X"


def figure_png(fig: Figure) -> bytes:
    """The figure as a PNG, and closed."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def on_a_device(rows: list[Row]) -> bool:
    """Whether the job ran on an accelerator (a CPU job's "device" memory is its host RAM: no columns of it)."""
    return any(r.get("peak_device_bytes") is not None for r in rows)


def by_strategy(rows: list[Row], *keys: str) -> dict[str, list[Row]]:
    """The done rows that have every one of `keys`, by cache strategy (sorted)."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r["status"] == "done" and all(r.get(k) is not None for k in keys):
            groups.setdefault(r["cache_strategy"] or "unknown", []).append(r)
    return dict(sorted(groups.items()))


def _scatter(ax: Any, groups: dict[str, list[Row]], y_key: str, scale: float, ylabel: str) -> None:
    for i, (strategy, rs) in enumerate(groups.items()):
        ax.scatter([r["input_tokens"] for r in rs], [r[y_key] / scale for r in rs], label=strategy,
                   marker=_MARKERS[i % len(_MARKERS)], s=36, alpha=0.8)
    ax.set_xlabel("document length (input tokens)")
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.grid(alpha=0.3)
    ax.legend(title="cache strategy", fontsize=8)


def time_vs_length(rows: list[Row], samples: list[Sample]) -> Figure | None:
    groups = by_strategy(rows, "input_tokens", "wall_s")
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _scatter(ax, groups, "wall_s", 1.0, "task wall time (s)")
    ax.set_title("Time per document against its length, per cache strategy")
    return fig


def memory_vs_length(rows: list[Row], samples: list[Sample]) -> Figure | None:
    device = [("peak_device_bytes", "peak device memory (MiB)"),
              ("kv_resident_peak_bytes", "KV cache resident on the device, peak (MiB)")] if on_a_device(rows) else []
    panels = [(key, label) for key, label in [("peak_host_rss_bytes", "peak host RSS of the worker (MiB)"), *device]
              if by_strategy(rows, "input_tokens", key)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(max(8, 5 * len(panels)), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        _scatter(ax, by_strategy(rows, "input_tokens", key), key, MIB, label)
        ax.set_title(label.split(" (")[0], fontsize=10)
    fig.suptitle("Peak memory against document length, per cache strategy")
    return fig


def fallback_path(row: Row) -> str:
    """The ladder a task climbed, e.g. "dynamic → tiered-disk → ctx 512 → dynamic"."""
    steps: list[str] = []
    for move in map(Fallback.parse, row.get("fallbacks") or []):
        if move.kind is FallbackKind.CONTEXT:
            steps.append(f"ctx {move.target}")
            continue
        if not steps or steps[-1] != move.source:
            steps.append(move.source)
        if move.target is not None:
            steps.append(move.target)
    final = row.get("cache_strategy")
    if final and (not steps or steps[-1] != final):
        steps.append(final)
    return " → ".join(steps) if steps else "(no strategy recorded)"


def fallback_ladder(rows: list[Row], samples: list[Sample]) -> Figure | None:
    tasks = [r for r in rows if r["status"] in ("done", "failed")]
    if not tasks:
        return None
    paths = Counter((fallback_path(r), r["status"]) for r in tasks)
    labels = sorted({p for p, _ in paths}, key=lambda p: (p.count("→"), p))
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(labels)))
    left = [0] * len(labels)
    for status, color in (("done", "tab:green"), ("failed", "tab:red")):
        counts = [paths.get((p, status), 0) for p in labels]
        if any(counts):
            ax.barh(labels, counts, left=left, color=color, label=status)
            left = [a + b for a, b in zip(left, counts)]
    ax.set_xlabel("tasks")
    ax.set_title("Fallback ladder: first rung → ... → where each task ended")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlim(left=0)
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _rates(samples: list[Sample]) -> list[tuple[float, float, float]]:
    """(start ts, end ts, decode tokens/s) between consecutive samples of one run (a run counts from zero)."""
    rates = []
    for before, after in zip(samples, samples[1:]):
        seconds = after["elapsed_s"] - before["elapsed_s"]
        if seconds > 0 and after["decode_tokens"] >= before["decode_tokens"]:  # else: a new run began
            rates.append((before["ts"], after["ts"], (after["decode_tokens"] - before["decode_tokens"]) / seconds))
    return rates


def throughput_over_time(rows: list[Row], samples: list[Sample]) -> Figure | None:
    """Decode tokens/s as the workers made them (job.log's progress lines), and documents as they ended."""
    rates = _rates(samples)
    ended = sorted(r["finished_at"] for r in rows if r["status"] in ("done", "failed") and r.get("finished_at"))
    if not rates and not ended:
        return None
    run_starts = [s["ts"] - s["elapsed_s"] for s in samples]
    task_starts = [r["finished_at"] - (r.get("wall_s") or 0) for r in rows
                   if r["status"] in ("done", "failed") and r.get("finished_at")]
    start = min(run_starts + task_starts)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if rates:
        ax.bar([a - start for a, _, _ in rates], [rate for _, _, rate in rates], width=[b - a for a, b, _ in rates],
               align="edge", color="tab:blue", alpha=0.35, label="decode tokens/s")
    ax.set_xlabel("time since the first task started (s)")
    ax.set_ylabel("decode tokens/s", color="tab:blue")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if ended:
        docs = ax.twinx()
        docs.step([t - start for t in ended], range(1, len(ended) + 1), where="post", color="tab:orange")
        docs.set_ylabel("documents finished (cumulative)", color="tab:orange")
        docs.set_ylim(0, len(ended) * 1.05)
    ax.set_title("Throughput over time")
    ax.grid(alpha=0.3)
    return fig


def latency_split(rows: list[Row], samples: list[Sample], limit: int = 15) -> Figure | None:
    done = [r for r in rows if r["status"] == "done" and r.get("wall_s") is not None]
    if not done:
        return None
    slowest = sorted(done, key=lambda r: (r.get("queue_wait_s") or 0) + r["wall_s"], reverse=True)[:limit][::-1]
    parts = {
        "queue wait": [r.get("queue_wait_s") or 0 for r in slowest],
        "prefill (incl. first token)": [r.get("prefill_s") or 0 for r in slowest],
        "decode": [r.get("decode_s") or 0 for r in slowest],
        "other (tokenise, cache setup, failed rungs)": [
            max(r["wall_s"] - (r.get("prefill_s") or 0) - (r.get("decode_s") or 0), 0) for r in slowest
        ],
    }
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.4 * len(slowest)))
    left = [0.0] * len(slowest)
    labels = [r["doc_id"] for r in slowest]
    for (name, values), color in zip(parts.items(), ("tab:gray", "tab:purple", "tab:cyan", "tab:olive")):
        ax.barh(labels, values, left=left, label=name, color=color)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("seconds")
    ax.set_xlim(left=0)
    ax.set_title(f"Where the time went: the {len(slowest)} slowest documents")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


def memory_by_stage(rows: list[Row], samples: list[Sample]) -> Figure | None:
    stages = [("after model load", "load"), ("after prefill", "prefill"), ("decode peak", "decode_peak")]
    device = [("device", "device memory (MiB)")] if on_a_device(rows) else []
    places = [("host_rss", "worker host RSS (MiB)"), *device]
    panels = [(place, label) for place, label in places if by_strategy(rows, f"{stages[0][1]}_{place}_bytes")]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(max(8, 6 * len(panels)), 4.5), squeeze=False)
    for ax, (place, label) in zip(axes[0], panels):
        groups = by_strategy(rows, f"load_{place}_bytes")
        width = 0.8 / len(stages)
        for j, (stage_label, stage) in enumerate(stages):
            key = f"{stage}_{place}_bytes"
            medians = [statistics.median([r[key] for r in rs if r.get(key) is not None] or [0]) / MIB
                       for rs in groups.values()]
            ax.bar([i + (j - 1) * width for i in range(len(groups))], medians, width=width, label=stage_label)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_xlabel("cache strategy")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.suptitle("Memory at each stage of a task (median per cache strategy)")
    return fig


#: (title, what it answers, function), in the order the report shows them.
PLOTS = [
    ("Time against document length", "Which strategy is slow for which documents?", time_vs_length),
    ("Peak memory against document length", "What does a longer document cost in memory?", memory_vs_length),
    ("Memory by stage", "Is memory going to the model, the prompt, or decoding?", memory_by_stage),
    ("Fallback ladder", "How often did tasks fall back, and how far?", fallback_ladder),
    ("Throughput over time", "Did the batch keep its pace? (tokens as they were decoded)", throughput_over_time),
    ("Latency split", "Queue, prefill or decode: where did the slowest documents spend their time?", latency_split),
]
