"""Settings no worker could run with are refused at submit: exit 2, one line naming the key, no job
folder and no worker started; the cluster's nodes decide what fits, before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.config import ConfigError, load_config
from tests.helpers.cli import REPO, TINY_CONFIG, kvbatch, refusal, write_jsonl


def _manifest(tmp_path: Path) -> Path:
    """Three documents: as many workers as `workers.count=3` asks for would start."""
    return write_jsonl(tmp_path / "m.jsonl", [{"id": d, "text": f"A short note about meeting {d}."} for d in "abc"])


def _foreign_root(tmp_path: Path) -> Path:
    root = tmp_path / "someone-elses"
    root.mkdir()
    (root / "notes.txt").write_text("not kvbatch's")
    return root


# (what is set, text the one line must hold); "{tmp}" is the test's folder
BAD_SETTINGS = [
    (["--set", "cache.strategy=offloaded"], "cache.strategy=offloaded"),
    (["--set", "summarize.max_new_tokens=9000"], "summarize.max_new_tokens (9000)"),
    (["--set", "model.device=cuda"], "model.device=cuda"),
    (["--set", "model.name=no-such-org/no-such-model"], "model.name"),
    (["--set", "model.name=./no/such/folder"], "model.name"),
    (["--set", "cache.offload_root={tmp}/someone-elses"], "cache.offload_root"),
    (["--set", "workers.cpus_per_worker=4"], "workers.cpus_per_worker=4: no node of the Ray cluster has 4 CPUs"),
    (["--set", "workers.count=3"], "workers.count=3"),
    (["--set", "cache.ladder=[tiered-host]"], "cache.ladder ['tiered-host']"),
    # token ids past the vocabulary failed every document inside the logits processors
    (["--set", "summarize.generation.forced_eos_token_id=1000000"], "forced_eos_token_id: 1000000 is not a token id"),
    (["--set", "summarize.generation.bad_words_ids=[[5],[49152]]"], "bad_words_ids: 49152 is not a token id"),
    (["--set", "summarize.generation.suppress_tokens=[-1]"], "suppress_tokens: -1 is not a token id"),
    # no two partial summaries merge at the smallest context: every long document ran all its chunk passes,
    # then failed with ContextTooSmallError (exit 3)
    (["--set", "summarize.context_tokens=256", "--set", "summarize.min_context_tokens=256", "--set",
      "summarize.max_new_tokens=64", "--set", "summarize.chunk_overlap_tokens=16"],
     "summarize.min_context_tokens (256) cannot hold a merge pass"),
]


def _actors() -> set[str]:
    """Every actor the session's Ray cluster has ever had (a worker is one), dead ones included."""
    from ray._private import state

    return set(state.actors())


def _refused(tmp_path: Path, ray_address: str, *args: str) -> str:
    """Submits with `args`; asserts exit 2, one line on stderr, no job folder and no worker; returns the line."""
    job = tmp_path / "job"
    before = _actors()
    proc = refusal("submit", str(_manifest(tmp_path)), "-j", str(job), "--address", ray_address, *args)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not job.exists(), sorted(p.name for p in job.iterdir())
    assert _actors() == before, "a worker started before the settings were refused"
    return lines[0]


@pytest.mark.parametrize(("args", "named"), BAD_SETTINGS, ids=[a[-1] for a, _ in BAD_SETTINGS])
def test_a_setting_no_worker_can_run_exits_2_with_one_line_and_starts_and_creates_nothing(
        tmp_path: Path, ray_address: str, args: list[str], named: str) -> None:
    foreign = _foreign_root(tmp_path)
    line = _refused(tmp_path, ray_address, "-c", str(TINY_CONFIG),
                             *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert named in line
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]  # a foreign root is left as it was


