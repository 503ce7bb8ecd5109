"""The per-stage memory probe on a real (tiny) model's generate(): prefill and decode are told apart."""

from __future__ import annotations

import pytest
import torch

from jobs.config import ModelConfig, SummarizeConfig
from runner.engine.generation import generate_once
from runner.engine.models import load_model
from runner.engine.probes import StageProbe, memory_snapshot


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelConfig(name="builtin:tiny-random"))


class CountingProbe(StageProbe):
    """Counts the stage boundaries the real probe detects (no behaviour replaced)."""

    prefills_ended = 0

    def _prefill_ended(self) -> None:
        self.prefills_ended += 1
        super()._prefill_ended()


@pytest.mark.parametrize("chunk", [0, 16])  # whole-prompt and chunked prefill
def test_one_prefill_boundary_per_generate_pass(tiny, chunk):
    settings = SummarizeConfig(prefill_chunk_size=chunk, max_new_tokens=8)
    prompt = list(range(100, 180))
    with CountingProbe(tiny.model, tiny.device) as probe:
        for _ in range(2):  # two passes, as a map-reduce task makes
            generate_once(tiny, prompt, 8, settings, {})
    assert probe.prefills_ended == 2
    assert probe.prefill_host_rss_bytes > 0 and probe.decode_peak_host_rss_bytes > 0
    assert 0 < probe.host_used_fraction < 1
    assert probe.prefill_device_bytes is None and probe.device_peak_bytes is None  # CPU: no device figures


def test_a_single_token_answer_has_a_prefill_but_no_decode_stage(tiny):
    with CountingProbe(tiny.model, tiny.device) as probe:
        generate_once(tiny, list(range(100, 140)), 1, SummarizeConfig(), {})
    assert probe.prefills_ended == 1 and probe.prefill_host_rss_bytes > 0
    assert probe.decode_peak_host_rss_bytes is None and probe.decode_peak_device_bytes is None


def test_the_probe_leaves_the_model_without_hooks(tiny):
    with StageProbe(tiny.model, tiny.device):
        pass
    assert not tiny.model._forward_pre_hooks


def test_memory_snapshot_on_cpu():
    snap = memory_snapshot(torch.device("cpu"))
    assert snap.host_rss_bytes > 0 and snap.device_bytes is None and snap.device_used_fraction is None
