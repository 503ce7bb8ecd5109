"""A document summarised by one in-process `SummaryWorker`, driven as the coordinator drives it (its
`DocumentRun`, the worker's three calls), without Ray: the passes of a level run side by side in the
worker's batch. No retries or fallbacks: the first failed call's outcome is the answer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from jobs.document_run import DocumentRun, Stage
from jobs.outcome import CallOutcome, TaskOutcome, fold_passes
from jobs.task import Task
from runner.engine.worker import SummaryWorker


def summarize(worker: SummaryWorker, task: Task, context_tokens: int, attempt: int = 1) -> TaskOutcome:
    doc = DocumentRun(task, context_tokens, attempt=attempt)
    with ThreadPoolExecutor(max_workers=worker.cfg.batch.sequences) as threads:
        while not doc.ended:
            if doc.stage is Stage.PLANNING:
                outcome: CallOutcome = (worker.plan(task, context_tokens) if doc.level == 0 else
                                        worker.plan_merge(task, doc.level, doc.parts, context_tokens))
                if outcome["status"] != "done":
                    return outcome
                doc.planned(outcome["plan"])
                continue
            specs = doc.next_passes()
            for outcome in threads.map(lambda spec: worker.run_pass(spec, doc.attempt), specs):
                if outcome["status"] != "done":
                    return outcome
                doc.pass_done(outcome["row"], outcome)
    return fold_passes(doc.tree, doc.ran, len(doc.levels[0].specs), doc.levels[0].input_tokens, worker.info(),
                       worker.cfg.summarize.trim_to_sentence)
