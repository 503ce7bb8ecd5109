"""A task's finished passes, as its attempts see them: reuse what is done, keep what gets done.

The worker opens one `PassBook` per attempt at a task, with the passes the coordinator handed in
(storage/passes.py holds them in the job folder). Before a pass is handed to the engine, `find`
looks it up by key; after it ends, `keep` holds it for the coordinator to collect. The
key is a hash of the fingerprint (the model and every setting that decides a pass's tokens, nothing
that only decides where its KV lives or how its prompt is prefilled), the prompt's token ids and the
new-token limit, so a pass is reused exactly when running it again would give the same tokens: at
the same context all of them; at a shorter one, only passes whose prompt came out the same.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable

from jobs.config import JobConfig
from jobs.stopping import StopReason
from runner.engine.generation import Generation
from storage.passes import PassRow

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
    digest.update(json.dumps([max_new_tokens, prompt_ids]).encode())
    return digest.hexdigest()


class PassBook:
    """One attempt's view of a task's passes: those handed in (kept by earlier attempts, read back
    from the job folder by the coordinator) and those it finishes, which wait in `handed_back` until
    the coordinator collects them. It never touches the job folder."""

    def __init__(self, kept: list[PassRow], task_id: str, doc_id: str, context_tokens: int, fingerprint: str,
                 decode: Callable[[list[int]], str], worker: str, dealt: set[str] | None = None) -> None:
        """`dealt`: the keys of the kept passes that ran as passes dealt out for this attempt."""
        self._task_id, self._doc_id = task_id, doc_id
        self._context_tokens = context_tokens
        self._fingerprint = fingerprint
        self._decode = decode
        self._worker = worker
        self._lock = threading.Lock()  # the task's thread keeps; the probe thread collects
        self._collected = threading.Condition(self._lock)
        self._known = {row["key"]: row for row in kept if row["fingerprint"] == fingerprint}
        self._dealt = set(dealt or ())
        self._finished: list[PassRow] = []  # kept here, not yet handed back
        self._unconfirmed = False  # passes were handed back; the coordinator's next question says they arrived
        self._closed = False  # the attempt has ended: a waiting `handed_back` answers at once

    @classmethod
    def empty(cls) -> PassBook:
        """A book with nothing kept before: the engine run outside a job."""
        return cls([], "", "", 0, "", str, "")

    def key(self, prompt_ids: list[int], max_new_tokens: int) -> str:
        return pass_key(self._fingerprint, prompt_ids, max_new_tokens)

    def find(self, prompt_ids: list[int], max_new_tokens: int) -> Generation | None:
        """The pass's generation when it was finished before: by a pass dealt out for this attempt (its
        timings count here, once) or by an earlier attempt or run (no timings: it took none now)."""
        key = self.key(prompt_ids, max_new_tokens)
        with self._lock:
            row = self._known.get(key)
            dealt = key in self._dealt
            self._dealt.discard(key)
        if row is None:
            return None
        tokens, stop_reason = list(row["tokens"]), StopReason(row["stop_reason"])
        if dealt:
            return Generation(tokens=tokens, input_tokens=len(prompt_ids), ttft_s=row["prefill_s"],
                              decode_s=row["decode_s"], batch_size=row["batch_size"], stop_reason=stop_reason)
        return Generation(tokens=tokens, input_tokens=len(prompt_ids), ttft_s=0.0, decode_s=0.0,
                          stop_reason=stop_reason, reused=True)

    def keep(self, level: int, index: int, prompt_ids: list[int], max_new_tokens: int, generation: Generation) -> None:
        """A pass that just ended: another rung of this attempt finds it, the coordinator collects it."""
        key = self.key(prompt_ids, max_new_tokens)
        row = PassRow(task_id=self._task_id, doc_id=self._doc_id, key=key, fingerprint=self._fingerprint,
                      level=level, index=index, context_tokens=self._context_tokens, prompt_tokens=len(prompt_ids),
                      tokens=generation.tokens, text=self._decode(generation.tokens),
                      stop_reason=str(generation.stop_reason), worker=self._worker, finished_at=time.time(),
                      prefill_s=generation.ttft_s, decode_s=generation.decode_s, batch_size=generation.batch_size)
        with self._collected:
            self._known[key] = row
            self._finished.append(row)
            self._collected.notify_all()

    def handed_back(self, wait_s: float = 0.0) -> list[PassRow]:
        """The passes finished since the last call, each handed back once; waits up to `wait_s` for
        one to finish (the coordinator's long poll: a pass reaches the job folder as it ends). The
        coordinator asks again only once it has kept the last answer, so a call says that answer
        arrived (a worker dying while it was on its way loses it)."""
        with self._collected:
            self._unconfirmed = False
            self._collected.notify_all()
            self._collected.wait_for(lambda: self._finished or self._closed, wait_s)
            finished, self._finished = self._finished, []
            self._unconfirmed = bool(finished)
        return finished

    def close(self) -> list[PassRow]:
        """The attempt has ended: the passes not handed back yet (they go with the call's result),
        and a waiting `handed_back` answers."""
        with self._collected:
            self._closed = True
            finished, self._finished = self._finished, []
            self._collected.notify_all()
        return finished

    def wait_collected(self, timeout_s: float) -> bool:
        """Wait until the coordinator has collected every finished pass (at most `timeout_s`): what an
        injected crash waits for, so that it strikes after the passes were kept, as the crash it
        rehearses would (jobs/faults.py); whether they were."""
        with self._collected:
            return self._collected.wait_for(lambda: not self._finished and not self._unconfirmed, timeout_s)
