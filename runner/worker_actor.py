"""The Ray actor class of a batch's workers: a thin front to `runner.engine.worker.SummaryWorker`.

Ray pickles an actor class by reference, so the process that creates the actors imports its module.
`SummaryWorker`'s module imports torch and transformers (seconds of start-up); this one does not, so
`kvbatch submit` starts its workers without paying for them first: only the workers' processes do.
"""

from __future__ import annotations

from typing import Any

from jobs.outcome import DealtPass, TaskOutcome
from jobs.task import Task
from storage.passes import PassRow


class WorkerActor:
    """Each method hands its call to the worker built in this process; see `SummaryWorker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from runner.engine.worker import SummaryWorker

        self._worker = SummaryWorker(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        return self._worker.info()

    def progress(self, call_id: str, wait_s: float = 0.0) -> tuple[float | None, list[PassRow]]:
        return self._worker.progress(call_id, wait_s)

    def tokens_decoded(self) -> int:
        return self._worker.tokens_decoded()

    def first_level(self, task: Task, context_tokens: int) -> list[DealtPass]:
        return self._worker.first_level(task, context_tokens)

    def run(self, task: Task, attempt: int, context_tokens: int, kept: list[PassRow], call_id: str = "",
            dealt: set[str] | None = None, dealt_pass: DealtPass | None = None,
            ) -> tuple[TaskOutcome, list[PassRow]]:
        return self._worker.run(task, attempt, context_tokens, kept, call_id, dealt, dealt_pass)
