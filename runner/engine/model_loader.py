"""Turn a `model:` config section into a ready model + tokenizer, and tell what a model name is
(loadable, context, vocabulary, quantization) without reading its weights.

Names: docs/design.md, "Models"; a hub id is read from the local cache unless ``HF_HUB_OFFLINE=0``
(`hub_downloads_allowed`). tiny-random is saved once as a folder when quantized, since transformers
quantizes while a checkpoint loads. Importing this module is cheap (no torch, transformers or ray): the
CLI and CI import it to warm the cache without paying for what they do not use.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.config import looks_like_path
from runner.engine.model_registry import (
    BUILTIN_PREFIX,
    SMOLLM2,
    TINY_RANDOM,
    TINY_RANDOM_MAX_POSITIONS,
    TINY_RANDOM_VOCAB,
    ModelLoadError,
    check_builtin,
    smollm2_config,
    smollm2_model_dir,
    smollm2_tokenizer,
    tiny_random_dir,
    tiny_random_model,
    unknown_builtin,
)
from runner.engine.quantization import NONE, checkpoint_quantization, quantization_config, weight_bytes

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from jobs.config import ModelConfig
    from runner.engine.word_pieces import WordPieces


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    load_s: float
    quantization: str = NONE
    """`model.quantization`, or ``checkpoint:<method>`` for a checkpoint quantized already."""
    weight_bytes: int = 0
    """What its weights really take (quantized ones at their packed size)."""

    @functools.cached_property
    def word_pieces(self) -> WordPieces:
        """Its tokenizer's word-start and word-continuing tokens (the summary's n-gram ban reads them),
        read once, on first use."""
        from runner.engine.word_pieces import WordPieces

        return WordPieces.of(self.tokenizer)


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> the first CUDA device when there is one, else the CPU; otherwise a torch device string."""
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ModelLoadError(
            f"model.device '{spec}' is not a device: use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"model.device '{spec}' asks for CUDA but torch sees no CUDA device here: "
                "use model.device=auto or cpu, or install a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"model.device '{spec}' does not exist: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on a CUDA device that supports it, float16 on older CUDA devices,
    float32 on the CPU (CPU half-precision matmuls are slow and gain nothing for 135M-parameter
    models); an explicit name is taken as is.
    """
    import torch

    if spec != "auto":
        return getattr(torch, spec)  # ModelConfig only admits torch dtype names
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load `cfg.name` in eval mode on `cfg.device`, converting a builtin once if needed."""
    start = time.perf_counter()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    name = cfg.name
    quantized = quantization_config(cfg, dtype)
    if name.startswith(BUILTIN_PREFIX):
        model, tokenizer = _load_builtin(name, cfg.attn_implementation, dtype, quantized, device)
    else:
        model, tokenizer = _from_pretrained(
            name, name, cfg.attn_implementation, dtype, fix=_missing_model_fix(name), quantized=quantized,
            device=device,
        )
    _prepare_for_generation(model, tokenizer)
    checkpoint = checkpoint_quantization(model.config) if quantized is None else None
    if quantized is None and checkpoint is None:  # quantized weights were placed while loading
        model.to(device)
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, device=device, dtype=dtype,
        load_s=time.perf_counter() - start, quantization=checkpoint or cfg.quantization,
        weight_bytes=weight_bytes(model),
    )


