"""Tensor parallelism across two real processes (Ray actors, gloo): the same logits and the same tokens as the
unsplit model, ranks that roll back together, and a dead rank that fails requests instead of hanging."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from specdec_core.errors import InvalidArgument
from specdec_core.models.loader import load_model
from specdec_core.models.tiny import build_tiny_model
from specdec_core.parallel import check_shardable
from specdec_core.runner import ModelRunner, RunnerConfig

RUNNER = RunnerConfig(num_slots=2, max_seq_len=128, max_extend=8)


@pytest.fixture(scope="module")
def kv_variants(tiny_dir):
    """Tiny models with fewer KV heads than ranks (1) and as many (2)."""
    paths = {}
    for kv in (1, 2):
        path = tiny_dir / f"tp_kv{kv}"
        if not path.exists():
            build_tiny_model(
                path,
                family="qwen2",
                seed=10 + kv,
                tokenizer_dir=tiny_dir / "tokenizer",
                num_heads=4,
                num_kv_heads=kv,
                vocab_size=400,
            )
        paths[kv] = path
    return paths


def test_sizes_that_do_not_split_are_refused_by_name(tiny_dir):
    args = load_model(tiny_dir / "target", dtype="float32").model.args  # 4 heads, 2 KV heads
    with pytest.raises(InvalidArgument, match="tensor_parallel_size.*attention heads"):
        check_shardable(args, 3)
    check_shardable(args, 4)  # 4 ranks over 2 KV heads: each KV head replicated on two ranks


def _sharded_logits(ray, path, world, prompt, steps, dtype="float32"):
    """Per rank: the logits of a prefill and of `steps` verify-sized extends, from a model sharded over `world`."""
    from deployments.ports import free_port as _free_port

    @ray.remote(num_cpus=1)
    def run(rank, init_method):
        import torch.distributed as dist

        from deployments.tensor_parallel import build_sharded_target

        target = build_sharded_target(str(path), dtype, "cpu", rank, world, init_method, RUNNER, 60)
        runner = target.runner
        slot = runner.allocate()
        outs = [runner.extend([slot], [prompt])]
        for step in steps:
            outs.append(runner.extend([slot], [step], all_logits=True))
            runner.truncate(slot, runner.length(slot) - 1)  # roll one back, as a rejection would
        dist.destroy_process_group()
        return outs

    init = f"tcp://127.0.0.1:{_free_port()}"
    return ray.get([run.remote(rank, init) for rank in range(world)], timeout=300)


def _unsplit_logits(model, prompt, steps):
    """`_sharded_logits` of one unsplit model."""
    runner = ModelRunner(model, RUNNER)
    slot = runner.allocate()
    want = [runner.extend([slot], [prompt])]
    for step in steps:
        want.append(runner.extend([slot], [step], all_logits=True))
        runner.truncate(slot, runner.length(slot) - 1)
    return want


@pytest.mark.parametrize("kv", [1, 2])
def test_two_ranks_give_the_unsplit_logits(ray_cluster, kv_variants, kv):
    prompt, steps = list(range(5, 25)), [[7, 8, 9], [40, 41], [3]]
    ranks = _sharded_logits(ray_cluster, kv_variants[kv], 2, prompt, steps)
    want = _unsplit_logits(load_model(kv_variants[kv], dtype="float32").model, prompt, steps)
    for outs in ranks:
        for got, expected in zip(outs, want):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for a, b in zip(*ranks):
        assert torch.equal(a, b)  # every rank sees the very same logits: they accept alike


# bf16 under tensor parallelism: each rank rounds its partial sums of o_proj and down_proj to bf16 and the
# all-reduce adds them in bf16, where the unsplit model rounds each full sum once. So the logits differ from the
# unsplit model's by rounding (bounded here as in tests/specdec_core/test_torch_paths.py), and greedy output may
# differ from the unsplit model's where that flips a near-tie. Every rank still gets the same bits (one all-reduce
# result), so the ranks accept alike; and on the CPU kernels each rank computes every row alike whatever the batch,
# so greedy speculation under TP reproduces plain decoding under TP bit for bit.
BF16_REL_BOUND = 5e-2


def test_two_ranks_in_bf16_stay_within_rounding_of_the_unsplit_logits(ray_cluster, kv_variants, record_property):
    from specdec_core.build import prepare_model

    prompt, steps = list(range(5, 25)), [[7, 8, 9], [40, 41], [3]]
    ranks = _sharded_logits(ray_cluster, kv_variants[2], 2, prompt, steps, dtype="bfloat16")
    want = _unsplit_logits(prepare_model(kv_variants[2], dtype="bfloat16").model, prompt, steps)
    worst = max(float((got - expected).abs().max() / expected.abs().max()) for got, expected in zip(ranks[0], want))
    record_property("bf16_tp2_max_relative_logit_difference", worst)
    print(f"bf16, 2 ranks vs unsplit: max |diff| / max |logit| = {worst:.3g}")
    assert worst <= BF16_REL_BOUND
    for a, b in zip(*ranks):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def served_tp(served, tiny_dir, near_draft_dir):
    """A second application on the session's Serve: the same pair with the target split over two ranks."""
    from ray import serve

    from deployments.app import build_app
    from deployments.serve_config import parse_config

    address, base = served
    config = parse_config(
        {
            **base.model_dump(mode="json"),
            "app_name": "specdec-tp",
            "target": {**base.target.model_dump(mode="json"), "tensor_parallel_size": 2},
            "draft": {**base.draft.model_dump(mode="json"), "num_replicas": 1},
        }
    )
    serve.run(build_app(config), name="specdec-tp", route_prefix="/specdec-tp")
    yield address
    serve.delete("specdec-tp")


