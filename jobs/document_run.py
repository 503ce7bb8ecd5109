"""One document's way through a batch, as a state machine: no Ray, no torch, no threads.

A kill loses only the passes in flight: a `DocumentRun` made again from the kept rows (storage/passes.py)
takes up where the last one stopped, and `fall_back` starts it over at a shorter context, reusing every
pass kept so far.

    PLANNING --planned--> MAPPING (level 0) / MERGING (level > 0) --level kept--> PLANNING (next level)
                                                                   \\--one summary left--> DONE
    any --fall_back--> PLANNING (level 0, shorter context);   any --fail--> FAILED
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from jobs.passes import LevelPlan, PassRow, PassSpec
from jobs.task import Task


class Stage(StrEnum):
    PLANNING = "planning"  # its next level needs a plan (a worker's call)
    MAPPING = "mapping"  # its chunks' passes run
    MERGING = "merging"  # its merge passes run
    DONE = "done"
    FAILED = "failed"


_RUNNING = (Stage.MAPPING, Stage.MERGING)


@dataclass(eq=False)  # a document's record, compared by identity
class DocumentRun:
    """A document's level, context, kept passes and pending specs, and the retry policy's counts."""

    task: Task
    context_tokens: int
    kept: dict[str, PassRow] = field(default_factory=dict)  # every pass kept for it, any context, by key
    stage: Stage = Stage.PLANNING
    level: int = 0
    plan: LevelPlan | None = None  # the current level's
    levels: list[LevelPlan] = field(default_factory=list)  # every level planned at the current context
    parts: list[str] = field(default_factory=list)  # the summaries the current merge level was planned from
    running: set[str] = field(default_factory=set)  # keys of the current level's passes dealt out, not ended
    ran: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # outcomes of the passes run (not read
    # back) in this batch, by key: what the result row's figures are folded from
    calls: int = 0  # calls for it in flight (planning or passes)
    # the policy's counts (the coordinator's retry loop keeps them)
    attempt: int = 1  # the calls made, counting a failure once: the result row's `attempts`, what a fault rule matches
    tries_at_context: int = 0  # its own failures at the current context
    fallbacks: list[str] = field(default_factory=list)  # cache and context moves, as notes
    batch_losses: int = 0  # worker losses while batch-mates were in flight: not counted as its own
    alone: bool = False  # its passes run with no batch-mates (after losses it may have caused)
    started_at: float | None = None  # when its first call began
    queue_wait_s: float | None = None
    slow_alerted: bool = False
    _claimed: tuple[Stage, int, int] | None = None  # the stage a caller took charge of (`claim`)
    _failed: bool = False  # a call failed since the last one began: the next is a new attempt
    _losses: set[Hashable] = field(default_factory=set)  # the worker losses that ended calls of its

    def planned(self, plan: LevelPlan) -> None:
        """The current level's plan came back: its passes may be dealt (those kept already count at once)."""
        if self.stage is not Stage.PLANNING:
            raise ValueError(f"{self.task.doc_id}: a plan arrived while {self.stage}")
        self.plan = plan
        self.levels.append(plan)
        self.stage = Stage.MAPPING if self.level == 0 else Stage.MERGING
        self._advance()

    def next_passes(self) -> list[PassSpec]:
        """The current level's passes neither kept nor dealt out yet: they are dealt out now."""
        if self.stage not in _RUNNING:
            return []
        assert self.plan is not None
        specs = {s.key: s for s in self.plan.specs if s.key not in self.kept and s.key not in self.running}
        self.running.update(specs)
        return list(specs.values())

    def wants(self, spec: PassSpec) -> bool:
        """Whether running `spec` still helps: it is of the current level and not kept (a pass of a
        context given up, or of a document that ended, is not)."""
        return (self.stage in _RUNNING and (spec.level, spec.context_tokens) == (self.level, self.context_tokens)
                and spec.key not in self.kept)

    def pass_done(self, row: PassRow, outcome: Mapping[str, Any] | None = None) -> None:
        """A pass finished and is kept (whatever level or context it was of); `outcome`: its worker's,
        when it ran in this batch."""
        self.kept[row["key"]] = row
        self.running.discard(row["key"])
        if outcome is not None:
            self.ran[row["key"]] = outcome
        self._advance()

    def pass_ended(self, spec: PassSpec) -> None:
        """A pass dealt out ended without a row (failed, or its worker was lost): it may be dealt again."""
        self.running.discard(spec.key)

    def _advance(self) -> None:
        if self.stage not in _RUNNING:
            return
        plan = self.plan
        assert plan is not None
        if any(s.key not in self.kept for s in plan.specs):
            return
        merged = iter(self.kept[s.key]["text"] for s in plan.specs)
        texts = ([next(merged) for _ in plan.specs] if self.level == 0 else
                 [next(merged) if stop - start > 1 else self.parts[start] for start, stop in plan.groups])
        if len(texts) == 1:
            self.stage = Stage.DONE
            return
        self.parts, self.level, self.plan, self.stage = texts, self.level + 1, None, Stage.PLANNING

    def fall_back(self, context_tokens: int, note: str) -> None:
        """Start over at a shorter context: every level planned again, every kept pass still found."""
        self.fallbacks.append(note)
        self.context_tokens, self.level, self.plan, self.stage = context_tokens, 0, None, Stage.PLANNING
        self.levels, self.parts, self.running = [], [], set()
        self.tries_at_context = 0

    def fail(self) -> None:
        self.stage = Stage.FAILED

    def claim(self) -> bool:
        """True for the first caller to ask since the document reached its current stage, level and
        context: of the threads that see it PLANNING or DONE, the one that plans or records it."""
        now = (self.stage, self.level, self.context_tokens)
        first, self._claimed = now != self._claimed, now
        return first

    def unclaim(self) -> None:
        """The caller that claimed the current stage gave it up (its worker was lost): the next may claim it."""
        self._claimed = None

    def begin(self) -> None:
        """A call for it begins: the first one starts its clock; the first after a failure is a new attempt."""
        if self.started_at is None:
            self.started_at = time.time()
        if self._failed:
            self.attempt, self._failed = self.attempt + 1, False

    def first_loss(self, event: Hashable | None) -> bool:
        """Whether a worker loss is new to this document: one loss that ends several of its calls at once
        is one failure (None: a loss nothing else can have seen)."""
        if event is None:
            return True
        first = event not in self._losses
        self._losses.add(event)
        return first

    def call_failed(self, own: bool) -> None:
        """A call for it failed; `own`: the failure counts against its tries at this context (a worker lost
        while batch-mates shared it does not, until it runs alone)."""
        self._failed = True
        self.tries_at_context += own

    @property
    def ended(self) -> bool:
        return self.stage in (Stage.DONE, Stage.FAILED)

    @property
    def summary_row(self) -> PassRow:
        """The pass whose summary is the document's (DONE only)."""
        if self.stage is not Stage.DONE:
            raise ValueError(f"{self.task.doc_id} is {self.stage}, not done")
        return self.kept[self.levels[-1].specs[0].key]

    @property
    def tree(self) -> list[PassRow]:
        """The kept passes of every level planned at the current context, level by level."""
        return [self.kept[s.key] for plan in self.levels for s in plan.specs if s.key in self.kept]