def _load_builtin(
    name: str, attn_implementation: str, dtype: torch.dtype, quantized: Any | None, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2 from its converted folder; tiny-random made in code, or from its saved folder when a
    quantizer must load it."""
    builtin = name[len(BUILTIN_PREFIX):]
    if builtin == SMOLLM2 or (builtin == TINY_RANDOM and quantized is not None):
        folder = smollm2_model_dir() if builtin == SMOLLM2 else tiny_random_dir()
        return _from_pretrained(
            folder, name, attn_implementation, dtype,
            fix=f"delete {folder} so it is {'converted' if builtin == SMOLLM2 else 'saved'} again",
            quantized=quantized, device=device,
        )
    if builtin == TINY_RANDOM:
        tokenizer = smollm2_tokenizer(name)
        return tiny_random_model(tokenizer, attn_implementation, dtype), tokenizer
    raise unknown_builtin(name)


HUB_OFFLINE_ENV = "HF_HUB_OFFLINE"


def hub_downloads_allowed() -> bool:
    """Whether a model may be downloaded from the Hugging Face hub: only with HF_HUB_OFFLINE=0 (or false,
    no, off) set. Without internet an id not in the cache was retried for minutes before a worker failed;
    unset, the hub is not asked, in submit's checks and in the workers alike."""
    return os.environ.get(HUB_OFFLINE_ENV, "").strip().lower() in ("0", "false", "no", "off")


def check_model_name(name: str) -> None:
    """Raises `ModelLoadError` when `name` is no model a worker could load, found without reading
    weights: an unknown builtin (or its package missing), a folder without config.json, a hub id
    that is not in the local cache while downloads are not allowed (`hub_downloads_allowed`)."""
    import huggingface_hub

    if name.startswith(BUILTIN_PREFIX):
        check_builtin(name)
        return
    if looks_like_path(name):
        if not (Path(name).expanduser() / "config.json").is_file():
            raise ModelLoadError(f"model '{name}' is not a saved model: {_missing_model_fix(name)}")
        return
    if hub_downloads_allowed():
        return  # a worker downloads it, or says why it cannot
    try:
        cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    except ValueError:  # not even a valid repo id
        cached = None
    if not isinstance(cached, str):
        raise ModelLoadError(f"model '{name}' cannot be loaded: {_missing_model_fix(name)}")


def model_max_positions(cfg: ModelConfig) -> int | None:
    """The model's max_position_embeddings, read from its config alone (no weights); None when unknown."""
    return _text_config_int(cfg, "max_position_embeddings", TINY_RANDOM_MAX_POSITIONS)


def model_vocab_size(cfg: ModelConfig) -> int | None:
    """How many token ids the model has, from its config alone (no weights); None when unknown."""
    return _text_config_int(cfg, "vocab_size", TINY_RANDOM_VOCAB)


def _text_config_int(cfg: ModelConfig, field: str, tiny_random: int) -> int | None:
    """`field` of the model's text config, read without its weights; None when it cannot be read here (a
    model whose config cannot be read is left to the workers, which report why it does not load)."""
    name = cfg.name
    if name == BUILTIN_PREFIX + TINY_RANDOM:
        return tiny_random
    try:
        if name == BUILTIN_PREFIX + SMOLLM2:
            config = smollm2_config()
        elif name.startswith(BUILTIN_PREFIX):
            return None
        else:
            config = _config(name)
    except (OSError, ValueError, ModelLoadError):
        return None
    value = getattr(config.get_text_config(), field, None)
    return value if isinstance(value, int) else None


def model_quantization(cfg: ModelConfig) -> str | None:
    """``checkpoint:<method>`` when `cfg.name` is a checkpoint quantized already, from its config alone;
    None for the builtins (never quantized on disk) and a config that cannot be read here."""
    if cfg.name.startswith(BUILTIN_PREFIX):
        return None
    try:
        return checkpoint_quantization(_config(cfg.name))
    except (OSError, ValueError):
        return None


def _prepare_for_generation(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Eval mode and a pad token, so batched generation neither warns nor guesses."""
    model.eval()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def _missing_model_fix(name: str) -> str:
    if looks_like_path(name):
        return f"check that {name} holds a saved model: config.json, weights and tokenizer files"
    if not hub_downloads_allowed():
        return (
            f"'{name}' is neither a local folder nor in the Hugging Face cache, and kvbatch downloads no "
            f"model unless HF_HUB_OFFLINE=0 is set: run `hf download {name}` where there is internet and copy "
            "the cache (HF_HOME) here, set HF_HUB_OFFLINE=0 to let kvbatch download it, or set model.name to "
            "a local folder"
        )
    return (
        f"check that '{name}' is an existing local folder or a Hugging Face model id you can "
        "access (a gated model needs `hf auth login`)"
    )


def _from_pretrained(
    source: str | Path, name: str, attn_implementation: str, dtype: torch.dtype, fix: str,
    quantized: Any | None = None, device: torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """One path for folders, hub ids and converted builtins; `fix` is what to tell the user.

    Quantized weights (`quantized`, transformers' quantization_config, or a checkpoint's own) are
    placed on `device` while they load: a quantized model cannot always be moved afterwards.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    location = str(source)
    if looks_like_path(location):
        location = str(Path(location).expanduser())
        if not Path(location).is_dir():
            raise ModelLoadError(f"model '{name}': folder {location} does not exist; fix model.name")
    local = not hub_downloads_allowed()
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local)
        placed: dict[str, Any] = {}
        checkpoint = checkpoint_quantization(AutoConfig.from_pretrained(location, local_files_only=local))
        if checkpoint is not None and quantized is not None:
            raise ModelLoadError(
                f"model '{name}' is quantized already ({checkpoint}): set model.quantization to none"
            )
        if quantized is not None or checkpoint is not None:
            placed = {"quantization_config": quantized, "device_map": {"": str(device)}}
        model = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=local,
            **{k: v for k, v in placed.items() if v is not None},
        )
    except (OSError, ValueError, ImportError, SafetensorError) as err:  # the last: a damaged weights file
        raise ModelLoadError(f"cannot load model '{name}': {fix}. ({type(err).__name__}: {err})") from err
    return model, tokenizer


def _config(name: str) -> Any:
    """The config of a model named by a folder (user-expanded) or a hub id, without its weights."""
    from transformers import AutoConfig

    location = str(Path(name).expanduser()) if looks_like_path(name) else name
    return AutoConfig.from_pretrained(location, local_files_only=not hub_downloads_allowed())


