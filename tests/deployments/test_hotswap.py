"""Hot swap of the draft model (`deployments.swap`): the config's split into init args and user_config, the draft
worker's swap with sessions in flight (no Ray), and the served stack swapping its draft under streaming load (real
Ray Serve, tiny models): no request fails, every output is the target's own, and only the draft workers change."""

from __future__ import annotations

import threading

import grpc
import pytest

from deployments import swap
from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.serve_config import parse_config
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import contrarian, make_engine, perturbed_checkpoint, run_to_completion, serve_pair


def _config(model="near", **draft):
    return parse_config({"target": {"model": "t"}, "draft": {"method": "draft_model", "model": model, **draft}})


# -- the split ------------------------------------------------------------------------------------------------------


def test_only_the_user_config_changes_with_the_draft_model():
    a, b = swap.split(_config("a")), swap.split(_config("b"))
    assert (a.workers, b.workers) == ({"DraftWorker": {"model": "a"}}, {"DraftWorker": {"model": "b"}})
    assert b.router == {"variants": {"default": {"model": "b"}}}
    assert a.args == b.args and a.args["draft"]["model"] == swap.SWAPPED_OUT
    assert swap.version("DraftWorker", a.args) == swap.version("DraftWorker", b.args)
    assert swap.apply(parse_config(a.args), b.router) == _config("b")


def _variants(base="a", tuned="b", weights=(3, 1)):
    return parse_config(
        {
            "target": {"model": "t"},
            "drafts": [
                {"name": "base", "method": "draft_model", "model": base, "weight": weights[0]},
                {"name": "tuned", "method": "draft_model", "model": tuned, "weight": weights[1]},
                {"name": "lookup", "method": "suffix", "weight": 1},
            ],
        }
    )


def test_each_variants_model_and_every_weight_swap_without_changing_the_args():
    a, b = swap.split(_variants()), swap.split(_variants(tuned="c", weights=(1, 0)))
    assert a.args == b.args and {v["model"] for v in a.args["drafts"][:2]} == {swap.SWAPPED_OUT}
    assert b.workers == {"DraftWorker-base": {"model": "a"}, "DraftWorker-tuned": {"model": "c"}}
    assert b.router == {
        "variants": {"base": {"model": "a", "weight": 1}, "tuned": {"model": "c", "weight": 0}, "lookup": {"weight": 1}}
    }
    assert swap.apply(parse_config(a.args), b.router) == _variants(tuned="c", weights=(1, 0))
    with pytest.raises(InvalidArgument) as err:
        swap.apply(parse_config(a.args), {"variants": {"other": {"weight": 1}}})
    assert err.value.field == "user_config.variants" and "other" in err.value.message


def test_what_needs_a_restart_changes_the_version():
    base = swap.split(_config()).args
    for changed in (_config(dtype="float32"), _config(quantization="int8"), _config(max_sequences=2)):
        assert swap.version("DraftWorker", swap.split(changed).args) != swap.version("DraftWorker", base)
    assert swap.version("Router", base) != swap.version("DraftWorker", base)


def test_without_a_draft_model_nothing_swaps():
    ngram = parse_config({"target": {"model": "t"}, "draft": {"method": "ngram"}})
    assert swap.split(ngram) == swap.Split(ngram.model_dump(mode="json"), {}, None)


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
        engine.add_request(Request(request_id, tuple(prompt), params, num_speculative_tokens=k))
    outputs = {request_id: [] for request_id, *_ in old + new}
    for _ in range(3):  # the old sessions hold the near draft's caches
        for out in engine.step():
            outputs[out.seq_id].append(out)

    # A draft whose greedy drafts are never right: the sessions it serves accept nothing.
    wrong = DraftModelDrafter(ModelRunner(contrarian(near.model), RUNNER), target.model.vocab_size)
    draft.swap(wrong, "contrarian")
    assert draft.model_name == "contrarian" and draft.retired_models == ["tiny-draft"]
    for request_id, prompt, params, k in new:
        engine.add_request(Request(request_id, tuple(prompt), params, num_speculative_tokens=k))
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


# -- served: a config update under streaming load ------------------------------------------------------------------

APP = "specdec-swap"
STREAMS = 4
PROMPTS = [list(range(5 + 11 * i, 17 + 11 * i)) for i in range(STREAMS)]
MAX_TOKENS = 120  # long enough that the first request of every stream is in flight when the swap starts


