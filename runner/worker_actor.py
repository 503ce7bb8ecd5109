"""The Ray actor class of a batch's workers: a thin front to `runner.engine.worker.SummaryWorker`.

Ray pickles an actor class by reference, so the process creating the actors imports its module; this
one does not import torch and transformers (seconds), so `kvbatch submit` leaves that to the workers.
"""

from __future__ import annotations

from typing import Any

from jobs.outcome import CallOutcome
from jobs.passes import PassSpec
from jobs.task import Task


class WorkerActor:
    """Each method hands its call to the worker built in this process; see `SummaryWorker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from runner.engine.worker import SummaryWorker

        self._worker = SummaryWorker(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        return self._worker.info()

    def progress(self, call_id: str) -> float | None:
        return self._worker.progress(call_id)

    def tokens_decoded(self) -> int:
        return self._worker.tokens_decoded()

    def plan(self, task: Task, context_tokens: int) -> CallOutcome:
        return self._worker.plan(task, context_tokens)

    def plan_merge(self, task: Task, level: int, texts: list[str], context_tokens: int) -> CallOutcome:
        return self._worker.plan_merge(task, level, texts, context_tokens)

    def run_pass(self, spec: PassSpec, attempt: int, call_id: str = "") -> CallOutcome:
        return self._worker.run_pass(spec, attempt, call_id)
