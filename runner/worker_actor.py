"""The Ray actor class of a batch's workers: a thin front to `runner.engine.worker.SummaryWorker`.

Ray pickles an actor class by reference, so the process that creates the actors imports its module.
`SummaryWorker`'s module imports torch and transformers (seconds of start-up); this one does not, so
`kvbatch submit` starts its workers without paying for them first: only the workers' processes do.
"""

from __future__ import annotations

from typing import Any

from jobs.outcome import TaskOutcome


class WorkerActor:
    """Each method hands its call to the worker built in this process; see `SummaryWorker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from runner.engine.worker import SummaryWorker

        self._worker = SummaryWorker(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        return self._worker.info()

    def running_s(self, call_id: str) -> float | None:
        return self._worker.running_s(call_id)

    def tokens_decoded(self) -> int:
        return self._worker.tokens_decoded()

    def help(self, task_data: dict[str, Any], context_tokens: int, help_id: str, call_id: str = "") -> dict[str, Any]:
        return self._worker.help(task_data, context_tokens, help_id, call_id)

    def end_help(self, help_id: str) -> None:
        self._worker.end_help(help_id)

    def run(self, task_data: dict[str, Any], attempt: int, context_tokens: int, call_id: str = "") -> TaskOutcome:
        return self._worker.run(task_data, attempt, context_tokens, call_id)
