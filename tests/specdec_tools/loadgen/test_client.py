"""The load shapes without a server: arrival times, and how many requests are in flight in each loop."""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest

from specdec_tools.loadgen.client import Prompt, Sampling, build_request, closed_loop, inter_arrival_times, open_loop
from specdec_tools.loadgen.metrics import RequestRecord


def draws(rate, burstiness, n=20000, seed=0):
    return np.array(list(itertools.islice(inter_arrival_times(rate, burstiness, seed), n)))


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_arrivals_have_mean_one_over_the_rate_and_gamma_spread(burstiness, cv):
    gaps = draws(4.0, burstiness)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)  # gamma(shape B): CV = 1 / sqrt(B)


def test_arrivals_are_seeded_and_an_infinite_rate_sends_at_once():
    assert list(draws(2.0, 1.0, n=5, seed=3)) == list(draws(2.0, 1.0, n=5, seed=3))
    assert list(draws(2.0, 1.0, n=5, seed=3)) != list(draws(2.0, 1.0, n=5, seed=4))
    assert list(draws(float("inf"), 1.0, n=3)) == [0.0, 0.0, 0.0]


class FakeServer:
    """A send() that takes `seconds` and records how many requests were in flight at once."""

    def __init__(self, seconds):
        self.seconds, self.in_flight, self.most, self.sent = seconds, 0, 0, []

    async def send(self, index):
        self.sent.append((index, time.perf_counter()))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.seconds)
        self.in_flight -= 1
        return RequestRecord(chunk_times=(0.001,), chunk_tokens=(1,), e2el=self.seconds)


def test_closed_loop_keeps_n_in_flight_and_sends_each_index_once():
    server, done = FakeServer(0.01), []
    records = asyncio.run(closed_loop(server.send, 3, 10, None, lambda: done.append(1)))
    assert len(records) == 10 and len(done) == 10
    assert sorted(i for i, _ in server.sent) == list(range(10))
    assert server.most == 3


def test_closed_loop_until_a_deadline():
    server = FakeServer(0.01)
    start = time.perf_counter()
    records = asyncio.run(closed_loop(server.send, 2, None, start + 0.1, lambda: None))
    assert 4 <= len(records) <= 24 and server.most == 2


def test_open_loop_sends_on_schedule_whatever_is_in_flight():
    server = FakeServer(0.2)
    start = time.perf_counter()
    records = asyncio.run(open_loop(server.send, itertools.repeat(0.02), 5, None, lambda: None))
    elapsed = time.perf_counter() - start
    assert len(records) == 5 and server.most == 5  # none had finished when the last was sent
    sent = [t for _, t in server.sent]
    assert 0.075 < sent[-1] - sent[0] < 0.2  # four gaps of 20 ms: arrivals keep to the schedule, not to replies
    assert elapsed < 0.2 + 4 * 0.02 + 0.3


def test_open_loop_stops_sending_at_the_deadline():
    server = FakeServer(0.001)
    records = asyncio.run(open_loop(server.send, itertools.repeat(0.03), None, time.perf_counter() + 0.1, lambda: None))
    assert 3 <= len(records) <= 5


def test_requests_carry_the_prompt_the_seed_and_the_speculation_asked():
    prompt, sampling = Prompt("hi", 12), Sampling(temperature=0.7, seed=100, ignore_eos=True)
    request = build_request(prompt, 3, sampling, None)
    assert request.prompt == "hi" and request.sampling.max_tokens == 12 and request.sampling.seed == 103
    assert request.sampling.ignore_eos and request.sampling.temperature == pytest.approx(0.7)
    assert request.speculation.WhichOneof("length") is None  # the server's setting
    assert build_request(prompt, 0, sampling, "auto").speculation.adaptive
    off = build_request(prompt, 0, sampling, 0).speculation
    assert off.WhichOneof("length") == "num_speculative_tokens" and off.num_speculative_tokens == 0
    assert build_request(prompt, 0, sampling, 4).speculation.num_speculative_tokens == 4


def test_a_turn_after_a_history_goes_as_messages_with_its_salt_over_both_apis():
    from specdec_tools.loadgen.openai_http import chat_body

    prompt, sampling = Prompt("and now?", 8), Sampling(temperature=0.0, seed=5, ignore_eos=False)
    history = (("system", "be brief"), ("user", "hi"), ("assistant", "hello"))
    request = build_request(prompt, 2, sampling, None, history=history, cache_salt="s1")
    assert request.prompt == ""  # exactly one of prompt and messages
    assert [(m.role, m.content) for m in request.messages] == [*history, ("user", "and now?")]
    assert request.cache_salt == "s1" and request.sampling.seed == 7 and request.sampling.max_tokens == 8
    body = chat_body("m", prompt, 2, sampling, None, history=history, cache_salt="s1")
    assert [(m["role"], m["content"]) for m in body["messages"]] == [*history, ("user", "and now?")]
    assert body["cache_salt"] == "s1" and body["seed"] == 7 and body["max_tokens"] == 8
    # without them, the requests are as before: a lone prompt, no salt
    lone = build_request(prompt, 0, sampling, None)
    assert lone.prompt == "and now?" and not lone.messages and lone.cache_salt == ""
    assert "cache_salt" not in chat_body("m", prompt, 0, sampling, None)
