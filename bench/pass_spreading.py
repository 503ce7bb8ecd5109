"""Long + short documents on two workers: a long document's passes spread across them, against today.

A batch of one long real document (GPL-3: a dozen chunks and their merges) and a few short ones
(single passes) on two workers. Without spreading (`batch.spread_passes=false`, what kvbatch did
before) the long document runs on one worker while the other finishes the short ones and then sits
idle; with it, the idle worker helps: it runs the long document's passes from the far end, and the
owner takes each pass the helper kept unrun. Both modes run on one shared local Ray, alternating
(`--rounds` of each), so a machine getting busier or quieter shows as a spread, not as a gain. The
table gives each mode's batch phase (last worker ready -> batch end, from job.log), the ratio of the
means, how many passes of the long document the helper ran and how many the owner took unrun, and
whether the summaries are the same as today's (they must be, token for token).

Run: python bench/pass_spreading.py [--model builtin:smollm2-135m] [--rounds 2] [--max-sequences auto]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import LICENSES, REPO, JobRun, local_ray, submit, write_manifest

LONG = "GPL-3"
SHORT = ["BSD", "CC0-1.0", "Artistic", "LGPL-3", "Apache-2.0", "MPL-2.0"]
SHORT_CHARS = 1500  # the opening of each: one pass at the context


def _manifest(folder: Path) -> Path:
    documents = [{"id": LONG.lower(), "text": (LICENSES / LONG).read_text()}]
    documents += [{"id": name.lower(), "text": (LICENSES / name).read_text()[:SHORT_CHARS]} for name in SHORT]
    return write_manifest(folder / "mix.jsonl", documents)


def _run(manifest: Path, job: Path, model: str, spread: bool, address: str, sequences: str) -> JobRun:
    settings = [f"model.name={model}", "workers.count=2", "workers.cpus_per_worker=1", "summarize.max_new_tokens=64",
                "summarize.context_tokens=1024", f"batch.max_sequences={sequences}",
                f"batch.spread_passes={str(spread).lower()}"]
    return submit(manifest, REPO / "configs" / "default.yaml", job, settings, address)


def _shared(run: JobRun) -> tuple[int, int]:
    """Passes of the long document the helper ran, and how many of them the owner took unrun."""
    helped = sum(e["passes_run"] for e in run.log if e.get("event") == "passes_shared")
    long_row = next(r for r in run.rows if r["doc_id"] == LONG.lower())
    return helped, long_row["passes_reused"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--max-sequences", default="auto", help="batch.max_sequences of both workers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvbench-spread-") as tmp, local_ray(cpus=2) as address:
        folder = Path(tmp)
        manifest = _manifest(folder)
        runs: dict[bool, list[JobRun]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for spread in (False, True):
                job = folder / f"{'spread' if spread else 'today'}-{round_}"
                runs[spread].append(_run(manifest, job, args.model, spread, address, args.max_sequences))
    today, spread = runs[False], runs[True]
    long_row = next(r for r in today[0].rows if r["doc_id"] == LONG.lower())
    same = all(run.summaries == today[0].summaries for run in today + spread)
    mean = {mode: statistics.mean(run.batch_s for run in mode_runs) for mode, mode_runs in runs.items()}
    print(f"{args.model}, 2 workers, batch.max_sequences={args.max_sequences}: {LONG} ({long_row['chunks']} chunks, {long_row['passes']} passes) "
          f"+ {len(SHORT)} short documents; {args.rounds} runs of each mode, alternating")
    print()
    print("| mode | batch phase s (each run) | mean s | long doc's passes: run by the helper / taken unrun |")
    print("|---|---|---|---|")
    for label, mode_runs in (("today (spread_passes=false)", today), ("spread_passes=true", spread)):
        shares = [_shared(run) for run in mode_runs]
        print(f"| {label} | {', '.join(f'{run.batch_s:.1f}' for run in mode_runs)} | {mean[mode_runs is spread]:.1f} "
              f"| {', '.join(f'{h} / {r}' for h, r in shares)} |")
    print()
    print(f"wall time ratio today / spread: {mean[False] / mean[True]:.2f}x; "
          f"summaries identical to today's: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit("spreading changed a summary")


if __name__ == "__main__":
    main()
