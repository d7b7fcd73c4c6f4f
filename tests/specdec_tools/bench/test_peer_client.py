"""The client of `specdec bench peer`: the completions as each server answers them, and its concurrency against a fake
server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from specdec_tools.bench import peer_client as client

# -- completions -----------------------------------------------------------------------------------------------------


def never(text):
    raise AssertionError("the ids were in the answer")


def test_our_answer_gives_its_ids_and_speculation_counts():
    answer = {
        "choices": [{"text": "ab", "token_ids": [5, 6]}],
        "usage": {"completion_tokens": 2},
        "speculation": {"proposed": 7, "accepted": 4},
    }
    assert client.parse_completion(answer, never) == client.Completion((5, 6), "ab", 2, 7, 4, "server")


def test_llama_servers_answer_gives_its_ids_under_verbose_and_drafts_in_timings():
    answer = {
        "choices": [{"text": "ab"}],
        "usage": {"completion_tokens": 2},
        "__verbose": {"tokens": [5, 6]},
        "timings": {"draft_n": 3, "draft_n_accepted": 1},
    }
    assert client.parse_completion(answer, never) == client.Completion((5, 6), "ab", 2, 3, 1, "server")


def test_an_answer_without_ids_is_retokenized_and_says_so():
    answer = {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}}
    got = client.parse_completion(answer, lambda text: [ord(ch) for ch in text])
    assert (got.token_ids, got.ids_from, got.drafted) == ((97, 98), "text", 0)


class FakeServer:
    """An OpenAI-style completions endpoint that answers only once `concurrency` requests are in flight together
    (a barrier: a client that sends fewer at a time gets 500s), echoing each prompt's last id."""

    def __init__(self, concurrency):
        barrier, bodies = threading.Barrier(concurrency, timeout=5), []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    self.send_response(500)
                    self.end_headers()
                    return
                n = body["max_tokens"]
                answer = {
                    "choices": [{"text": "x" * n, "token_ids": [body["prompt"][-1]] * n}],
                    "usage": {"completion_tokens": n},
                }
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.bodies = bodies
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_the_client_sends_one_body_c_at_a_time_and_keeps_the_prompts_order():
    fake = FakeServer(concurrency=4)
    endpoint = client.Endpoint(fake.url, "m", extras={"return_token_ids": True})
    prompts = [[1, 10], [1, 11], [1, 12], [1, 13], [1, 14], [1, 15], [1, 16], [1, 17]]
    try:
        seconds, done = client.run_set(endpoint, prompts, 3, concurrency=4, retokenize=never)
    finally:
        fake.server.shutdown()
    assert [c.token_ids for c in done] == [(p[-1],) * 3 for p in prompts]
    assert seconds > 0 and sum(c.completion_tokens for c in done) == 24
    expected = {"model": "m", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": False}
    assert all(body.items() >= {**expected, "return_token_ids": True}.items() for body in fake.bodies)
    assert sorted(body["prompt"] for body in fake.bodies) == prompts


def test_a_session_sends_each_turn_with_the_conversation_and_its_own_answers_and_times_turns_after_the_first():
    """The fake answers each turn with text naming the turn's prompt length: the next turn's conversation must hold
    it. Only turns after the first are counted."""
    fake = FakeServer(concurrency=1)
    endpoint = client.Endpoint(fake.url, "m")
    sent = []

    def encode(conversation):
        sent.append(list(conversation))
        return [len(conversation)]

    sessions = [("sys A", ["a1", "a2", "a3"]), ("sys B", ["b1", "b2"])]
    try:
        seconds, later = client.run_sessions(endpoint, sessions, 2, encode, never)
    finally:
        fake.server.shutdown()
    assert len(later) == 3 and seconds > 0  # a2, a3, b2
    assert sent[2] == [
        ("system", "sys A"),
        ("user", "a1"),
        ("assistant", "xx"),
        ("user", "a2"),
        ("assistant", "xx"),
        ("user", "a3"),
    ]
    assert sent[3] == [("system", "sys B"), ("user", "b1")]
    assert [body["prompt"] for body in fake.bodies] == [[2], [4], [6], [2], [4]]
    assert not any(body["ignore_eos"] for body in fake.bodies)  # a conversation's answers end where the model ends them
