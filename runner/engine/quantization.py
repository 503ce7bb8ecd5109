"""`model.quantization` as transformers' own `quantization_config` (bitsandbytes, torchao), what a
method needs to run, and the real bytes a loaded model's weights take.

kvbatch never quantizes a weight itself: transformers' quantizers replace the layers while the
checkpoint loads. A checkpoint quantized already (its config.json has a `quantization_config`)
loads as it is and is reported as ``checkpoint:<method>``. Importing this module is cheap: the
libraries are looked up, not imported, until a model is loaded.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    from jobs.config import ModelConfig

NONE = "none"


def unavailable(method: str, device_type: str) -> str | None:
    """Why `method` cannot run here on a `device_type` device ("cpu", "cuda"), in words; None when it can."""
    if method == NONE:
        return None
    # each method's library, and accelerate: transformers places quantized weights with it
    packages = ("bitsandbytes" if method.startswith("bnb-") else "torchao", "accelerate")
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        return f"needs the package(s) {', '.join(missing)}: install them with `pip install 'kvbatch[quant]'`"
    if method == "torchao-int4" and device_type != "cuda":
        return "runs on CUDA only (torchao's int4 weight-only matmul is a CUDA kernel: use bnb-4bit on a CPU)"
    return None


def checkpoint_quantization(config: PretrainedConfig) -> str | None:
    """``checkpoint:<method>`` for a checkpoint whose config carries a quantization_config, else None."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    method = found.get("quant_method") if isinstance(found, dict) else getattr(found, "quant_method", None)
    return f"checkpoint:{getattr(method, 'value', method) or 'unknown'}"


def quantization_config(cfg: ModelConfig, dtype: torch.dtype) -> Any | None:
    """transformers' quantization_config for `cfg.quantization` (None for `none`); `dtype` is the
    model's, which bnb-4bit computes in unless `model.quantization_compute_dtype` says otherwise."""
    import torch

    method = cfg.quantization
    if method == NONE:
        return None
    if method.startswith("bnb-"):
        from transformers import BitsAndBytesConfig

        if method == "bnb-8bit":
            # its matmul casts float32 inputs to float16 on every call and says so each time: expected here
            logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
            # threshold 0: no outlier columns kept in float16. Those are chosen over every row of a matmul,
            # so a batch-mate's activations would change a sequence's tokens; each row is quantized alone
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
        compute = dtype if cfg.quantization_compute_dtype == "auto" else getattr(torch, cfg.quantization_compute_dtype)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    if method == "torchao-int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    # tile_packed_to_4d: torch's own tinygemm CUDA kernel; the default packing needs another package (mslk)
    return TorchAoConfig(Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))


def weight_bytes(model: PreTrainedModel) -> int:
    """The bytes the model's parameters and buffers really take: a quantized tensor subclass (torchao)
    counts its packed data and scales, not the full-precision size it reports; tied weights count once."""
    unique = {id(tensor): tensor for tensor in [*model.parameters(), *model.buffers()]}
    return sum(_tensor_bytes(tensor) for tensor in unique.values())


def _tensor_bytes(tensor: torch.Tensor) -> int:
    if hasattr(tensor, "__tensor_flatten__"):  # a tensor subclass: the tensors it is made of
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
