"""WaitingRequests, a decode worker's accepted requests whose KV has not landed: no deadline until the
transfer starts, then expect_timeout_s; a cancel that came before its expect is remembered that long."""
from __future__ import annotations

from decode_worker import ExpectedRequest
from decode_worker.waiting import WaitingRequests
from engine import SamplingParams


def _request(request_id: str) -> ExpectedRequest:
    return ExpectedRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=2))


def test_deadlines_start_with_the_transfer_and_expire():
    waiting = WaitingRequests(expect_timeout_s=5.0)
    events = []
    for rid in ("a", "b"):
        waiting.add(_request(rid), events.append)
    assert len(waiting) == 2 and waiting.next_deadline() is None and waiting.expire(1000.0) == []
    waiting.start_deadline("a", 10.0)
    waiting.start_deadline("a", 12.0)  # once: a later start changes nothing
    assert waiting.next_deadline() == 15.0
    assert waiting.expire(14.9) == []
    (expired,) = waiting.expire(15.0)
    assert expired[0] == "a" and "a" not in waiting and "b" in waiting
    assert [rid for rid, _ in waiting.take_all()] == ["b"] and len(waiting) == 0


def test_an_early_cancel_is_remembered_until_it_lapses():
    waiting = WaitingRequests(expect_timeout_s=5.0)
    waiting.remember_cancel("late", 0.0)
    waiting.remember_cancel("lapsed", 0.0)
    assert waiting.cancelled_early("late") and not waiting.cancelled_early("late")  # forgotten once asked
    waiting.expire(5.0)
    assert not waiting.cancelled_early("lapsed") and waiting.pop("never") is None
