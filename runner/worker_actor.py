"""The Ray actor class of a batch's workers: a thin front to `runner.engine.worker.SummaryWorker`.

Ray pickles an actor class by reference, so the process that creates the actors imports its module.
`SummaryWorker`'s module imports torch and transformers (seconds of start-up); this one does not, so
`kvbatch submit` starts its workers without paying for them first: only the workers' processes do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The `SummaryWorker` methods the pool calls; Ray makes an actor method of each one the class has.
METHODS = ("info", "progress", "tokens_decoded", "plan", "plan_merge", "run_pass")


class WorkerActor:
    """Each method hands its call to the worker built in this process; see `SummaryWorker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from runner.engine.worker import SummaryWorker

        self._worker = SummaryWorker(*args, **kwargs)


def _forward(name: str) -> Callable[..., Any]:
    def method(self: WorkerActor, *args: Any) -> Any:
        return getattr(self._worker, name)(*args)

    method.__name__ = method.__qualname__ = name
    return method


for _name in METHODS:
    setattr(WorkerActor, _name, _forward(_name))
