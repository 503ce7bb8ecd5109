"""Settings checked at submit (and resume) against transformers, the model's config and the Ray cluster's
nodes: a setting that would fail every document, or that no worker could run with, is a config error
before anything starts. Only the model's config is read, never its weights, and no worker is started."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from jobs.chunking import SUMMARY_SEPARATOR, merge_room
from jobs.config import ConfigError, JobConfig, SummarizeConfig, looks_like_path, max_answer_tokens
from jobs.manifest import PromptMeasure
from jobs.node_share import workers_that_fit
from jobs.rungs import RUNGS
from runner.engine.model_loader import check_model_name
from runner.engine.model_registry import ModelLoadError
from runner.pool import cluster_nodes, describe_cluster, gpus_per_worker

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
    """Everything that needs neither Ray nor the model's weights."""
    check_model(config)
    check_generation(config.summarize)
    check_token_ids(config)
    check_context(config)
    check_answer_room(config.summarize)
    check_merge_room(config)
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


#: GenerationConfig fields that hold token ids (an int, a list of them, or a list of lists).
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_bos_token_id",
                   "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "bad_words_ids",
                   "force_words_ids")


def _ids_in(value: Any) -> list[Any]:
    return [i for item in value for i in _ids_in(item)] if isinstance(value, (list, tuple)) else [value]


def check_token_ids(config: JobConfig) -> None:
    """Token ids in `summarize.generation` within the model's vocabulary (when its config can be read):
    an id past it fails every document inside the logits processors. A value that is no integer at all
    is transformers' to refuse (inside the task, which then fails at once as a setting error)."""
    from runner.engine.model_loader import model_vocab_size

    fields = {name: config.summarize.generation[name] for name in TOKEN_ID_FIELDS
              if config.summarize.generation.get(name) is not None}
    if not fields:
        return
    vocab = model_vocab_size(config.model)
    for name, value in fields.items():
        for token in _ids_in(value):
            if not isinstance(token, int) or isinstance(token, bool):
                continue
            if token < 0 or (vocab is not None and token >= vocab):
                limit = f"0 to {vocab - 1}" if vocab is not None else "0 or more"
                raise ConfigError(
                    f"summarize.generation.{name}: {token!r} is not a token id of model {config.model.name} "
                    f"(its ids are {limit}): use ids of its tokenizer"
                )


def check_context(config: JobConfig) -> None:
    """`summarize.context_tokens` within the model's position embeddings (when its config can be read)."""
    from runner.engine.model_loader import model_max_positions

    limit = model_max_positions(config.model)
    if limit is not None and config.summarize.context_tokens > limit:
        raise ConfigError(
            f"summarize.context_tokens ({config.summarize.context_tokens}) is above the "
            f"max_position_embeddings ({limit}) of model {config.model.name}: set summarize.context_tokens "
            f"to {limit} or less (longer documents are summarised in chunks)"
        )


def check_model(config: JobConfig) -> None:
    """`model.name` names a model a worker can load; `model.device` is a device name (torch is imported
    for that alone: seconds of a submit's start-up, before any worker starts)."""
    try:
        check_model_name(config.model.name)
    except ModelLoadError as e:
        raise ConfigError(f"model.name: {e}") from None
    spec = config.model.device
    if spec != "auto":
        import torch

        try:
            torch.device(spec)
        except (RuntimeError, ValueError):
            raise ConfigError(f"model.device '{spec}' is not a device: use auto, cpu, cuda or cuda:N") from None


def check_answer_room(settings: SummarizeConfig) -> None:
    """The answer may take at most half the context: the rest holds the prompt and the document (and,
    for a long document, the partial summaries a merge pass joins)."""
    most = max_answer_tokens(settings.context_tokens)
    if settings.max_new_tokens > most:
        raise ConfigError(
            f"summarize.max_new_tokens ({settings.max_new_tokens}) leaves too little of summarize.context_tokens "
            f"({settings.context_tokens}) for the prompt and the document (the answer may take at most half): "
            f"set summarize.max_new_tokens to {most} or less, or summarize.context_tokens "
            f"to {2 * settings.max_new_tokens} or more"
        )


@functools.lru_cache(maxsize=1)
def _tokenizer(name: str) -> Any | None:
    """The model's tokenizer (both builtins use SmolLM2's); None when it cannot be read here (a worker says
    why). Read once for a submit's settings check and its manifest's prompts (half a second each time).
    A fast tokenizer's own file when there is one: `AutoTokenizer` imports torch (through transformers'
    configuration code), which submit's process leaves to the workers (tests/test_submit_startup.py)."""
    from transformers import PreTrainedTokenizerFast

    from runner.engine.model_registry import BUILTIN_PREFIX, smollm2_tokenizer_dir

    try:
        source = (str(smollm2_tokenizer_dir()) if name.startswith(BUILTIN_PREFIX)
                  else str(Path(name).expanduser()) if looks_like_path(name) else name)
        try:
            return PreTrainedTokenizerFast.from_pretrained(source)
        except (OSError, ValueError):  # no tokenizer.json: the model's own tokenizer class
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, ModelLoadError):
        return None


