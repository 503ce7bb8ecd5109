"""The pass: the unit of work that crosses Ray, and what a finished one is (docs/design.md).

A worker plans a level (`LevelPlan`: one `PassSpec` a pass), any worker runs a spec, and the finished pass
comes back as a `PassRow`. A pass's key hashes everything that decides its tokens and nothing that only
decides where its KV lives, so a kept pass is reused exactly when running it again gives the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TypedDict

from jobs.config import JobConfig

#: Summarize settings that do not decide a pass's tokens once its prompt ids are known (the prompt and
#: max_new_tokens are in the key itself; the context and overlap only shape which prompts there are).
_NOT_IN_FINGERPRINT = frozenset({"prompt", "max_new_tokens", "context_tokens", "min_context_tokens",
                                 "chunk_overlap_tokens", "prefill_chunk_size", "trim_to_sentence"})


def settings_fingerprint(config: JobConfig, device_type: str, dtype: str) -> str:
    """What decides a pass's tokens besides its prompt: the model as loaded and the generation settings."""
    summarize = {k: v for k, v in config.summarize.model_dump(mode="json").items() if k not in _NOT_IN_FINGERPRINT}
    decisive = {"model": config.model.model_dump(mode="json"), "device": device_type, "dtype": dtype,
                "summarize": summarize}
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def pass_key(fingerprint: str, prompt_ids: list[int], max_new_tokens: int) -> str:
    """A pass's name in the job folder: the same exactly when running it again gives the same tokens."""
    digest = hashlib.sha256(fingerprint.encode())
    digest.update(json.dumps([max_new_tokens, list(prompt_ids)]).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class PassSpec:
    """One pass to run, as a worker planned it: whichever worker runs it needs nothing else."""

    task_id: str
    doc_id: str
    key: str
    fingerprint: str
    level: int  # 0: the chunks; then each merge round
    index: int  # its place among its level's passes
    context_tokens: int  # the context its level was planned for
    prompt: tuple[int, ...]  # its prompt's token ids
    max_new_tokens: int
    final: bool  # its summary is the document's (the only pass of the last level)


@dataclass(frozen=True)
class LevelPlan:
    """One level of a document's passes. `groups` are the previous level's parts in order (ranges of
    their indices): each range of two or more is merged by one spec, in order; a range of one is
    carried over as it is. Level 0 has one group a chunk and one spec each."""

    specs: tuple[PassSpec, ...]
    groups: tuple[tuple[int, int], ...]
    input_tokens: int = 0  # the document's tokens (level 0)


class PassRow(TypedDict):
    """One finished pass, as a worker hands it back and as it is kept (jobs.schema.PASS_SCHEMA)."""

    task_id: str
    doc_id: str
    key: str
    fingerprint: str
    level: int
    index: int
    context_tokens: int  # the context its plan was made for
    prompt_tokens: int
    tokens: list[int]  # what it generated
    text: str  # those tokens decoded
    stop_reason: str  # jobs.stopping.StopReason
    worker: str  # the "host:pid" that ran it
    finished_at: float
    prefill_s: float | None  # how long it took there (None: kept by an older tree), so a timeline can place it
    decode_s: float | None
    batch_size: float | None
