"""`batch.sdpa_backend`: a CUDA worker enables the one attention kernel asked for before it captures
anything, and says which were enabled (job.log's worker_ready). torch's switches are process flags,
set here as the worker sets them (no CUDA needed to set them), and put back after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from jobs.config import ConfigError, load_config
from runner.engine.sdpa import BACKENDS, choose_sdpa
from tests.helpers.cli import TINY_CONFIG


@pytest.fixture
def flags() -> Iterator[None]:
    before = {name: enabled() for name, (_, enabled) in BACKENDS.items()}
    yield
    for name, (enable, _) in BACKENDS.items():
        enable(before[name])


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "math"])
def test_a_named_backend_is_the_only_one_enabled(backend: str, flags: None) -> None:
    assert choose_sdpa(backend, torch.device("cuda", 0)) == {name: name == backend for name in BACKENDS}
    assert {name: enabled() for name, (_, enabled) in BACKENDS.items()} == {name: name == backend for name in BACKENDS}


def test_auto_leaves_torchs_choice_and_says_what_it_is(flags: None) -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)  # whatever the flags are, auto reports them as they are
    assert choose_sdpa("auto", torch.device("cuda", 0)) == {name: enabled() for name, (_, enabled) in BACKENDS.items()}
    assert choose_sdpa("auto", torch.device("cuda", 0))["cudnn"] is False


def test_nothing_is_chosen_on_the_cpu(flags: None) -> None:
    before = {name: enabled() for name, (_, enabled) in BACKENDS.items()}
    assert choose_sdpa("math", torch.device("cpu")) is None
    assert {name: enabled() for name, (_, enabled) in BACKENDS.items()} == before


def test_the_key_takes_the_backends_and_names_itself_when_wrong() -> None:
    assert load_config(TINY_CONFIG, []).batch.sdpa_backend == "auto"
    assert load_config(TINY_CONFIG, ["batch.sdpa_backend=cudnn"]).batch.sdpa_backend == "cudnn"
    with pytest.raises(ConfigError, match="batch.sdpa_backend"):
        load_config(TINY_CONFIG, ["batch.sdpa_backend=fastest"])
