"""Fixtures only (helpers are plain functions in tests/helpers/): one real local Ray instance per test
session, the builtin tiny random model per module, a real S3-compatible server per module, one torch
thread where a module asks for it. Under pytest-xdist (`make test`) a session is one worker process: each
has its own Ray, tmp folders and moto ports; `--dist loadfile` keeps a file on one worker, so a module
fixture (one real job, a cluster) runs once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.helpers.system import BUCKET, free_port, wait_for_server

try:
    from hypothesis import settings
except ImportError:  # the GPU machine runs tests/test_cuda.py without hypothesis installed
    settings = None

# CI runs property tests derandomized: the same examples every run, so a random draw never blocks a landing
if settings is not None:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: the files that take longest under `make test` (its --durations), longest first: they start first,
#: so no long file is left to run alone at the end. Order only: a file missing here just starts later.
_LONGEST_FILES = ["test_load", "test_scratch_e2e", "test_batching_e2e", "test_resume", "test_object_storage",
                  "test_quantization", "test_cluster", "test_passes", "test_worker_start", "test_ladder_e2e",
                  "test_kvcache_smollm2", "test_cli_e2e", "test_pool", "test_task_timeout",
                  "test_formats", "test_soak", "test_decode_revisions", "test_report", "test_hostile_input",
                  "test_checkpoint", "test_batch_end", "test_jobdir", "test_static_step_cli"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Puts the longest files first (a stable sort: each file's tests keep their order): under
    `--dist loadfile` (`make test`) each xdist worker takes whole files in this order."""
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


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
    from runner.engine.model_loader import load_model

    return load_model(ModelConfig(name="builtin:tiny-random", device="cpu"))


@pytest.fixture(scope="module")
def tokenizer(tiny_random):
    """The builtin tiny random model's tokenizer (the random models of tests/helpers/models.py have none)."""
    return tiny_random.tokenizer


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """`s3://BUCKET` on a moto server this module starts; the AWS variables point every process at it."""
    from jobs.uris import filesystem_of

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    try:
        wait_for_server(port, server)
        filesystem_of(f"s3://{BUCKET}?allow_bucket_creation=true")[0].create_dir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        patch.undo()
        server.terminate()
        server.wait()
