"""Summarise documents from Python with kvbatch: a batch, then its rows in the order the documents were given.

    .venv/bin/python examples/summarise.py                      # the builtin SmolLM2, a private local Ray
    .venv/bin/python examples/summarise.py -c configs/tiny.yaml # seconds: a tiny random model (gibberish)

The job folder is runs/python-example-<time>; `kvbatch status` and `kvbatch report` read it as they read
any job's, and after Ctrl-C `kvbatch.resume(job_dir)` (or `kvbatch resume`) runs only what is not done.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvbatch

LICENSES = Path("/usr/share/common-licenses")
DOCUMENTS = [
    {"id": "memo", "text": "The board approved the new budget on Monday. Spending on research rises by ten "
                           "percent, and two engineers join the data team in March.", "team": "finance"},
    {"id": "bsd", "path": str(LICENSES / "BSD"), "team": "legal"},
    {"id": "apache", "path": str(LICENSES / "Apache-2.0"), "team": "legal", "max_new_tokens": 48},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", help="YAML config (default: configs/default.yaml's defaults)")
    parser.add_argument("--address", help="a Ray cluster to join (default: a private local one)")
    parser.add_argument("-j", "--job-dir", default=f"runs/python-example-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()

    job = kvbatch.submit(DOCUMENTS, job_dir=args.job_dir, config=args.config, address=args.address,
                         settings={"summarize.max_new_tokens": 48})
    if not job.finished:  # interrupted, or no worker left: the job folder keeps what was done
        raise SystemExit(f"stopped early (exit {job.exit_code}): kvbatch.resume({job.job_dir!r}) continues it")
    for row in kvbatch.results(job.job_dir):  # in DOCUMENTS' order, whatever order they finished in
        print(f"{row['doc_id']} [{row['team']}] {row['status']}, {row['output_tokens']} tokens: {row['summary']}")


if __name__ == "__main__":
    main()