def _generate(address, app, prompt, **sampling):
    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(**sampling),
        speculation=pb.SpeculationOptions(num_speculative_tokens=3),
    )
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.GenerationServiceStub(channel).Generate(request, metadata=[("application", app)], timeout=120)


def test_served_tp2_gives_the_tp1_tokens(served_tp, served):
    for prompt in (list(range(5, 30)), list(range(90, 97))):
        tp2 = _generate(served_tp, "specdec-tp", prompt, max_tokens=20, ignore_eos=True)
        tp1 = _generate(served_tp, "specdec", prompt, max_tokens=20, ignore_eos=True)
        assert list(tp2.token_ids) == list(tp1.token_ids)
        assert tp2.speculation.accepted == tp1.speculation.accepted > 0


def test_served_tp2_samples_the_tp1_tokens_with_the_same_seed(served_tp, served):
    """float32 logits of 2 ranks agree with the unsplit model's to about 1e-6 (above): a sampled token could change
    only where a uniform falls that close to a decision boundary (a CDF step, or p/q at acceptance), about one draw
    in a million. So the same seed gives the same tokens, rejections and recoveries included."""
    sampled, proposed, accepted = [], 0, 0
    for seed, prompt in ((1, list(range(5, 30))), (2, list(range(90, 97))), (3, list(range(200, 230)))):
        settings = {"max_tokens": 20, "ignore_eos": True, "temperature": 0.9, "seed": seed}
        tp2 = _generate(served_tp, "specdec-tp", prompt, **settings)
        tp1 = _generate(served_tp, "specdec", prompt, **settings)
        assert list(tp2.token_ids) == list(tp1.token_ids)
        assert tp2.speculation.accepted == tp1.speculation.accepted
        greedy = _generate(served_tp, "specdec", prompt, max_tokens=20, ignore_eos=True)
        sampled.append(list(tp1.token_ids) != list(greedy.token_ids))
        proposed, accepted = proposed + tp1.speculation.proposed, accepted + tp1.speculation.accepted
    assert any(sampled)  # the seeds did sample: not greedy output in disguise
    assert 0 < accepted < proposed  # acceptances and rejections (recovered tokens) both compared


def test_served_tp2_reuses_cached_prefixes_on_every_rank_alike(served_tp):
    prompt = list(range(60, 90))
    first = _generate(served_tp, "specdec-tp", prompt, max_tokens=12, ignore_eos=True)
    again = _generate(served_tp, "specdec-tp", prompt, max_tokens=12, ignore_eos=True)  # ranks that disagreed: failed
    assert again.usage.cached_tokens == len(prompt) - 1
    assert list(again.token_ids) == list(first.token_ids)


def test_a_dead_rank_fails_requests_as_unavailable(served_tp, ray_cluster):
    from deployments.tensor_parallel import RANK_NAME_PREFIX

    ranks = [
        a for a in ray_cluster.util.list_named_actors(all_namespaces=True) if a["name"].startswith(RANK_NAME_PREFIX)
    ]
    assert ranks, "no tensor-parallel rank actors found"
    for actor in ranks:
        ray_cluster.kill(ray_cluster.get_actor(actor["name"], namespace=actor["namespace"]))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _generate(served_tp, "specdec-tp", list(range(5, 30)), max_tokens=20, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert time.monotonic() - start < 100  # an answer, not a hang
