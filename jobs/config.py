"""The job configuration: one validated schema shared by the CLI, the coordinator and workers.

Unknown keys are errors (a typo must not silently fall back to a default), and every error
names the dotted key so the user knows what to fix.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from jobs.rungs import STRATEGIES

DEFAULT_PROMPT = (
    "Summarise the following document in a few sentences. "
    "Say what it is, who it concerns and what it requires or allows."
)


class ConfigError(ValueError):
    """A config file, key or value the user must fix; the message says which and how."""


MAX_SECONDS = 7 * 86400
"""The longest wait any `*_s` key may set: finite, and far inside what threading and Ray accept as a timeout."""

MAX_CONTEXT_TOKENS = 2**20
"""Tokens no one pass of a model holds more of in practice; what a KV block may hold at most."""

MAX_DOCUMENT_BYTES = 2**31 - 1
"""A document is read into memory whole and kept as one Arrow string value, which holds at most 2 GiB."""

MIN_RAY_CPUS = 0.0001
"""Ray's resource granularity: a smaller fraction rounds to 0 and Ray refuses the worker."""

MAX_SEED = 2**64 - 1
MIN_SEED = -(2**63)
"""torch.manual_seed's range (a 64-bit seed, signed or not)."""

MAX_CONFIG_VALUES = 10_000
"""Values (list items, mapping entries) a config may expand to; a YAML alias bomb expands to billions."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read: every key with a long prompt is a few KiB; `-c /dev/urandom` never ends."""

#: torch's device types (torch.device's parser), so jobs/ checks `model.device` without importing torch.
TORCH_DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
                      "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone")
