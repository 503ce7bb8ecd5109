"""Which scaled-dot-product attention kernel a CUDA worker's decode steps use (`batch.sdpa_backend`).

A captured decode step freezes the kernel torch picked when it was captured, and torch's pick varies
with its version and the shapes (cuDNN is the default on torch 2.11 + CUDA 13, and faulted there on
an unaligned span once). So the worker sets the choice itself at start, for its process, before any
step is captured, and says in job.log which kernels were enabled: a device run's figures then name
the kernel they measured.
"""

from __future__ import annotations

import torch

BACKENDS = {
    "cudnn": (torch.backends.cuda.enable_cudnn_sdp, torch.backends.cuda.cudnn_sdp_enabled),
    "flash": (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.flash_sdp_enabled),
    "efficient": (torch.backends.cuda.enable_mem_efficient_sdp, torch.backends.cuda.mem_efficient_sdp_enabled),
    "math": (torch.backends.cuda.enable_math_sdp, torch.backends.cuda.math_sdp_enabled),
}
"""Each backend's switch and its state (process-wide flags: one worker, one model, one process)."""


def choose_sdpa(backend: str, device: torch.device) -> dict[str, bool] | None:
    """Enable only `backend` (`auto`: leave torch's defaults) on a CUDA `device`; the backends enabled
    after it, what worker_ready writes to job.log. None on another device: there is nothing to choose."""
    if device.type != "cuda":
        return None
    if backend != "auto":
        for name, (enable, _) in BACKENDS.items():
            enable(name == backend)
    return {name: enabled() for name, (_, enabled) in BACKENDS.items()}
