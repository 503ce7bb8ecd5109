"""A task's finished passes, as its attempts see them: reuse what is done, keep what gets done.

The worker opens one `PassBook` per attempt at a task (storage/passes.py holds the parts). Before a
pass is handed to the scheduler, `find` looks it up by key; after it ends, `keep` publishes it. The
key is a hash of the fingerprint (the model and every setting that decides a pass's tokens, nothing
that only decides where its KV lives or how its prompt is prefilled), the prompt's token ids and the
new-token limit, so a pass is reused exactly when running it again would give the same tokens: at
the same context all of them; at a shorter one, only passes whose prompt came out the same.
A book can also look again (`find(..., fresh=True)`): what a worker helping with the same document
(batch.spread_passes) has kept since, so a pass either of them finished is not run by the other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jobs.config import JobConfig
from jobs.stopping import StopReason
from runner.engine.generation import Generation
from storage.passes import mark_started, pass_folder, read_passes, tasks_with_passes, write_pass

logger = logging.getLogger(__name__)

#: Summarize settings that do not decide a pass's tokens once its prompt ids are known (the prompt and
#: max_new_tokens are in the key itself; the context and overlap only shape which prompts there are).
_NOT_IN_FINGERPRINT = frozenset({"prompt", "max_new_tokens", "context_tokens", "min_context_tokens",
                                 "chunk_overlap_tokens", "prefill_chunk_size"})


def settings_fingerprint(config: JobConfig, device_type: str, dtype: str) -> str:
    """What decides a pass's tokens besides its prompt: the model as loaded and the generation settings."""
    summarize = {k: v for k, v in config.summarize.model_dump(mode="json").items() if k not in _NOT_IN_FINGERPRINT}
    decisive = {"model": config.model.model_dump(mode="json"), "device": device_type, "dtype": dtype,
                "summarize": summarize}
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def job_folder_seen(job_dir: str | None, job_host: str | None) -> tuple[str | None, str | None]:
    """The job folder this process keeps passes in, or None and why not. A local folder (`job_host`
    set) is seen on its host only; a store that fails one listing now (an endpoint or credentials
    the worker lacks) is not tried again at every pass."""
    if job_dir is None:
        return None, "no job folder: an engine run outside a job"
    if job_host not in (None, socket.gethostname()):
        return None, f"the job folder is local to host {job_host}"
    try:
        tasks_with_passes(job_dir)
    except OSError as e:
        return None, str(e)
    return job_dir, None


class PassBook:
    """One attempt's view of a task's passes; `job_dir` None keeps nothing (an engine run outside a job)."""

    def __init__(self, job_dir: str | None, task_id: str, doc_id: str, context_tokens: int, fingerprint: str,
                 decode: Callable[[list[int]], str], worker: str) -> None:
        self._job_dir = job_dir
        self._task_id, self._doc_id = task_id, doc_id
        self._context_tokens = context_tokens
        self._fingerprint = fingerprint
        self._decode = decode
        self._worker = worker
        self._lock = threading.Lock()  # the task's thread finds and keeps; the scheduler's finds afresh
        self._parts: frozenset[str] = frozenset()
        self._started: frozenset[str] = frozenset()  # keys marked started, as of the last listing
        self._marked: set[str] = set()  # keys this book marked started
        self._known = self._read() if job_dir else {}
        self.kept = 0  # passes this book published

    @classmethod
    def kept_nowhere(cls) -> PassBook:
        """A book that finds and keeps nothing: the engine run outside a job."""
        return cls(None, "", "", 0, "", str, "")

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            self._parts, self._started = pass_folder(self._job_dir, self._task_id)
            known = read_passes(self._job_dir, self._task_id)
        except OSError as e:
            self._give_up(e)
            return {}
        return {key: row for key, row in known.items() if row["fingerprint"] == self._fingerprint}

    def _look_again(self) -> None:
        """Read the parts again when the folder has changed since (one listing when it has not)."""
        try:
            parts, self._started = pass_folder(self._job_dir, self._task_id)
        except OSError as e:
            self._give_up(e)
            return
        if parts != self._parts:
            self._known.update(self._read())

    def _give_up(self, error: OSError) -> None:
        """The job folder failed: the rest of this attempt keeps and finds nothing. Passes only save
        time, and a store that does not answer costs seconds a call (on the scheduler's thread)."""
        logger.warning("passes of %s not kept from here on, the job folder failed: %s", self._doc_id, error)
        self._job_dir = None

    def key(self, prompt_ids: list[int], max_new_tokens: int) -> str:
        digest = hashlib.sha256(self._fingerprint.encode())
        digest.update(json.dumps([max_new_tokens, prompt_ids]).encode())
        return digest.hexdigest()

    def find(self, prompt_ids: list[int], max_new_tokens: int, fresh: bool = False) -> Generation | None:
        """The pass's generation when an earlier attempt, or (`fresh`: looking again) another worker
        since, finished it; no timings: it took none now."""
        key = self.key(prompt_ids, max_new_tokens)
        with self._lock:
            if fresh and key not in self._known and self._job_dir is not None:
                self._look_again()
            row = self._known.get(key)
        if row is None:
            return None
        return Generation(tokens=list(row["tokens"]), input_tokens=len(prompt_ids), ttft_s=0.0, decode_s=0.0,
                          stop_reason=StopReason(row["stop_reason"]), reused=True)

    def started_elsewhere(self, prompt_ids: list[int], max_new_tokens: int) -> bool:
        """Whether another worker marked the pass started, as of the last look (`find(..., fresh=True)`)."""
        key = self.key(prompt_ids, max_new_tokens)
        with self._lock:
            return key in self._started and key not in self._marked

    def mark_started(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Say the pass begins here, so a worker helping with the task leaves it to this one."""
        if self._job_dir is None:
            return
        key = self.key(prompt_ids, max_new_tokens)
        try:
            mark_started(self._job_dir, self._task_id, key)
        except OSError as e:  # the helper may run it too: time, not tokens
            self._give_up(e)
            return
        with self._lock:
            self._marked.add(key)

    def keep(self, level: int, index: int, prompt_ids: list[int], max_new_tokens: int, generation: Generation) -> None:
        """Publish a pass that just ended; a failed write only means it runs again if it is needed again."""
        if self._job_dir is None:
            return
        key = self.key(prompt_ids, max_new_tokens)
        row = {"task_id": self._task_id, "doc_id": self._doc_id, "key": key, "fingerprint": self._fingerprint,
               "level": level, "index": index, "context_tokens": self._context_tokens,
               "prompt_tokens": len(prompt_ids), "tokens": generation.tokens,
               "text": self._decode(generation.tokens), "stop_reason": str(generation.stop_reason),
               "worker": self._worker, "finished_at": time.time()}
        try:
            part = write_pass(self._job_dir, row)
        except OSError as e:
            self._give_up(e)
            return
        with self._lock:
            self._known[key] = row  # another rung of this attempt finds it too
            self._parts |= {part.name}  # no need to read back what this book wrote
            self.kept += 1