@pytest.fixture(scope="module")
def swap_app(served, tiny_dir, near_draft_dir, tmp_path_factory):
    """An application of its own on the session's Serve (one target, one draft replica), and a way to redeploy it
    with another draft model as `serve.run` does. Yields (address, deploy(model))."""
    from ray import serve

    from deployments.app import build_app

    address, base = served
    worker = {"num_cpus": 0.5, "threads": 1, "max_sequences": 8, "num_replicas": 1}
    args = {
        **base.model_dump(mode="json"),
        "app_name": APP,
        "target": {**base.target.model_dump(mode="json"), **worker},
        "draft": {**base.draft.model_dump(mode="json"), **worker},
        "router": {**base.router.model_dump(mode="json"), "calibrate": False, "worker_refresh_s": 1},
    }

    def deploy(model):
        config = parse_config({**args, "draft": {**args["draft"], "model": str(model)}})
        serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
        return config

    deploy(near_draft_dir)
    yield address, deploy
    serve.delete(APP)


@pytest.fixture(scope="module")
def other_draft_dir(near_draft_dir, tmp_path_factory):
    return perturbed_checkpoint(near_draft_dir, tmp_path_factory.mktemp("swap") / "other_draft", scale=0.2, seed=5)


@pytest.fixture(scope="module")
def plain_tokens(tiny_dir):
    from specdec_core.models.loader import load_model

    engine = make_engine(load_model(tiny_dir / "target", dtype="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    done = run_to_completion(engine, [(str(i), prompt, params, 0) for i, prompt in enumerate(PROMPTS)])
    return [done[str(i)][0] for i in range(STREAMS)]


def _replicas():
    """The application's replica actors by name (Serve names them app#deployment#replica id)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#" in a["name"])


def _draft_models(config):
    """The model each draft replica serves, as its GetStats says."""
    from tests.helpers import worker_stats

    return [s.model for s in worker_stats((None, config), "draft")]


class _Stream(threading.Thread):
    """Greedy streams, one after another, until one has started after `swapped` was set: (tokens, error, started
    after the swap) of each."""

    def __init__(self, stub, index, swapped):
        super().__init__(daemon=True)
        self.stub, self.index, self.swapped = stub, index, swapped
        self.first_chunk = threading.Event()
        self.results = []

    def run(self):
        from specdec.v1 import generation_pb2 as pb

        while True:
            after = self.swapped.is_set()
            message = pb.GenerateRequest(
                prompt_token_ids=PROMPTS[self.index], sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            )
            message.speculation.num_speculative_tokens = 3
            tokens, error = [], None
            try:
                for chunk in self.stub.GenerateStream(message, metadata=[("application", APP)], timeout=120):
                    tokens.extend(chunk.token_ids)
                    self.first_chunk.set()
            except grpc.RpcError as exc:
                error = exc
            self.results.append((tokens, error, after))
            self.first_chunk.set()
            if after or error is not None:
                return


def test_a_draft_swap_under_streaming_load_fails_no_request_and_restarts_no_replica(
    swap_app, other_draft_dir, plain_tokens, tmp_path
):
    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    address, deploy = swap_app
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerationServiceStub(channel)
    before = _replicas()
    assert len(before) == 3, before  # router, target, draft
    swapped = threading.Event()
    streams = [_Stream(stub, i, swapped) for i in range(STREAMS)]
    try:
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.first_chunk.wait(120)  # every stream holds a session on the old draft
        config = deploy(other_draft_dir)  # returns once the application runs the new config
        swapped.set()
        for stream in streams:
            stream.join(180)
        assert _replicas() == before  # reconfigured in place: no replica restarted
        assert _draft_models(config) == [str(other_draft_dir)]
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("application", APP)], timeout=30)
        assert info.draft_model == str(other_draft_dir)

        for stream in streams:
            assert [after for *_, after in stream.results][-1], "no request started after the swap"
            for tokens, error, _ in stream.results:
                assert error is None, error
                assert tokens == plain_tokens[stream.index]

        # A checkpoint that does not load: the draft replicas keep serving the one they have, and nothing restarts.
        (tmp_path / "not_a_model").mkdir()
        config = deploy(tmp_path / "not_a_model")
        assert _draft_models(config) == [str(other_draft_dir)]
        assert _replicas() == before
        message = pb.GenerateRequest(
            prompt_token_ids=PROMPTS[0], sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        response = stub.Generate(message, metadata=[("application", APP)], timeout=120)
        assert list(response.token_ids) == plain_tokens[0] and response.speculation.accepted > 0
    finally:
        swapped.set()
        channel.close()
