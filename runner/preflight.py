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
    "max_length": "summarize.max_new_tokens (generate() counts max_length from it, whatever max_length says)",
    "do_sample": "summarize.do_sample",
    "prefill_chunk_size": "summarize.prefill_chunk_size",
    "pad_token_id": "the tokenizer (its pad token, else its end-of-sequence token)",
}
_ONE_SEQUENCE = "kvbatch decodes one sequence per document into its own KV cache and keeps only the tokens"
_ANOTHER_LOOP = ("it selects another decoding loop (beam, constrained, contrastive, DoLa, assisted or speculative "
                 "decoding) than the one-token-a-step decode that batched sequences share")
#: Fields the batched decode cannot honour, and why: each is refused at submit. Every other field of
#: GenerationConfig gives in the batched path the tokens generate() gives alone (tests/test_generation_fields.py).
UNSUPPORTED_FIELDS = {
    **dict.fromkeys(("num_beams", "num_beam_groups", "num_return_sequences", "use_cache", "cache_implementation",
                     "cache_config", "max_cache_len", "return_dict_in_generate", "output_attentions",
                     "output_hidden_states", "output_scores", "output_logits", "low_memory"), _ONE_SEQUENCE),
    **dict.fromkeys(("early_stopping", "length_penalty", "diversity_penalty", "constraints", "force_words_ids",
                     "penalty_alpha", "dola_layers", "assistant_confidence_threshold", "assistant_early_exit",
                     "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight", "is_assistant",
                     "num_assistant_tokens", "num_assistant_tokens_schedule", "prompt_lookup_num_tokens",
                     "max_matching_ngram_size", "speculation_type", "use_mtp"), _ANOTHER_LOOP),
    **dict.fromkeys(("compile_config", "continuous_batching_config"),
                    "the batched decode step runs its own forward pass over every sequence, not generate()'s "
                    "compiled or continuous-batching one"),
    "token_healing": "it rewrites the prompt's last tokens inside generate(), after the worker has prefilled them",
}


def check_settings(config: JobConfig) -> None:
    check_generation(config.summarize)
    check_context(config)


def check_generation(settings: SummarizeConfig) -> None:
    """`summarize.generation` holds GenerationConfig fields that transformers accepts together."""
    from transformers import GenerationConfig

    known = {name for name in GenerationConfig().to_dict() if not name.startswith("_")} - {"transformers_version"}
    for name in settings.generation:
        key = f"summarize.generation.{name}"
        if name in OWNED_FIELDS:
            raise ConfigError(f"{key}: kvbatch sets it from {OWNED_FIELDS[name]}; set it there and remove {key}")
        if name in UNSUPPORTED_FIELDS:
            raise ConfigError(f"{key} is not supported: {UNSUPPORTED_FIELDS[name]}; remove it")
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