def test_a_hub_model_not_in_the_cache_is_refused_at_once_whatever_the_environment(tmp_path: Path) -> None:
    """Without HF_HUB_OFFLINE (a venv activated by hand, no Makefile) a submit retried the hub for 6 min, then
    made a job folder whose workers failed (issue 47, row 8): kvbatch downloads nothing unless HF_HUB_OFFLINE=0."""
    job = tmp_path / "job"
    proc = kvbatch("submit", str(_manifest(tmp_path)), "-c", str(TINY_CONFIG), "-j", str(job),
                   "--set", "model.name=kvbatch-test/not-cached", env={"HF_HOME": str(tmp_path / "hf")},
                   unset=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"), check=2, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model 'kvbatch-test/not-cached'" in lines[0], proc.stderr
    assert "HF_HUB_OFFLINE=0" in lines[0] and "hf download kvbatch-test/not-cached" in lines[0], lines[0]
    assert not job.exists()


def test_the_gpu_config_on_a_node_with_fewer_cpus_than_it_asks_for_is_refused(tmp_path: Path, ray_address: str) -> None:
    """configs/gpu-nvme.yaml asks 4 CPUs a worker; the test cluster's one node has 2."""
    line = _refused(tmp_path, ray_address, "-c", str(REPO / "configs" / "gpu-nvme.yaml"))
    assert "workers.cpus_per_worker=4: no node of the Ray cluster has 4 CPUs (1 node(s): 2 CPUs, 0 GPUs)" in line


def test_a_worker_must_fit_on_one_node_not_on_the_clusters_sum() -> None:
    """Two 2-CPU nodes hold four CPUs between them, and no worker of 4 CPUs."""
    from runner.preflight import check_resources

    nodes = [{"CPU": 2.0, "GPU": 0.0}, {"CPU": 2.0, "GPU": 0.0}]
    with pytest.raises(ConfigError, match="no node of the Ray cluster has 4 CPUs"):
        check_resources(load_config(TINY_CONFIG, ["workers.cpus_per_worker=4"]), nodes)
    with pytest.raises(ConfigError, match=r"holds 2 worker\(s\) of 2 CPUs"):
        check_resources(load_config(TINY_CONFIG, ["workers.cpus_per_worker=2", "workers.count=3"]), nodes)
    check_resources(load_config(TINY_CONFIG, ["workers.cpus_per_worker=2", "workers.count=2"]), nodes)


def test_a_gpu_node_is_asked_for_gpus_a_worker_can_have() -> None:
    """One node with 8 CPUs and 1 GPU: Ray shows a worker of one GPU only cuda:0, and two GPUs never fit."""
    from runner.preflight import check_device, check_resources

    node = [{"CPU": 8.0, "GPU": 1.0}]
    with pytest.raises(ConfigError, match="model.device=cuda:1: each worker sees only the 1 GPU"):
        check_device(load_config(TINY_CONFIG, ["model.device=cuda:1"]), node)
    with pytest.raises(ConfigError, match="workers.gpus_per_worker=2: no node of the Ray cluster has 2 GPUs"):
        check_resources(load_config(TINY_CONFIG, ["workers.gpus_per_worker=2"]), node)
    check_device(load_config(TINY_CONFIG, ["model.device=cuda", "cache.strategy=offloaded"]), node)


def test_the_merge_room_check_refuses_exactly_the_settings_where_no_merge_fits() -> None:
    """The prompt (65 tokens with SmolLM2's chat template and the margin), a separator token and three
    answers of 64 tokens need 258 of a 256-token context: 63 tokens fit, as the refusal says."""
    from runner.preflight import check_merge_room

    at_256 = ["summarize.context_tokens=256", "summarize.min_context_tokens=256"]
    with pytest.raises(ConfigError, match=r"to 258 or more, or lower summarize.max_new_tokens to 63 or less"):
        check_merge_room(load_config(TINY_CONFIG, [*at_256, "summarize.max_new_tokens=64"]))
    check_merge_room(load_config(TINY_CONFIG, [*at_256, "summarize.max_new_tokens=63"]))
    check_merge_room(load_config(TINY_CONFIG, ["summarize.min_context_tokens=258", "summarize.max_new_tokens=64"]))
