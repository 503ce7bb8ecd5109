"""The job configuration: one validated schema shared by the CLI, the coordinator and workers.

Unknown keys are errors (a typo must not silently fall back to a default), and every error
names the dotted key so the user knows what to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jobs.rungs import STRATEGIES

DEFAULT_GENERATION: dict[str, Any] = {"no_repeat_ngram_size": 4}
"""summarize.generation's default (configs/default.yaml says the same)."""

DEFAULT_PROMPT = (
    "Summarise the following document in a few sentences. "
    "Say what it is, who it concerns and what it requires or allows."
)


class ConfigError(ValueError):
    """A config file, key or value the user must fix; the message says which and how."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["none", "bnb-8bit", "bnb-4bit", "torchao-int8", "torchao-int4"]


class ModelConfig(_Section):
    name: str = "builtin:smollm2-135m"
    dtype: Dtype = "auto"
    device: str = "auto"
    attn_implementation: str = "sdpa"
    # weights loaded through transformers' own quantizers (runner/engine/quantization.py); a checkpoint
    # that is quantized already loads as it is, with `none`
    quantization: Quantization = "none"
    # what bnb-4bit dequantises to for its matmuls; auto: model.dtype
    quantization_compute_dtype: Dtype = "auto"


class LoopStopConfig(_Section):
    """A sequence that ends in `repeats` back-to-back copies of one block of `ngram` to `max_period`
    tokens, or whose last `window` tokens are near-copies of earlier text (at least `window_share` of
    their `ngram`-grams occurred before), stops there, and what came after the first copy is cut
    (jobs/stopping.py). `window: 0` turns the near-copy rule off."""

    enabled: bool = True
    ngram: int = Field(4, gt=0)
    repeats: int = Field(3, ge=2)
    max_period: int = Field(64, gt=0)
    window: int = Field(32, ge=0)
    window_share: float = Field(0.6, gt=0.0, le=1.0)

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
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = Field(200, gt=0)
    context_tokens: int = Field(8192, gt=0)
    min_context_tokens: int = Field(1024, gt=0)
    chunk_overlap_tokens: int = Field(64, ge=0)
    prefill_chunk_size: int = Field(512, ge=0)
    do_sample: bool = False
    seed: int = 0
    # transformers GenerationConfig fields passed to generate(), e.g. repetition_penalty: 1.15;
    # checked against transformers at submit (runner/preflight.py). The default bans a 4-gram the
    # sequence already holds: the builtin model's greedy summaries looped or reused phrases in up to
    # 69 % of their 4-grams (docs/benchmarks.md, "Summaries that end"); `{}` turns it off
    generation: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_GENERATION))
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
    strategy: str = "auto"
    ladder: list[str] = Field(default_factory=lambda: ["dynamic", "tiered-host", "tiered-disk"])
    device_kv_budget_bytes: ByteBudget = "auto"
    host_kv_budget_bytes: ByteBudget = "auto"
    offload_root: str | None = None
    block_tokens: int = Field(512, gt=0)
    compression: Literal["zstd", "none"] = "zstd"
    zstd_level: int = Field(1, ge=-7, le=22)
    shuffle: bool = True
    # layer-major: prefill a layer at a time, so a tiered cache reads the prompt's KV back once (for its
    # last chunk), not once per chunk; auto: that for tiered caches on covered models (runner/engine/kvcache/layer_major.py)
    prefill: PrefillMode = "auto"

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
        unknown = [name for name in v if name not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown cache strategy {unknown}; choose from {sorted(STRATEGIES)}")
        return v


class RetryConfig(_Section):
    max_attempts: int = Field(3, gt=0)
    backoff_initial_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(60.0, ge=0)
    context_shrink: float = Field(0.5, gt=0, lt=1)
    task_timeout_s: float = Field(3600.0, gt=0)


class WorkersConfig(_Section):
    count: int | Literal["auto"] = "auto"
    gpus_per_worker: float = Field(1.0, ge=0)
    cpus_per_worker: float = Field(1.0, gt=0)
    # how long a worker may take to be placed, start and load its model before the batch gives up on it
    start_timeout_s: float = Field(300.0, gt=0)

    @field_validator("count")
    @classmethod
    def _positive_count(cls, v: int | str) -> int | str:
        if v != "auto" and v <= 0:
            raise ValueError("must be a positive number of workers or 'auto'")
        return v


AUTO_MAX_SEQUENCES = 16
"""`batch.max_sequences: auto`: this many; admission lets fewer decode together when the budgets hold fewer."""


class BatchConfig(_Section):
    # sequences (documents, map chunks, merge passes) sharing a worker's decode steps; the worker also
    # keeps that many tasks in flight, and admits a sequence only while the batch's device and host KV
    # fit the worker's budgets (a memory error lowers the limit for a while: jobs/batch_limit.py)
    max_sequences: int | Literal["auto"] = "auto"
    # how a decode step attends: one call per layer over the worker's KV pool (device-resident rows),
    # or each row over its own cache; auto picks by device (jobs/attention.py)
    attention: Literal["auto", "pooled", "per-row"] = "auto"

    @field_validator("max_sequences")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if v != "auto" and v <= 0:
            raise ValueError("must be a positive number of sequences or 'auto'")
        return v

    @property
    def sequences(self) -> int:
        return AUTO_MAX_SEQUENCES if self.max_sequences == "auto" else self.max_sequences


class CheckpointConfig(_Section):
    flush_every: int = Field(32, gt=0)
    flush_interval_s: float = Field(5.0, gt=0)


class InputConfig(_Section):
    documents_root: str | None = None
    max_document_bytes: int = Field(50_000_000, gt=0)


class JobConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    summarize: SummarizeConfig = Field(default_factory=SummarizeConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    input: InputConfig = Field(default_factory=InputConfig)


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


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value), the value read as YAML so numbers and lists work."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set '{item}': expected key=value, e.g. --set cache.strategy=tiered-disk")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `--set` overrides to a raw config mapping (validation happens afterwards)."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set '{item}': '{part}' is not a config section")
            node = child
        node[path[-1]] = value
    return data


def config_from_dict(data: dict[str, Any], source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML config (defaults when `path` is None) and apply `--set` overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {path} is not valid UTF-8 (byte offset {e.start}): save it as UTF-8"
            ) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must be a mapping of sections (model:, cache:, ...)")
        data = loaded
    if overrides:
        data = apply_overrides(data, overrides)
        source += " with --set " + " ".join(overrides)
    return config_from_dict(data, source)
