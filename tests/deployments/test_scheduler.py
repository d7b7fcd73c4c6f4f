"""Admission control and deadlines in the router's engine thread, over a real in-process engine.

The target is the tiny model slowed down per verify, so that a running request holds its KV slot for a known
minimum time: the waits below are lower bounds, never races.
"""

from __future__ import annotations

import queue
import time

import pytest

from deployments.scheduler import Admission, DeadlineExceeded, Scheduler
from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.errors import ResourceExhausted
from specdec_core.models.loader import load_model
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.stopping import FinishReason
from specdec_core.target import LocalTarget

LONG = SamplingParams(max_tokens=200, ignore_eos=True)  # >= 200 rounds of >= 20 ms: holds its slot >= 4 s


class SlowTarget(LocalTarget):
    def verify(self, items):
        time.sleep(0.02)
        return super().verify(items)


@pytest.fixture()
def one_slot(tiny_dir):
    loaded = load_model(tiny_dir / "target", dtype="float32")
    target = SlowTarget(ModelRunner(loaded.model, RunnerConfig(num_slots=1, max_seq_len=256)))
    return SpecEngine(target, None, loaded.tokenizer, loaded.eos_token_ids)


def submit(scheduler, request_id, params=LONG, timeout_s=None):
    inbox: queue.Queue = queue.Queue()
    scheduler.submit(
        Request(request_id, tuple(range(5, 15)), params, num_speculative_tokens=0), inbox.put, timeout_s=timeout_s
    )
    return inbox


def first_error(inbox, timeout=30.0):
    """The first exception delivered to a request (skipping its outputs), or its final output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = inbox.get(timeout=deadline - time.monotonic())
        if isinstance(item, Exception) or item.finished:
            return item
    raise AssertionError("nothing final arrived")


def test_a_full_queue_refuses_and_a_long_wait_times_out(one_slot):
    scheduler = Scheduler(one_slot, Admission(max_queued=1, queue_timeout_s=1.0))
    try:
        running = submit(scheduler, "running")
        running.get(timeout=30)  # admitted: it holds the only slot now
        waiting = submit(scheduler, "waiting")
        time.sleep(0.2)
        refused = first_error(submit(scheduler, "refused"))
        assert isinstance(refused, ResourceExhausted) and refused.field == "queue"
        start = time.monotonic()
        timed_out = first_error(waiting)
        assert isinstance(timed_out, ResourceExhausted) and timed_out.field == "kv_cache"
        assert 0.7 <= time.monotonic() - start < 10
        assert one_slot.num_waiting == 0 and one_slot.num_running == 1  # the running one goes on
        scheduler.cancel("running")
        assert first_error(running).finish_reason == FinishReason.CANCELLED
        assert one_slot.target.free_slots == 1
    finally:
        scheduler.close()


def test_a_request_past_its_deadline_stops_within_a_round_and_frees_its_slot(one_slot):
    scheduler = Scheduler(one_slot, Admission(request_timeout_s=60.0))
    try:
        start = time.monotonic()
        late = first_error(submit(scheduler, "late", timeout_s=0.5))
        assert isinstance(late, DeadlineExceeded)
        assert time.monotonic() - start < 2.0  # 0.5 s plus at most about one 20 ms round
        assert one_slot.target.free_slots == 1 and not one_slot.has_work
        short = SamplingParams(max_tokens=3, ignore_eos=True)
        assert first_error(submit(scheduler, "next", short)).finish_reason == FinishReason.LENGTH
    finally:
        scheduler.close()


def test_the_server_wide_request_timeout_applies_without_a_client_deadline(one_slot):
    scheduler = Scheduler(one_slot, Admission(request_timeout_s=0.4))
    try:
        assert isinstance(first_error(submit(scheduler, "r")), DeadlineExceeded)
        assert one_slot.target.free_slots == 1
    finally:
        scheduler.close()


def test_waiting_with_no_free_slot_does_not_spin(one_slot):
    """A request that waits for a slot must not turn the engine thread into a busy loop."""
    one_slot.target.runner.allocate()  # the only slot is taken by someone else (another router's session)
    steps = []
    step = one_slot.step
    one_slot.step = lambda: steps.append(1) or step()
    scheduler = Scheduler(one_slot, Admission(queue_timeout_s=1.5))
    try:
        error = first_error(submit(scheduler, "r"))
        assert isinstance(error, ResourceExhausted) and error.field == "kv_cache"
        assert len(steps) < 100  # polled about every 50 ms; a spinning loop makes many thousands in 1.5 s
    finally:
        scheduler.close()
