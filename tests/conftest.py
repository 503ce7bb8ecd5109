"""Fixtures only (helpers are plain functions in tests/helpers/): one real local Ray instance per test
session, the builtin tiny random model per module, one torch thread where a module asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# CI runs property tests derandomized: the same examples every run, so a random draw never blocks a landing
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """A real local Ray instance shared by every CLI run of the session (starting one costs seconds)."""
    import ray

    from runner.cluster import init_local_ray

    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads and lose a lot when the cores are shared; a module that runs
    them in-process says `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_random():
    """The builtin tiny random model (its real tokenizer), loaded on the CPU once per module."""
    from jobs.config import ModelConfig
    from runner.engine.models import load_model

    return load_model(ModelConfig(name="builtin:tiny-random", device="cpu"))


@pytest.fixture(scope="module")
def tokenizer(tiny_random):
    """The builtin tiny random model's tokenizer (the random models of tests/helpers/models.py have none)."""
    return tiny_random.tokenizer
