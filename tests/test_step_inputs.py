"""The step inputs (runner/engine/step_inputs.py) off CUDA: exactly the tensors the steps built
before, `torch.tensor(values, device=...)`, and no pinned buffer. On CUDA: tests/test_cuda.py."""

from __future__ import annotations

import threading

import pytest
import torch

from runner.engine.step_inputs import StepInputs, step_inputs


@pytest.mark.parametrize("values", [[0], [3, 1, 4, 1, 5], list(range(100)), []])
def test_off_cuda_a_step_input_is_the_tensor_built_before(values: list[int]) -> None:
    device = torch.device("cpu")
    put = StepInputs(device).put("positions", values)
    before = torch.tensor(values, dtype=torch.long, device=device)
    assert put.dtype == before.dtype == torch.long and put.device == before.device
    assert put.shape == before.shape and put.tolist() == values
    assert step_inputs(device).host_buffer("positions") is None


def test_each_thread_keeps_its_own_step_inputs() -> None:
    """A pinned buffer is written by the thread that queues its copy: no two threads share one."""
    device = torch.device("cpu")
    here = step_inputs(device)
    there: list[StepInputs] = []
    thread = threading.Thread(target=lambda: there.append(step_inputs(device)))
    thread.start()
    thread.join()
    assert step_inputs(device) is here and there[0] is not here
