"""Arrow schemas of the job folder: the contract every reader and writer of a job shares."""

from __future__ import annotations

from enum import StrEnum

import pyarrow as pa


class TaskState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    RETRYING = "retrying"
    DONE = "done"
    FAILED = "failed"
    REJECTED = "rejected"


MANIFEST_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("doc_id", pa.string()),
        ("source_type", pa.string()),  # "text" | "path"
        ("source", pa.string()),  # the text itself, or the resolved absolute path
        ("n_chars", pa.int64()),
        ("n_bytes", pa.int64()),
        ("sha256", pa.string()),
        ("overrides", pa.string()),  # JSON object: max_new_tokens, prompt
        ("meta", pa.string()),  # JSON object: every other manifest field
        # added with document formats; null in manifests written before (pq.read_table fills them)
        ("source_format", pa.string()),  # pdf, html, docx, markdown, rst, text
        ("encoding", pa.string()),  # of a text file; null for inline text, PDF and DOCX
    ]
)

EVENT_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("attempt", pa.int32()),
        ("state", pa.string()),
        ("ts", pa.float64()),
        ("worker", pa.string()),
        ("error_type", pa.string()),
        ("error", pa.string()),
        ("context_tokens", pa.int64()),
        ("cache_strategy", pa.string()),
    ]
)

RESULT_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("task_id", pa.string()),
        ("summary", pa.string()),
        ("status", pa.string()),
        ("error_type", pa.string()),
        ("error", pa.string()),
        ("attempts", pa.int32()),
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("context_tokens", pa.int64()),
        ("chunks", pa.int32()),
        ("cache_strategy", pa.string()),
        ("fallbacks", pa.list_(pa.string())),
        ("ttft_s", pa.float64()),
        ("decode_tokens_per_s", pa.float64()),
        ("wall_s", pa.float64()),
        ("peak_device_bytes", pa.int64()),
        ("peak_host_rss_bytes", pa.int64()),
        ("kv_bytes", pa.int64()),
        ("kv_resident_peak_bytes", pa.int64()),
        ("offload_bytes_written", pa.int64()),
        ("offload_bytes_read", pa.int64()),
        ("compression_ratio", pa.float64()),
        ("kv_placement", pa.string()),  # tiered rungs: "resident 15/30 layers, host 15"; null on other rungs
        # mean sequences sharing the task's decode steps, and the share of padded positions in them (0:
        # each sequence attends to its own length)
        ("batch_size", pa.float64()),
        ("padding_share", pa.float64()),
        ("worker", pa.string()),
        ("model", pa.string()),
        ("finished_at", pa.float64()),
        # latency split: waiting for a worker, prompt processing (all passes, first token included), decoding
        ("queue_wait_s", pa.float64()),
        ("prefill_s", pa.float64()),
        ("decode_s", pa.float64()),
        # memory at each stage, on the device (null on CPU) and the worker's host RSS; max over a task's passes
        ("load_device_bytes", pa.int64()),
        ("load_host_rss_bytes", pa.int64()),
        ("prefill_device_bytes", pa.int64()),
        ("prefill_host_rss_bytes", pa.int64()),
        ("decode_peak_device_bytes", pa.int64()),
        ("decode_peak_host_rss_bytes", pa.int64()),
        ("meta", pa.string()),  # JSON of the manifest's metadata; expanded into columns on export
        # what the model was given: the document's format, its text encoding, the extracted text's length
        ("source_format", pa.string()),
        ("encoding", pa.string()),
        ("n_chars", pa.int64()),
        # added with quantized weights and the loop stop: the weights' method ("none", "bnb-4bit", ...,
        # "checkpoint:<method>" for a checkpoint quantized already), and why the summary's pass ended
        # (eos, length, repetition, stop_string)
        ("quantization", pa.string()),
        ("stop_reason", pa.string()),
        # added with checkpointed passes: generate passes the summary took (chunks and merges), and how many
        # of them were finished by an earlier attempt or run and read back from passes/ instead of redone
        ("passes", pa.int32()),
        ("passes_reused", pa.int32()),
        # added with sentence trimming: the words after the summary's last complete sentence, cut off there
        # when its pass ran out of tokens (`summarize.trim_to_sentence`); "" when nothing was cut
        ("summary_tail", pa.string()),
        # added with the static step on every decode step: the share of the document's decode row-steps (a
        # sequence in a decode step, over the passes this attempt ran) that went through the static step
        # (runner/engine/static_step.py); null without a decode step, and in parts written before
        ("static_step_share", pa.float64()),
    ]
)


#: One finished generate pass of a long document (a map chunk or a merge of summaries), kept in
#: `passes/<task_id>/` until the document's result lands, so a kill, a retry or a move to another cache
#: rung or context does not redo it. `key` names what the pass was given (model and generation settings,
#: prompt tokens, new-token limit): a pass is reused exactly when that is the same.
PASS_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("doc_id", pa.string()),
        ("key", pa.string()),  # sha256 of fingerprint, prompt token ids and max_new_tokens
        ("fingerprint", pa.string()),  # sha256 of the model and the settings that decide its tokens
        ("level", pa.int32()),  # 0: the document's chunks; 1, 2, ...: merge rounds of their summaries
        ("index", pa.int32()),  # the pass's place in its level
        ("context_tokens", pa.int64()),  # the context the chunk plan was made for
        ("prompt_tokens", pa.int64()),
        ("tokens", pa.list_(pa.int32())),  # the generated token ids
        ("text", pa.string()),  # what they decode to
        ("stop_reason", pa.string()),
        ("worker", pa.string()),
        ("finished_at", pa.float64()),
        ("prefill_s", pa.float64()),  # its prefill on that worker, first token included; null in parts of older trees
        ("decode_s", pa.float64()),  # its decode there, first token to last
        ("batch_size", pa.float64()),  # mean sequences that shared its decode steps
    ]
)

#: Columns a part must have to be read at all; any other column missing from an older part reads as null.
KEY_COLUMNS = frozenset({"task_id", "doc_id", "status", "attempt", "state"})


def empty_row(schema: pa.Schema) -> dict:
    """A row of `schema` with every field null, to be filled in by the writer."""
    return {name: None for name in schema.names}
