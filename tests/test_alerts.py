"""The alert rules as plain logic (the end-to-end firing is in test_status.py and test_report.py)."""

from __future__ import annotations

import pytest
from rich.console import Console

from runner.observe.alerts import AlertMonitor, AlertRules, length_class, memory_threshold
from runner.observe.joblog import JobLog, read_log


def test_length_classes_group_documents_within_a_factor_of_two():
    assert length_class(1024) == length_class(2047) == "1024-2047 chars"
    assert length_class(2048) != length_class(2047)
    assert length_class(0) == length_class(1) == "1-1 chars"


def test_a_running_task_is_slow_only_against_its_own_length_class():
    rules = AlertRules()
    assert rules.task_finished("a", "a", 1500, 1.0, []) == []
    assert rules.task_finished("b", "b", 1500, 3.0, []) == []
    rules.task_started("early", "early", 1500, now=0.0, worker="w0")
    assert rules.overdue(now=1000.0) == []  # two samples make no median yet
    assert rules.task_finished("c", "c", 1500, 2.0, []) == []  # median 2.0 s for 1024-2047 chars
    rules.task_stopped("early")
    rules.task_started("short", "short", 1500, now=100.0, worker="w0")
    rules.task_started("long", "long", 9000, now=100.0, worker="w1")  # no median for its class yet
    assert rules.overdue(now=104.0) == []  # exactly 2 x median is not over it
    [alert] = rules.overdue(now=104.5)
    assert alert.kind == "slow_task" and alert.fields["doc_id"] == "short" and alert.fields["median_s"] == 2.0
    assert rules.overdue(now=200.0) == []  # once per attempt
    assert rules.task_stopped("short").alerted


def test_a_finished_task_over_the_threshold_alerts_unless_it_already_did():
    rules = AlertRules()
    for task in ("a", "b", "c"):
        rules.task_finished(task, task, 100, 1.0, [])
    [alert] = rules.task_finished("c", "c", 100, 2.5, [])
    assert alert.kind == "slow_task" and "took 2.5 s" in alert.message
    assert rules.task_finished("d", "d", 100, 9.0, [], slow_alerted=True) == []


def test_repeated_fallbacks_and_restarts():
    rules = AlertRules()
    assert rules.task_finished("a", "a", 10, 1.0, ["cache:dynamic->tiered-disk (OutOfMemoryError)"]) == []
    [alert] = rules.task_finished("b", "b", 10, 1.0, ["cache:x->y (E)", "context:1024->512 (E)"])
    assert alert.kind == "repeated_fallbacks" and alert.fields["fallbacks"][1] == "context:1024->512 (E)"
    assert rules.worker_restarted("worker slot 0", "WorkerDied", "a") == []
    assert rules.worker_restarted("worker slot 1", "WorkerDied", "b") == []
    [alert] = rules.worker_restarted("worker slot 0", "TimeoutError", "c")
    assert alert.fields == {"worker": "worker slot 0", "doc_id": "c", "restarts": 2, "reason": "TimeoutError"}
    # a document that takes down one worker after another (its task moves on each time)
    [alert] = rules.worker_restarted("worker slot 2", "WorkerDied", "b")
    assert alert.message == "document 'b' took down a worker 2 times (last: WorkerDied)"


def test_memory_alerts_once_per_crossing():
    rules = AlertRules(memory_fraction=0.8)
    assert rules.memory("host RAM", "n1", 0.79) == []
    assert len(rules.memory("host RAM", "n1", 0.85)) == 1
    assert rules.memory("host RAM", "n1", 0.9) == []  # still high: no repeat
    assert len(rules.memory("host RAM", "n2", 0.9)) == 1  # another machine
    assert rules.memory("host RAM", "n1", 0.78) == []  # not clearly below yet: stays armed off
    assert rules.memory("host RAM", "n1", 0.86) == []
    assert rules.memory("host RAM", "n1", 0.70) == []  # fell back below
    assert len(rules.memory("host RAM", "n1", 0.81)) == 1
    assert rules.memory("device memory", "n1", None) == []  # a CPU worker has no device figure


def test_memory_threshold_from_the_environment(monkeypatch):
    assert memory_threshold() == 0.8
    monkeypatch.setenv("KVBATCH_ALERT_MEMORY_FRACTION", "0.5")
    assert memory_threshold() == 0.5
    monkeypatch.setenv("KVBATCH_ALERT_MEMORY_FRACTION", "80")
    with pytest.raises(ValueError, match="KVBATCH_ALERT_MEMORY_FRACTION"):
        memory_threshold()


def test_the_monitor_writes_alerts_to_job_log_and_console(tmp_path):
    log = JobLog(tmp_path / "job.log")
    console = Console(record=True, width=200)
    monitor = AlertMonitor(log, console, AlertRules(memory_fraction=0.8))
    monitor.task_finished("t1", "doc-1", 10, {"worker": "node1:42", "wall_s": 1.0, "host_used_fraction": 0.93},
                          ["cache:a->b (E)", "cache:b->exhausted (E)"], slow_alerted=False)
    log.close()
    entries = [e for e in read_log(tmp_path / "job.log") if e["event"] == "alert"]
    assert {e["kind"] for e in entries} == {"memory", "repeated_fallbacks"}
    memory = next(e for e in entries if e["kind"] == "memory")
    assert memory["level"] == "warning" and memory["where"] == "node1" and memory["used_fraction"] == 0.93
    text = console.export_text()
    assert "alert (memory): host RAM 93% used on node1" in text and "alert (repeated_fallbacks)" in text