_DEVICE = re.compile(rf"({'|'.join(TORCH_DEVICE_TYPES)})(?::(0|[1-9][0-9]*))?")
_MAX_DEVICE_INDEX = 127  # torch keeps a device index in an int8


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1: a number key (`int`, `float`, `int | Literal["auto"]`...) refuses true/false,
        and the YAML 1.1 words for them (YAML 1.2, which configs are read as, keeps them strings), as a manifest
        row does."""
        if not (isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("yes", "no", "on", "off"))):
            return value
        annotation = cls.model_fields[info.field_name].annotation
        kinds = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
        if {int, float} & set(kinds) and bool not in kinds:
            raise ValueError("must be a number, not true/false (nor yes, no, on, off)")
        return value


Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["none", "bnb-8bit", "bnb-4bit", "torchao-int8", "torchao-int4"]


class ModelConfig(_Section):
    """The model every worker loads, and how."""

    name: str = Field("builtin:smollm2-135m", description=(
        "`builtin:smollm2-135m`, `builtin:tiny-random`, a Hugging Face id (from the local cache when "
        "offline) or a local folder"))
    dtype: Dtype = Field("auto", description=(
        "weights' dtype; `auto`: bfloat16 on a CUDA GPU that supports it, else float32"))
    device: str = Field("auto", description="`cpu`, `cuda`, `cuda:N`; `auto`: the first CUDA device when there is one, else the CPU")
    attn_implementation: str = Field("sdpa", description="transformers' `attn_implementation` the model is loaded with (`sdpa`, `eager`, ...)")
    quantization: Quantization = Field("none", description=(
        "weights loaded through transformers' own quantizers (`pip install 'kvbatch[quant]'`; "
        "`torchao-int4` needs CUDA); a checkpoint that is quantized already loads as it is with `none`"))
    quantization_compute_dtype: Dtype = Field("auto", description=(
        "what `bnb-4bit` dequantises to for its matmuls; `auto`: `model.dtype`"))

    @field_validator("name")
    @classmethod
    def _absolute_folder(cls, name: str) -> str:
        """A local folder is stored absolute, so `resume` from another working directory finds it."""
        return absolute_path(name) if looks_like_path(name) else name

    @field_validator("device")
    @classmethod
    def _device_name(cls, spec: str) -> str:
        match = _DEVICE.fullmatch(spec)
        if spec != "auto" and (match is None or int(match.group(2) or 0) > _MAX_DEVICE_INDEX):
            raise ValueError(
                f"is not a device torch knows: use auto, cpu, cuda or cuda:N (N from 0 to {_MAX_DEVICE_INDEX})")
        return spec


class LoopStopConfig(_Section):
    """A sequence that ends in `repeats` back-to-back copies of one block of `ngram` to `max_period`
    tokens, or whose last `window` tokens are near-copies of earlier text (at least `window_share` of
    their `ngram`-grams occurred before), stops there, and what came after the first copy is cut
    (jobs/stopping.py). `window: 0` turns the near-copy rule off."""

    enabled: bool = Field(True, description="stop a summary that loops (`stop_reason: repetition`)")
    ngram: int = Field(4, gt=0, description="tokens in the smallest repeated block, and in the near-copy rule's n-grams")
    repeats: int = Field(3, ge=2, description="back-to-back copies of one block that end a sequence")
    max_period: int = Field(64, gt=0, description="tokens in the longest repeated block looked for")
    window: int = Field(32, ge=0, description=(
        "the near-copy rule's last tokens looked at; `0` turns the rule off, else at least 2 x `ngram`"))
    window_share: float = Field(0.6, gt=0.0, le=1.0, description=(
        "share (0-1] of the window's n-grams that occurred before for it to count as a near-copy"))

    @field_validator("window")
    @classmethod
    def _window_spans_ngrams(cls, window: int, info: Any) -> int:
        ngram = info.data.get("ngram", 1)
        if 0 < window < 2 * ngram:
            raise ValueError(f"must be 0 (off) or at least 2 x ngram ({2 * ngram}) tokens")
        return window

    @model_validator(mode="after")
    def _periods(self) -> "LoopStopConfig":
        if self.max_period < self.ngram:
            raise ValueError(f"max_period ({self.max_period}) must not be below ngram ({self.ngram})")
        return self


class SummarizeConfig(_Section):
    """What the model is asked and how much of a document one pass holds."""

    prompt: str = Field(DEFAULT_PROMPT, description="the instruction before each document (a manifest row's `prompt` overrides it)")
    max_new_tokens: int = Field(120, gt=0, description=(
        "most tokens a summary (each chunk's and each merge pass's too) may have; at most half of "
        "`context_tokens` (a manifest row's `max_new_tokens` overrides it)"))
    context_tokens: int = Field(8192, gt=0, description=(
        "tokens one pass holds (prompt + document + `max_new_tokens`); a longer document is chunked and "
        "its summaries merged"))
    min_context_tokens: int = Field(1024, gt=0, description=(
        "tokens below which a failing document's context is not shrunk further (it fails instead)"))
    chunk_overlap_tokens: int = Field(64, ge=0, description="tokens each chunk of a long document shares with the one before")
    prefill_chunk_size: int = Field(512, ge=0, description=(
        "prompt tokens prefilled per forward pass when prompts do not ride the decode steps "
        "(`batch.prefill_chunk_tokens: 0`, or a model whose prompts cannot ride) and for transformers' own cache "
        "implementations; `0`: the whole prompt in one pass"))
    do_sample: bool = Field(False, description="sample instead of greedy decoding")
    seed: int = Field(0, ge=MIN_SEED, le=MAX_SEED, description=(
        "the sampling seed (each sequence gets its own generator), a 64-bit integer as torch takes it"))
    generation: dict[str, Any] = Field(default_factory=dict, description=(
        "transformers `GenerationConfig` fields passed to `generate()`, e.g. `{repetition_penalty: 1.15}`; "
        "checked at submit, one the batched decode cannot honour is refused (docs/input.md). Its "
        "`no_repeat_ngram_size` bans the prompt's n-grams too, so a summary could not quote the document: "
        "`no_repeat_summary_ngram` is the summary-only ban"))
    no_repeat_summary_ngram: int = Field(4, ge=0, description=(
        "a token that would repeat an n-gram of this many tokens already in the summary (its own new "
        "tokens, not the prompt: quoting the document stays allowed) is banned, and where the banned token "
        "begins a word so is every token that would glue on to the word before it; the builtin model's "
        "greedy summaries otherwise loop (docs/benchmarks.md, 'Summaries that end'); `0`: off"))
    trim_to_sentence: bool = Field(True, description=(
        "a summary that ran out of `max_new_tokens` (`stop_reason: length`) ends at its last complete sentence "
        "and the cut words go to the result's `summary_tail` (one with no sentence end stays whole); the "
        "partial summaries a merge joins stay whole"))
    loop_stop: LoopStopConfig = Field(default_factory=LoopStopConfig)

    @model_validator(mode="after")
    def _sizes_consistent(self) -> "SummarizeConfig":
        if self.min_context_tokens > self.context_tokens:
            raise ValueError(
                f"min_context_tokens ({self.min_context_tokens}) must not exceed "
                f"context_tokens ({self.context_tokens})"
            )
        return self


ByteBudget = int | Literal["auto"]
PrefillMode = Literal["auto", "chunked", "layer-major"]


class CacheConfig(_Section):
    """Where each task's KV cache lives while it generates (docs/kv-cache.md)."""

    strategy: str = Field("auto", description=(
        "`dynamic`, `tiered-host`, `tiered-disk`, `static`, `offloaded`, `offloaded_static` (CUDA); "
        "`auto`: the first rung of `ladder` whose budget fits the task's KV"))
    ladder: list[str] = Field(default_factory=lambda: ["dynamic", "tiered-host", "tiered-disk"], description=(
        "the strategies a task moves down on a memory error, in order"))
    device_kv_budget_bytes: ByteBudget = Field("auto", description=(
        "bytes of KV a worker keeps on its device; `auto`: a GPU's free memory after the load shared among "
        "its workers, on the CPU half the available RAM shared among the node's workers"))
    host_kv_budget_bytes: ByteBudget = Field("auto", description=(
        "bytes of KV a worker keeps in host RAM on tiered rungs; `auto`: half the available RAM shared "
        "among the node's workers"))
    offload_root: str | None = Field(None, description=(
        "folder (ideally NVMe, the same path on every node) for tiered-disk block files; `null`: "
        "`$KVBATCH_OFFLOAD_ROOT`, else `JOB_DIR/scratch/kvbatch` (`~/.cache/kvbatch/offload` for a job on S3)"))
    block_tokens: int = Field(512, gt=0, le=MAX_CONTEXT_TOKENS, description=(
        f"tokens per KV block file on tiered-disk (at most {MAX_CONTEXT_TOKENS:,}: a block's buffer is "
        "allocated whole)"))
    compression: Literal["zstd", "none"] = Field("zstd", description="how block files are written: `zstd`, or raw with `none`")
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level of block files (-7 fastest, 22 smallest)")
    shuffle: bool = Field(True, description="byte-plane shuffle before zstd (lossless; compresses float KV better)")
    prefill: PrefillMode = Field("auto", description=(
        "`layer-major` prefills a layer at a time, so a tiered cache reads the prompt's KV back once, not "
        "once per chunk; `chunked`: transformers' order; `auto`: layer-major on tiered rungs of covered "
        "models with 2+ prefill chunks, else chunked"))

    @field_validator("offload_root")
    @classmethod
    def _absolute_root(cls, root: str | None) -> str | None:
        """Stored absolute, so `resume` from another working directory writes where `submit` did."""
        return absolute_path(root) if root else root

    @field_validator("device_kv_budget_bytes", "host_kv_budget_bytes")
    @classmethod
    def _positive_budget(cls, v: ByteBudget) -> ByteBudget:
        if v != "auto" and v <= 0:
            raise ValueError("must be a positive number of bytes or 'auto'")
        return v

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        if v != "auto" and v not in STRATEGIES:
            raise ValueError(f"unknown cache strategy; choose auto or one of {sorted(STRATEGIES)}")
        return v

    @field_validator("ladder")
    @classmethod
    def _known_ladder(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one cache strategy")
        if unknown := [name for name in v if name not in STRATEGIES]:
            raise ValueError(f"unknown cache strategy {unknown}; choose from {sorted(STRATEGIES)}")
        return v


class RetryConfig(_Section):
    """How transient failures are retried and failing documents shortened (docs/cluster.md)."""

    max_attempts: int = Field(3, gt=0, description="attempts per task at one context size before it is shortened or failed")
    backoff_initial_s: float = Field(1.0, ge=0, le=MAX_SECONDS, description="seconds before the first retry; doubles each retry")
    backoff_max_s: float = Field(60.0, ge=0, le=MAX_SECONDS, description="the longest wait between retries, in seconds")
    context_shrink: float = Field(0.5, gt=0, lt=1, description=(
        "factor (0-1) on `context_tokens` for a document that keeps failing, down to `min_context_tokens`"))
    task_timeout_s: float = Field(3600.0, gt=0, le=MAX_SECONDS, description=(
        "seconds a pass (a whole short document, a chunk or a merge of a long one) may run once its "
        "sequence begins before its worker is restarted; waiting behind batch-mates has its own limit, "
        "this x `batch.max_sequences`"))


class WorkersConfig(_Section):
    """The Ray actors that hold the model, one model each."""

    count: int | Literal["auto"] = Field("auto", description=(
        "workers; `auto`: one per GPU, else one per `cpus_per_worker` CPUs, across the cluster"))
    gpus_per_worker: float = Field(1.0, ge=0, description="GPUs Ray gives each worker (fractions share a GPU); 0 on a cluster without GPUs")
    cpus_per_worker: float = Field(1.0, ge=MIN_RAY_CPUS, description=(
        f"CPUs Ray gives each worker (at least {MIN_RAY_CPUS})"))
    start_timeout_s: float = Field(300.0, gt=0, le=MAX_SECONDS, description=(
        "seconds a worker may take to be placed, start and load its model before the run stops (exit 4, "
        "resumable)"))

    @field_validator("gpus_per_worker")
    @classmethod
    def _ray_fraction(cls, gpus: float) -> float:
        if 0 < gpus < MIN_RAY_CPUS:
            raise ValueError(f"must be 0 or at least {MIN_RAY_CPUS} (Ray rounds a smaller fraction to 0)")
        return gpus

    @field_validator("count")
    @classmethod
    def _positive_count(cls, v: int | str) -> int | str:
        if v != "auto" and v <= 0:
            raise ValueError("must be a positive number of workers or 'auto'")
        return v


AUTO_MAX_SEQUENCES = 16
"""`batch.max_sequences: auto`: this many, whatever the budgets; admission lets fewer decode together
when the budgets hold fewer."""

MAX_SEQUENCES = 256
"""The most `batch.max_sequences`: each task in flight holds a thread in its worker and one in the
coordinator, and a worker's Ray actor is made with that many (100,000 made its start fail, and Ray
restarted it forever); 256 is also vLLM's default `max_num_seqs` for one GPU."""


PREFILL_CHUNK_TOKENS = 256
"""batch.prefill_chunk_tokens' default: a chunk costs a few decode steps' time on a CPU, not a stall."""


class BatchConfig(_Section):
    """How many sequences (documents, map chunks, merge passes) share a worker's decode steps."""

    max_sequences: int | Literal["auto"] = Field("auto", description=(
        f"tasks a worker keeps in flight and the most sequences it decodes together, at most {MAX_SEQUENCES}; "
        f"`auto`: {AUTO_MAX_SEQUENCES} (a constant). Whatever the value, a sequence joins only while the batch's KV at full length fits "
        "the worker's device (and, on tiered rungs, host) budget, and a memory error lowers the limit for "
        "a while (jobs/batch_limit.py)"))
    attention: Literal["auto", "pooled", "per-row"] = Field("auto", description=(
        "`pooled`: one attention call per layer over the worker's KV pool (device-resident rows); "
        "`per-row`: each row over its own cache; `auto`: pooled (measured faster on CUDA and on the CPU)"))
    static_step: Literal["auto", "on", "off"] = Field("auto", description=(
        "`on`: the KV pool's rows of every decode step (the pooled path) run with their inputs in static "
        "buffers, padded to a batch-size bucket (1, 2, 4, 8, then steps of 16), attended in runs of like "
        "lengths, the greedy token chosen on the device, the summary's n-gram ban included (a riding prompt "
        "chunk and tiered rows run as their own eager forward beside them); on CUDA every bucket and span is "
        "captured as a CUDA graph at worker start over a KV pool made for the worker's life, and replayed (a "
        "capture that fails runs eagerly; runner/engine/static_step.py). The tokens are the same either way. "
        "`auto`: on with CUDA, off on the CPU (where the host's ops are not what bounds a step)"))
    sdpa_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = Field("auto", description=(
        "the scaled-dot-product attention kernel a CUDA worker's steps use (and its captured graphs freeze): "
        "only that one enabled; `auto`: torch's own choice among its defaults. job.log's `worker_ready` line "
        "says which were enabled. Nothing on the CPU"))
    prefill_chunk_tokens: int = Field(PREFILL_CHUNK_TOKENS, ge=0, description=(
        "tokens of a joining sequence's prompt that ride each decode step (its chunk beside the decode rows "
        "in one forward pass), so a long prompt does not stall the batch; 0: each prompt is prefilled whole "
        "(in `summarize.prefill_chunk_size` chunks) before it joins. Tiered rungs, transformers' own cache implementations, `cache.prefill: layer-major` "
        "and sliding-window models always prefill whole; a prompt prefilled whole (alone, or on those) goes in "
        "chunks of this many tokens too, so its tokens are the same whether it rode or not"))

    @field_validator("max_sequences")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if v != "auto" and not 0 < v <= MAX_SEQUENCES:
            raise ValueError(f"must be a number of sequences from 1 to {MAX_SEQUENCES}, or 'auto'")
        return v

    @property
    def sequences(self) -> int:
        return AUTO_MAX_SEQUENCES if self.max_sequences == "auto" else self.max_sequences


class CheckpointConfig(_Section):
    """How task events are batched into `JOB_DIR/events/`: a finished document's result and a finished pass
    are published as they end, before job.log or the progress bar says so, so a kill loses only work in flight."""

    flush_every: int = Field(32, gt=0, description=(
        "task events (running, retrying) buffered before a Parquet part is published; a result or a pass takes them along"))
    flush_interval_s: float = Field(5.0, gt=0, le=86400, description=(
        "seconds (at most a day) after which buffered task events are published anyway"))


class InputConfig(_Section):
    """What a manifest row may point at."""

    documents_root: str | None = Field(None, description=(
        "folder every `path` must resolve inside (symlinks followed); `null`: anywhere"))
    max_document_bytes: int = Field(50_000_000, gt=0, le=MAX_DOCUMENT_BYTES, description=(
        "bytes above which a document is rejected from its size, unread (a DOCX from its expanded size); at "
        f"most {MAX_DOCUMENT_BYTES:,}, the most one stored text value holds"))


class JobConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    summarize: SummarizeConfig = Field(default_factory=SummarizeConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    input: InputConfig = Field(default_factory=InputConfig)


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true/false (True, TRUE, False, FALSE); YAML 1.1's
    yes/no/on/off stay strings, so `static_step: on` is the word the docs name."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def looks_like_path(name: str) -> bool:
    """A model name that is a local folder: written like a path, or existing on disk (as transformers
    decides); `builtin:...` names and hub ids (`org/name`) that are no folder here are not."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or os.path.exists(name)


def absolute_path(path: str) -> str:
    """`path` from the working directory (and `~`) made absolute, symlinks kept as written."""
    return os.path.abspath(os.path.expanduser(path))


def max_answer_tokens(context_tokens: int) -> int:
    """The most `max_new_tokens` a pass of `context_tokens` may give the answer: half, the rest holds
    the prompt and the document (or the partial summaries a merge pass joins)."""
    return context_tokens // 2


def _check_expansion(data: Any, source: str) -> None:
    """Refuse a config that refers to itself or expands to more than MAX_CONFIG_VALUES values (YAML
    aliases), before validation or a message copies it out."""
    counted = 0

    def visit(node: Any, key: str, inside: frozenset[int]) -> None:
        nonlocal counted
        if not isinstance(node, (dict, list)):
            return
        if id(node) in inside:
            raise ConfigError(f"invalid config ({source}): {key} contains itself (a circular YAML alias): "
                              "write the value out instead")
        counted += len(node)
        if counted > MAX_CONFIG_VALUES:
            raise ConfigError(f"invalid config ({source}): it expands to more than {MAX_CONFIG_VALUES:,} values "
                              f"(at {key}; YAML aliases repeated inside each other?): write the values out")
        for child_key, child in (node.items() if isinstance(node, dict) else enumerate(node)):
            visit(child, f"{key}.{child_key}" if key else str(child_key), inside | {id(node)})

    visit(data, "", frozenset())


def _key_name(loc: tuple[Any, ...]) -> str:
    """A dotted key as messages show it: control characters escaped (repr), so it stays on one line."""
    key = ".".join(str(p) for p in loc)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in key)


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = _key_name(e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{key}': remove it or check its spelling")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """The CLI's `--set a.b=value` items as settings (`apply_settings`): each value read as YAML 1.2, so
    numbers and lists work."""
    settings: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set '{item}': expected key=value, e.g. --set cache.strategy=tiered-disk")
        dotted = key.strip()
        try:
            _check_unique_keys(yaml.compose(raw, Loader=_Yaml12Loader), f"--set '{item}'", dotted)
            settings[dotted] = yaml.load(raw, Loader=_Yaml12Loader) if raw.strip() else ""
        except yaml.YAMLError:
            settings[dotted] = raw
    return settings


def apply_settings(data: dict[str, Any], settings: Mapping[str, Any], how: str = "--set") -> dict[str, Any]:
    """Set dotted keys (`{"summarize.max_new_tokens": 64}`) in a raw config mapping, the values as they
    are (validation happens afterwards); `how` names them in an error (`--set`, or the API's `settings`)."""
    for key, value in settings.items():
        path = key.split(".") if isinstance(key, str) else []
        if not all(part.strip() for part in path):
            raise ConfigError(f"{how} {key!r}: a key is section.key, e.g. cache.strategy")
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{how} '{key}': '{part}' is not a config section")
            node = child
        node[path[-1]] = value
    return data


RETIRED_KEYS = (("batch", "spread_passes"),)
"""Keys an earlier kvbatch wrote into a job's saved config that no longer exist: a resume drops them
(the job folder is the user's work); a config file or --set naming one is refused like any unknown key."""


def without_retired_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A job's saved config (job.json) without `RETIRED_KEYS`, so an older job folder still resumes."""
    data = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for section, key in RETIRED_KEYS:
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    return data


def config_from_dict(data: dict[str, Any], source: str = "config") -> JobConfig:
    _check_expansion(data, source)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def _check_unique_keys(node: yaml.Node | None, source: str, key: str = "",
                       seen_nodes: set[int] | None = None) -> None:
    """YAML lets a later key replace an earlier one silently (a second `summarize:` section dropped the
    first one's settings): a key twice in one mapping is an error naming it and both lines. A node an
    alias reaches again is checked once (an alias bomb or a circular alias stays cheap)."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, source, f"{key}.{i}" if key else str(i), seen_nodes)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[Any, int] = {}
    for key_node, value_node in node.value:
        name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        dotted = _key_name((key, name) if key else (name,))
        if name is not None and name != "<<":  # "<<" merges an anchored mapping in: no key of its own
            line = key_node.start_mark.line + 1
            if name in seen:
                raise ConfigError(f"{source}: key '{dotted}' appears twice (lines {seen[name]} and {line}), "
                                  "and YAML would keep only the last: merge them into one")
            seen[name] = line
        _check_unique_keys(value_node, source, dotted, seen_nodes)


def _read_config_file(path: str | Path) -> bytes:
    """The bytes of config file `path`, a regular file of at most MAX_CONFIG_BYTES, checked on the file opened
    without blocking and read with a bound, so a device, a FIFO or a swapped file is refused at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"config file {path} is not a regular file (a folder, FIFO or device): "
                                  "give -c a YAML file")
            with open(fd, "rb", closefd=False) as file:
                data = file.read(MAX_CONFIG_BYTES + 1)  # buffered: until that many bytes or the end
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB, more than any config "
                          "holds: give -c the YAML file of settings")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML config (defaults when `path` is None) with the CLI's `--set key=value` text."""
    return read_config(path, parse_overrides(overrides or []))


def read_config(path: str | os.PathLike[str] | None = None, settings: Mapping[str, Any] | None = None,
                how: str = "--set") -> JobConfig:
    """Read a YAML config (defaults when `path` is None) and set `settings` in it (dotted key -> value,
    as given: what `load_config` parses the CLI's text into, or the API's `settings`, named by `how`)."""
    data: dict[str, Any] = {}
    source = "defaults" if path is None else str(path)
    if path is not None:
        try:
            text = _read_config_file(path).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {path} is not valid UTF-8 (byte offset {e.start}): save it as UTF-8"
            ) from None
        try:
            _check_unique_keys(yaml.compose(text, Loader=_Yaml12Loader), f"config file {path}")
            loaded = yaml.load(text, Loader=_Yaml12Loader)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        data = {} if loaded is None else loaded
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must be a mapping of sections (model:, cache:, ...)")
    if settings:
        data = apply_settings(data, settings, how)
        source += f" with {how} " + " ".join(f"{key}={value!r}" for key, value in settings.items())
    return config_from_dict(data, source)
