"""Hot swap of the draft model (`deployments.swap`): the config's split into init args and user_config, the draft
worker's swap with sessions in flight (no Ray), and the served stack swapping its draft under streaming load (real
Ray Serve, tiny models): no request fails, every output is the target's own, and only the draft workers change."""

from __future__ import annotations

import threading

import grpc
import pytest

from deployments import swap
from deployments.config import parse_config
from deployments.remote import RemoteDrafter, RemoteTarget, ReplicaPool
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import contrarian, make_engine, perturbed_checkpoint, run_to_completion, serve_pair


def _config(model="near", **draft):
    return parse_config({"target": {"model": "t"}, "draft": {"method": "draft_model", "model": model, **draft}})


# -- the split ------------------------------------------------------------------------------------------------------


def test_only_the_user_config_changes_with_the_draft_model():
    a, b = swap.split(_config("a")), swap.split(_config("b"))
    assert (a.user_config, b.user_config) == ({"model": "a"}, {"model": "b"})
    assert a.args == b.args and a.args["draft"]["model"] == swap.SWAPPED_OUT
    assert swap.version("DraftWorker", a.args) == swap.version("DraftWorker", b.args)
    assert swap.apply(parse_config(a.args), b.user_config) == _config("b")


def test_what_needs_a_restart_changes_the_version():
    base = swap.split(_config()).args
    for changed in (_config(dtype="float32"), _config(quantization="int8"), _config(max_sequences=2)):
        assert swap.version("DraftWorker", swap.split(changed).args) != swap.version("DraftWorker", base)
    assert swap.version("Router", base) != swap.version("DraftWorker", base)


def test_without_a_draft_model_nothing_swaps():
    ngram = parse_config({"target": {"model": "t"}, "draft": {"method": "ngram"}})
    assert swap.split(ngram) == swap.Split(ngram.model_dump(mode="json"), None)


@pytest.mark.parametrize("user_config", [None, {}, {"model": ""}, {"model": "m", "dtype": "float32"}])
def test_a_bad_user_config_is_named(user_config):
    with pytest.raises(InvalidArgument) as err:
        swap.draft_swap(user_config)
    assert "user_config" in str(err.value)


# -- the draft worker's swap, over gRPC, without Ray -------------------------------------------------------------

RUNNER = RunnerConfig(num_slots=8, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture
def servers(pair):
    yield from serve_pair(pair, RUNNER)


def test_sessions_finish_on_the_draft_they_started_with_and_new_ones_use_the_new(pair, servers):
    target, near = pair
    draft, address = servers["draft"]
    tpool = ReplicaPool("target", [servers["target"][1]], wpb_grpc.TargetServiceStub, timeout_s=30)
    dpool = ReplicaPool("draft", [address], wpb_grpc.DraftServiceStub, timeout_s=30)
    engine = SpecEngine(RemoteTarget(tpool), RemoteDrafter(dpool), target.tokenizer, target.eos_token_ids)
    old = [(f"old{i}", list(range(5 + 7 * i, 20 + 7 * i)), GREEDY, 3) for i in range(3)]
    new = [(f"new{i}", list(range(90 + 7 * i, 101 + 7 * i)), GREEDY, 3) for i in range(2)]
    for request_id, prompt, params, k in old:
        engine.add_request(request_id, prompt, params, k)
    outputs = {request_id: [] for request_id, *_ in old + new}
    for _ in range(3):  # the old sessions hold the near draft's caches
        for out in engine.step():
            outputs[out.seq_id].append(out)

    # A draft whose greedy drafts are never right: the sessions it serves accept nothing.
    wrong = DraftModelDrafter(ModelRunner(contrarian(near.model), RUNNER), target.model.vocab_size)
    draft.swap(wrong, "contrarian")
    assert draft.model_name == "contrarian" and draft.retired_models == ["tiny-draft"]
    for request_id, prompt, params, k in new:
        engine.add_request(request_id, prompt, params, k)
    while engine.has_work:
        for out in engine.step():
            outputs[out.seq_id].append(out)

    plain = run_to_completion(make_engine(target), [(r, p, s, 0) for r, p, s, _ in old + new])
    near_only = run_to_completion(make_engine(target, near.model), old)
    for request_id, chunks in outputs.items():
        assert [t for out in chunks for t in out.new_token_ids] == plain[request_id][0], request_id
    for request_id, *_ in old:  # the same drafts as with the near draft alone: none came from the new one
        assert outputs[request_id][-1].stats == near_only[request_id][2].stats, request_id
    for request_id, *_ in new:
        assert outputs[request_id][-1].stats.accepted == 0, request_id
    assert draft.retired_models == [] and draft.active_sessions == 0  # the old drafter went with its last session
