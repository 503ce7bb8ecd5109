"""Settings checked at submit (and resume) against transformers and the model's config, not per document.

A setting that would fail every document (an unknown generation field, a context the model has no
positions for) is a config error before anything starts. Only the model's config is read, never
its weights.
"""

from __future__ import annotations

from typing import Any

from jobs.config import ConfigError, JobConfig, SummarizeConfig

#: GenerationConfig fields kvbatch sets itself, and where the user sets them instead.
OWNED_FIELDS = {
    "max_new_tokens": "summarize.max_new_tokens (or a manifest row's max_new_tokens)",
    "do_sample": "summarize.do_sample",
    "prefill_chunk_size": "summarize.prefill_chunk_size",
    "pad_token_id": "the tokenizer (its pad token, else its end-of-sequence token)",
}
#: Fields that would change what the KV cache ladder holds or what a pass returns: one sequence, tokens only.
UNSUPPORTED_FIELDS = frozenset({
    "num_beams", "num_beam_groups", "num_return_sequences", "use_cache", "cache_implementation",
    "cache_config", "max_cache_len", "return_dict_in_generate", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "low_memory",
})


def check_settings(config: JobConfig) -> None:
    check_generation(config.summarize)
    check_context(config)
    check_quantization(config)


def check_generation(settings: SummarizeConfig) -> None:
    """`summarize.generation` holds GenerationConfig fields that transformers accepts together."""
    from transformers import GenerationConfig

    known = {name for name in GenerationConfig().to_dict() if not name.startswith("_")} - {"transformers_version"}
    for name in settings.generation:
        key = f"summarize.generation.{name}"
        if name in OWNED_FIELDS:
            raise ConfigError(f"{key}: kvbatch sets it from {OWNED_FIELDS[name]}; set it there and remove {key}")
        if name in UNSUPPORTED_FIELDS:
            raise ConfigError(
                f"{key} is not supported: kvbatch decodes one sequence per document into its own KV cache "
                "and keeps only the tokens; remove it"
            )
        if name not in known:
            raise ConfigError(
                f"unknown key '{key}': not a field of transformers' GenerationConfig; check its spelling "
                "(e.g. repetition_penalty, no_repeat_ngram_size, temperature, top_p, top_k)"
            )
    fields: dict[str, Any] = {"do_sample": settings.do_sample, **settings.generation}
    try:
        GenerationConfig(**fields).validate(strict=True)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"summarize.generation is not a valid generation config: {e}") from None


def check_context(config: JobConfig) -> None:
    """`summarize.context_tokens` within the model's position embeddings (when its config can be read)."""
    from runner.engine.models import model_max_positions

    limit = model_max_positions(config.model)
    if limit is not None and config.summarize.context_tokens > limit:
        raise ConfigError(
            f"summarize.context_tokens ({config.summarize.context_tokens}) is above the "
            f"max_position_embeddings ({limit}) of model {config.model.name}: set summarize.context_tokens "
            f"to {limit} or less (longer documents are summarised in chunks)"
        )


def check_quantization(config: JobConfig) -> None:
    """`model.quantization` runs with the installed libraries on the configured device, and is not asked
    of a checkpoint quantized already."""
    from runner.engine.models import ModelLoadError, model_quantization, resolve_device
    from runner.engine.quantization import NONE, unavailable

    method = config.model.quantization
    if method == NONE:
        return
    try:
        device_type = resolve_device(config.model.device).type
    except ModelLoadError as e:
        raise ConfigError(str(e)) from None
    reason = unavailable(method, device_type)
    if reason is not None:
        raise ConfigError(f"model.quantization {method} {reason}; or set model.quantization to none")
    checkpoint = model_quantization(config.model)
    if checkpoint is not None:
        raise ConfigError(
            f"model.quantization {method}: model {config.model.name} is quantized already ({checkpoint}) "
            "and loads as it is: set model.quantization to none"
        )