def prompt_measure(config: JobConfig) -> PromptMeasure | None:
    """How a pass's prompt is measured with the model's tokenizer (chat template and margin included): for
    summarize.prompt here, for a manifest row's `prompt` as submit reads the manifest; None when the
    tokenizer cannot be read here (a worker says why)."""
    from runner.engine.prompts import EDGE_MARGIN_TOKENS, prompt_ids

    tokenizer = _tokenizer(config.model.name)
    if tokenizer is None:
        return None
    return PromptMeasure(
        prompt_tokens=lambda instruction: len(prompt_ids(tokenizer, instruction, "")) + EDGE_MARGIN_TOKENS,
        separator_tokens=len(tokenizer(SUMMARY_SEPARATOR, add_special_tokens=False)["input_ids"]),
        max_new_tokens=config.summarize.max_new_tokens,
    )


def check_merge_room(config: JobConfig) -> None:
    """Two partial summaries merge in one pass of the smallest context a document may run at
    (`summarize.min_context_tokens`): else every document longer than one pass runs all its chunk
    passes and then fails (ContextTooSmallError)."""
    measure = prompt_measure(config)
    if measure is None:
        return
    s = config.summarize
    prompt, separator = measure.prompt_tokens(s.prompt), measure.separator_tokens
    room = merge_room(s.min_context_tokens, prompt, s.max_new_tokens, separator)
    if room < 0:
        most = (s.min_context_tokens - prompt - separator) // 3
        raise ConfigError(
            f"summarize.min_context_tokens ({s.min_context_tokens}) cannot hold a merge pass: the prompt "
            f"({prompt} tokens with the chat template) and two partial summaries and an answer of up to "
            f"summarize.max_new_tokens ({s.max_new_tokens}) tokens each need {s.min_context_tokens - room}; raise "
            f"summarize.min_context_tokens (and summarize.context_tokens) to {s.min_context_tokens - room} or more, "
            + (f"or lower summarize.max_new_tokens to {most} or less" if most > 0 else "or shorten summarize.prompt")
        )


def check_cluster(config: JobConfig) -> None:
    """What the connected Ray cluster cannot run, decided from its nodes before any worker starts."""
    nodes = cluster_nodes()
    check_resources(config, nodes)
    check_device(config, nodes)


def check_resources(config: JobConfig, nodes: list[dict[str, float]]) -> None:
    """A worker needs its CPUs and GPUs on one node; `workers.count` workers must fit at once."""
    workers = config.workers
    cpus, gpus = workers.cpus_per_worker, gpus_per_worker(config, nodes)
    cluster = describe_cluster(nodes)
    if workers_that_fit(nodes, cpus, 0) == 0:
        largest = max((n["CPU"] for n in nodes), default=0)
        raise ConfigError(
            f"workers.cpus_per_worker={cpus:g}: no node of the Ray cluster has {cpus:g} CPUs ({cluster}): "
            f"set workers.cpus_per_worker to {largest:g} or less"
        )
    fit = workers_that_fit(nodes, cpus, gpus)
    if fit == 0:
        raise ConfigError(
            f"workers.gpus_per_worker={gpus:g}: no node of the Ray cluster has {gpus:g} GPUs beside "
            f"{cpus:g} CPUs ({cluster}): lower workers.gpus_per_worker or workers.cpus_per_worker"
        )
    if workers.count != "auto" and workers.count > fit:
        raise ConfigError(
            f"workers.count={workers.count}: the Ray cluster holds {fit} worker(s) of {cpus:g} CPUs and "
            f"{gpus:g} GPUs at once ({cluster}): set workers.count to {fit} or less, or auto"
        )


def check_device(config: JobConfig, nodes: list[dict[str, float]]) -> None:
    """`model.device` and a CUDA-only `cache.strategy` against the GPUs Ray gives each worker."""
    spec, strategy = config.model.device, config.cache.strategy
    gpus = gpus_per_worker(config, nodes)
    cluster = describe_cluster(nodes)
    if spec.startswith("cuda"):
        if gpus == 0:
            why = "the Ray cluster has no GPU" if config.workers.gpus_per_worker > 0 else \
                "workers.gpus_per_worker=0 gives the workers none"
            raise ConfigError(
                f"model.device={spec} needs a CUDA GPU, but {why} ({cluster}): set model.device to auto or "
                "cpu, or run on GPU nodes with workers.gpus_per_worker of 1 or a fraction"
            )
        visible = math.ceil(gpus)  # Ray shows a worker only its own GPUs, from cuda:0
        index = int(spec.partition(":")[2] or 0)
        if index >= visible:
            raise ConfigError(
                f"model.device={spec}: each worker sees only the {visible} GPU(s) Ray gives it, as cuda:0"
                f"{f'..cuda:{visible - 1}' if visible > 1 else ''}: set model.device to cuda or auto"
            )
    on_cuda = spec.startswith("cuda") or (spec == "auto" and gpus > 0)
    if strategy != "auto" and RUNGS[strategy].cuda_only and not on_cuda:
        raise ConfigError(
            f"cache.strategy={strategy} is transformers' own offloading, which needs the model on a CUDA "
            f"device; here the workers run on the CPU ({cluster}): use cache.strategy=tiered-host or tiered-disk"
        )
    if strategy == "auto" and not on_cuda and all(RUNGS[r].home == "host" for r in config.cache.ladder):
        raise ConfigError(
            f"cache.ladder {config.cache.ladder}: on CPU workers the host is the device, so rungs that keep "
            f"the KV in host RAM are left out and none is left ({cluster}): add dynamic or tiered-disk"
        )


def check_quantization(config: JobConfig) -> None:
    """`model.quantization` runs with the installed libraries on the configured device, and is not asked
    of a checkpoint quantized already."""
    from runner.engine.model_loader import model_quantization, resolve_device
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
