"""The worker's batch plan without a model (runner/engine/batch_plan.py): admission, one prefill at a
time, the limit's calm steps counted where a decode step ran, splitting, waiting for room.

Plain Python: the requests are dataclasses, the futures real, nothing imports torch.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.config import LoopStopConfig
from runner.engine.batch_plan import BatchPlan, BatchSequence, Status


@dataclass
class _Request:
    prompt_ids: list[int]
    device_bytes: int = 0
    host_bytes: int = 0
    fits: Callable[[], bool] | None = None


def _seq(device_bytes: int = 0, host_bytes: int = 0, prompt: int = 4) -> BatchSequence:
    return BatchSequence(_Request(list(range(prompt)), device_bytes, host_bytes), Future(), LoopStopConfig())


def _join_all(plan: BatchPlan) -> list[BatchSequence]:
    """Schedule and join until nothing more is admitted: the sequences that joined."""
    joined = []
    while (seq := plan.schedule()) is not None:
        plan.joined(seq)
        joined.append(seq)
    return joined


def test_the_plan_imports_no_model_library() -> None:
    probe = "import sys, runner.engine.batch_plan; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_admission_stops_at_the_limit_and_one_sequence_prefills_at_a_time() -> None:
    plan = BatchPlan(3, device_budget=1 << 30)
    seqs = [_seq() for _ in range(5)]
    for seq in seqs:
        plan.add(seq)
    assert plan.schedule() is seqs[0] and plan.decoding == [] and seqs[0].status is Status.PREFILLING
    # not joined yet: it still prefills, nobody else is admitted
    assert plan.schedule() is seqs[0] and list(plan.waiting) == seqs[1:]
    plan.joined(seqs[0])
    assert _join_all(plan) == seqs[1:3]
    assert plan.decoding == seqs[:3] and list(plan.waiting) == seqs[3:]
    plan.leave(seqs[1], Status.FINISHED)
    assert plan.schedule() is seqs[3] and plan.decoding == [seqs[0], seqs[2]]


def test_admission_sums_device_and_host_bytes_but_a_sequence_alone_always_runs() -> None:
    plan = BatchPlan(8, device_budget=100, host_budget=50)
    big, a, b, c = _seq(device_bytes=500), _seq(device_bytes=60), _seq(device_bytes=40), _seq(host_bytes=60)
    for seq in (big, a, b, c):
        plan.add(seq)
    assert _join_all(plan) == [big]  # over the budget, but alone: its own memory error decides
    plan.leave(big, Status.FINISHED)
    assert _join_all(plan) == [a, b]  # 60 + 40 device bytes fit; c's 60 host bytes pass the host budget
    plan.leave(a, Status.FINISHED)
    assert _join_all(plan) == []  # still over the host budget beside b
    plan.leave(b, Status.FINISHED)
    assert _join_all(plan) == [c]


def test_the_limit_counts_calm_decode_steps_not_schedule_calls() -> None:
    plan = BatchPlan(4, device_budget=1 << 30, grow_back_steps=3)
    seqs = [_seq() for _ in range(4)]
    for seq in seqs:
        plan.add(seq)
    rows = _join_all(plan)
    plan.split(rows)
    assert plan.limit.current == 2 and plan.splits == 1
    assert list(plan.waiting) == seqs and all(s.status is Status.WAITING and s.handle is None for s in seqs)
    rows = _join_all(plan)
    assert rows == seqs[:2]
    for _ in range(10):
        plan.schedule()  # turns without a decode step do not grow the limit
    assert plan.limit.current == 2
    for _ in range(3):
        plan.decoded(rows)
    assert plan.limit.current == 4 and plan.most_rows == 2
    assert [s.steps for s in rows] == [3, 3] and rows[0].batch_size == 2.0
    assert _join_all(plan) == seqs[2:]


def test_a_memory_error_starting_a_sequence_waits_beside_others_and_fails_alone() -> None:
    plan = BatchPlan(4, device_budget=1 << 30)
    a, b, c = _seq(), _seq(), _seq()
    for seq in (a, b, c):
        plan.add(seq)
    plan.joined(plan.schedule())
    plan.joined(plan.schedule())
    starting = plan.schedule()
    assert starting is c and plan.wait_for_room(c)
    assert plan.limit.current == 2 and list(plan.waiting) == [c] and c.status is Status.WAITING
    assert plan.schedule() is None  # two run: the limit
    plan.leave(a, Status.FINISHED)
    plan.leave(b, Status.FAILED)
    assert plan.schedule() is c and not plan.wait_for_room(c)  # alone: the task's own error


def test_a_sequence_starts_again_from_its_prompt_after_a_split() -> None:
    plan = BatchPlan(2, device_budget=1 << 30)
    seq = _seq(prompt=10)
    plan.add(seq)
    plan.schedule()
    seq.take(7)
    seq.take(8)
    assert seq.position == 11 and seq.first_token_at > 0
    plan.joined(seq)
    plan.split([seq])
    assert plan.schedule() is seq and seq.tokens == [] and seq.prefilled == 0


OPS = st.lists(st.tuples(st.sampled_from(["add", "schedule", "join", "decode", "leave", "split", "wait"]),
                         st.integers(0, 200), st.integers(0, 200)), max_size=60)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(limit=st.integers(1, 5), device_budget=st.integers(1, 400), host_budget=st.integers(1, 400), ops=OPS)
def test_no_sequence_is_lost_and_admission_keeps_its_rules(limit: int, device_budget: int, host_budget: int,
                                                           ops: list[tuple[str, int, int]]) -> None:
    plan = BatchPlan(limit, device_budget, host_budget)
    everyone: list[BatchSequence] = []
    left: list[BatchSequence] = []
    for op, x, y in ops:
        if op == "add":
            everyone.append(_seq(device_bytes=x, host_bytes=y))
            plan.add(everyone[-1])
        elif op == "schedule":
            before = list(plan.running)
            prefill = plan.schedule()
            if prefill is not None and prefill not in before and before:
                assert len(plan.running) <= plan.limit.current
                assert sum(s.request.device_bytes for s in plan.running) <= device_budget
                assert sum(s.request.host_bytes for s in plan.running) <= host_budget
        elif op == "join" and plan.prefilling is not None:
            plan.joined(plan.prefilling)
        elif op == "decode" and plan.decoding:
            plan.decoded(plan.decoding)
        elif op == "leave" and plan.running:
            seq = plan.running[x % len(plan.running)]
            plan.leave(seq, Status.FINISHED)
            left.append(seq)
        elif op == "split" and plan.running:
            plan.split(list(plan.running))
        elif op == "wait" and plan.prefilling is not None:
            seq = plan.prefilling
            if not plan.wait_for_room(seq):
                plan.leave(seq, Status.FAILED)
                left.append(seq)
        assert sum(s.status is Status.PREFILLING for s in plan.running) <= 1
        assert 1 <= plan.limit.current <= limit
        held = [*plan.waiting, *plan.running, *left]
        assert sorted(map(id, held)) == sorted(map(id, everyone))  # each exactly once
    assert set(map(id, plan.drain())) == {id(s) for s in everyone} - {id(s) for s in left}


def test_a_prompt_in_chunks_rides_the_decode_steps_the_batch_made_meanwhile() -> None:
    """One riding the steps in chunks of 4 takes three chunks for 10 tokens, and the batch decoded
    through them."""
    plan = BatchPlan(3, device_budget=1 << 30)
    decoder, whole, rides = _seq(), _seq(prompt=10), _seq(prompt=10)
    for seq in (decoder, whole, rides):
        plan.add(seq)
    plan.joined(plan.schedule())
    assert plan.schedule() is whole
    plan.joined(whole)
    assert plan.schedule() is rides
    rides.chunk_tokens = 4
    chunks = []
    while rides.prefilled < 10:
        chunks.append(plan.next_chunk(rides))
        rides.prefilled = chunks[-1][1]
        plan.decoded(plan.decoding, beside_prefill=True)
    plan.joined(rides)
    assert chunks == [(0, 4), (4, 8), (8, 10)]
    assert plan.steps_with_prefill == 3
    assert plan.decoding == [decoder, whole, rides] and decoder.steps == 3
