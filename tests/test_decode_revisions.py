"""bench/decode_revisions.py: an old revision (an option, `--revision`) really runs beside this tree, and
the figures it prints are the ones its sides measured, with every side's tokens compared; without one,
this tree's two attention paths alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import REPO

BEFORE = "88824c8"


def _has_revision(revision: str) -> bool:
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{revision}^{{commit}}"], capture_output=True)
    return found.returncode == 0


@pytest.mark.slow
def test_the_old_revision_and_both_attention_paths_decode_the_same_tokens_side_by_side() -> None:
    assert _has_revision(BEFORE), f"{BEFORE} is not in this clone's history: the bench cannot check it out"
    worktrees_before = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True,
                                      text=True, check=True).stdout
    bench = subprocess.run([sys.executable, str(REPO / "bench" / "decode_revisions.py"), "--shapes", "40x2,mixed:20-60x3",
                            "--steps", "3", "--rounds", "2", "--threads", "1", "--revision", BEFORE, "--json"],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    results = json.loads(bench.stdout.strip().splitlines()[-1])
    assert [r["shape"] for r in results] == ["40x2", "mixed:20-60x3"]
    assert results[1]["prompt_tokens"] == [20, 40, 60]
    for result in results:
        assert [s["side"] for s in result["sides"]] == [BEFORE, "now per-row", "now pooled"]
        for side in result["sides"]:
            assert side["same_tokens"] == result["rows"], side
            assert len(side["tok_s_rounds"]) == 2 and all(rate > 0 for rate in side["tok_s_rounds"])
        assert result["sides"][0]["x_before_rounds"] == [1.0, 1.0]  # the old side against itself
    assert f"{BEFORE} ready" in bench.stdout and "pick per row" in bench.stdout  # the old tree's own token choice ran
    assert "choose_tokens" in bench.stdout
    after = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True, check=True).stdout
    assert after == worktrees_before, "the bench left its checkout of the old revision behind"


@pytest.mark.slow
def test_without_a_revision_this_trees_two_paths_run_side_by_side() -> None:
    bench = subprocess.run([sys.executable, str(REPO / "bench" / "decode_revisions.py"), "--shapes", "40x2",
                            "--steps", "2", "--rounds", "1", "--threads", "1", "--json"],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    (result,) = json.loads(bench.stdout.strip().splitlines()[-1])
    assert [s["side"] for s in result["sides"]] == ["now per-row", "now pooled"]
    assert all(side["same_tokens"] == result["rows"] for side in result["sides"])
