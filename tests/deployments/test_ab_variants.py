"""The A/B test of draft variants in the router: assignment by weight and by pin, and demotion of a variant that
does worse than the control, on a synthetic drop and never on noise."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from deployments.ab_variants import Demoter, VariantTable, judge
from deployments.serve_config import Demotion, DraftVariant
from specdec_core.errors import InvalidArgument
from specdec_core.watch import AcceptanceWatch, RoundSample
from tests.helpers import perturbed_checkpoint, worker_stats

K = 4


def _variants(**weights: float) -> list[DraftVariant]:
    return [DraftVariant(name=name, method="ngram", weight=weight) for name, weight in weights.items()]


def test_requests_are_assigned_by_weight_within_tolerance():
    table = VariantTable(_variants(control=6, candidate=3, rare=1, off=0), "control", random.Random(0))
    n = 20_000
    counts = {name: 0 for name in table.names}
    for _ in range(n):
        counts[table.assign()] += 1
    assert counts["off"] == 0
    for name, share in (("control", 0.6), ("candidate", 0.3), ("rare", 0.1)):
        sigma = (share * (1 - share) / n) ** 0.5
        assert abs(counts[name] / n - share) < 5 * sigma, (name, counts)


def test_a_pinned_variant_is_served_whatever_its_weight_and_an_unknown_one_is_refused():
    table = VariantTable(_variants(control=1, off=0), "control", random.Random(0))
    assert {table.assign("off") for _ in range(20)} == {"off"}
    with pytest.raises(InvalidArgument) as refused:
        table.assign("nope")
    assert refused.value.field == "draft_variant" and "control, off" in refused.value.message


def _rounds(watch: AcceptanceWatch, variant: str, n: int, rate: float, rng: random.Random) -> None:
    """`n` rounds of k = K where each position is accepted with probability `rate` given those before it."""
    for _ in range(n):
        accepted = 0
        while accepted < K and rng.random() < rate:
            accepted += 1
        watch.record(
            RoundSample(variant=variant, k=K, proposed=K, accepted=accepted, committed=accepted + 1, seconds=0.1)
        )


RULE = Demotion(metric="either", margin=0.1, window_rounds=1000, min_rounds=200, consecutive_checks=3)


def _trial(candidate_rate: float, checks: int, seed: int) -> tuple[list[int], VariantTable]:
    """The checks (indices) at which the candidate was demoted, with 250 new rounds of each variant per check."""
    rng = random.Random(seed)
    table = VariantTable(_variants(control=1, candidate=1), "control")
    demoter, watch, demoted = Demoter(table, RULE), AcceptanceWatch(window_rounds=RULE.window_rounds), []
    for check in range(checks):
        _rounds(watch, "control", 250, 0.7, rng)
        _rounds(watch, "candidate", 250, candidate_rate, rng)
        if demoter.check({v: watch.snapshot(v) for v in table.names}):
            demoted.append(check)
    return demoted, table


def test_a_variant_whose_acceptance_drops_is_demoted_after_consecutive_checks():
    demoted, table = _trial(candidate_rate=0.45, checks=10, seed=1)
    # Judged from the first check (250 rounds >= min_rounds): demoted at the third in a row, once.
    assert demoted == [2]
    assert table.weights() == {"control": 1.0, "candidate": 0.0}
    assert table.assign("candidate") == "candidate"  # still served to requests that pin it
    table.set_weights({"candidate": 1.0})  # promotion: the config only
    assert table.weights()["candidate"] == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_a_variant_as_good_as_the_control_is_never_demoted_by_noise(seed):
    demoted, table = _trial(candidate_rate=0.7, checks=40, seed=seed)
    assert demoted == [] and table.weights()["candidate"] == 1.0


def test_too_few_rounds_are_not_judged_and_the_control_is_never_demoted():
    rng = random.Random(3)
    watch = AcceptanceWatch()
    _rounds(watch, "control", 100, 0.1, rng)
    _rounds(watch, "candidate", 100, 0.9, rng)
    assert judge(watch.snapshot("candidate"), watch.snapshot("control"), RULE) is None  # 100 < min_rounds
    _rounds(watch, "control", 300, 0.1, rng)
    _rounds(watch, "candidate", 300, 0.9, rng)
    table = VariantTable(_variants(control=1, candidate=1), "control")
    demoter = Demoter(table, RULE)
    for _ in range(5):  # the control does far worse: nothing to demote it against
        assert demoter.check({v: watch.snapshot(v) for v in table.names}) == []
    assert judge(watch.snapshot("control"), None, RULE) is None


@pytest.mark.parametrize("metric, demoted", [("acceptance", False), ("tokens_per_second", True), ("either", True)])
def test_the_configured_metric_is_the_one_judged(metric, demoted):
    """Same acceptance, but the candidate's rounds take twice as long (a slower draft): only tokens/s tells."""
    rng = random.Random(4)
    watch = AcceptanceWatch()
    for variant, seconds in (("control", 0.1), ("candidate", 0.2)):
        for _ in range(400):
            accepted = rng.randint(0, K)
            watch.record(
                RoundSample(
                    variant=variant, k=K, proposed=K, accepted=accepted, committed=accepted + 1, seconds=seconds
                )
            )
    rule = Demotion(metric=metric, margin=0.1, window_rounds=1000, min_rounds=200)
    verdict = judge(watch.snapshot("candidate"), watch.snapshot("control"), rule)
    assert verdict is not None and verdict.worse is demoted


# -- served: a draft deployment per variant that runs a model ---------------------------------------------------------

APP = "specdec-ab"


@pytest.fixture(scope="module")
def served_ab(served, tmp_path_factory):
    """A second application on the session's Serve A/B-testing a draft model (its own DraftWorker deployment)
    against n-gram lookup (in the router), every request logged."""
    from ray import serve

    from deployments.app import build_app
    from deployments.serve_config import parse_config

    address, base = served
    directory = tmp_path_factory.mktemp("ab-proposals")
    draft = base.draft.model_dump(mode="json")
    config = parse_config(
        {
            **{k: v for k, v in base.model_dump(mode="json").items() if k != "draft"},
            "app_name": APP,
            "drafts": [
                {**draft, "name": "model", "num_replicas": 1, "weight": 1},
                {"name": "lookup", "method": "ngram", "num_speculative_tokens": 3, "weight": 1},
            ],
            "proposal_log": {"directory": str(directory), "sample_rate": 1.0},
        }
    )
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield address, directory, config
    serve.delete(APP)


def test_served_variants_each_draft_and_are_named_in_responses_and_the_log(served_ab):
    import grpc
    from ray import serve

    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc
    from specdec_tools.proposals import read_records

    address, directory, _ = served_ab
    assert "DraftWorker-model" in serve.status().applications[APP].deployments
    metadata = [("application", APP)]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: n-gram lookup finds something to propose
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=60)
        assert {(v.name, v.method, v.control) for v in info.draft_variants} == {
            ("model", "draft_model", True),
            ("lookup", "ngram", False),
        }
        variants = {}
        for variant in ("model", "lookup"):
            request = pb.GenerateRequest(
                request_id=f"ab-{variant}",
                prompt_token_ids=prompt,
                draft_variant=variant,
                sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True),
            )
            response = stub.Generate(request, metadata=metadata, timeout=120)
            variants[variant] = response
            assert response.speculation.draft_variant == variant
        assert list(variants["model"].token_ids) == list(variants["lookup"].token_ids)  # greedy: the target's
        unary = [
            stub.Generate(
                pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2)),
                metadata=metadata,
                timeout=120,
            ).speculation.draft_variant
            for _ in range(16)
        ]
        assert set(unary) == {"model", "lookup"}  # 1 : 1; both drawn in 16 but for 2 ** -15 of runs
    deadline = time.monotonic() + 30
    while True:
        records = (
            {
                r["request_id"]: r
                for r in read_records([directory / "proposals.jsonl"])
                if r["request_id"].startswith("ab-")
            }
            if (directory / "proposals.jsonl").exists()
            else {}
        )
        if len(records) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {rid: (r["draft_variant"], r["method"]) for rid, r in records.items()} == {
        "ab-model": ("model", "draft_model"),
        "ab-lookup": ("lookup", "ngram"),
    }


def test_served_weights_and_models_change_by_a_config_update_without_restarting_a_replica(served_ab, tmp_path_factory):
    """Promotion (or demotion) by config, and a variant's hot swap: a redeploy that changes only weights and a
    variant's checkpoint reconfigures the routers and that variant's draft workers in place."""
    import grpc
    from ray import serve

    from deployments.app import build_app
    from deployments.serve_config import parse_config
    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    address, _, config = served_ab

    def replicas():  # the application's replica actors (Serve names them app#deployment#replica id)
        import ray

        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#" in a["name"])

    def variants():
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.GenerationServiceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), metadata=[("application", APP)], timeout=60
            )
        return {v.name: (v.model, v.weight) for v in info.draft_variants}

    old = config.variant("model").model
    assert variants() == {"model": (old, 1.0), "lookup": ("", 1.0)}
    before = replicas()
    assert len(before) >= 3  # the router, the target worker, the model variant's draft worker
    new = str(perturbed_checkpoint(Path(old), tmp_path_factory.mktemp("ab-swap") / "draft", scale=0.2, seed=3))
    data = config.model_dump(mode="json")
    data["drafts"][0]["model"], data["drafts"][1]["weight"] = new, 0.0
    data.pop("draft")
    serve.run(build_app(parse_config(data)), name=APP, route_prefix=f"/{APP}")
    assert variants() == {"model": (new, 1.0), "lookup": ("", 0.0)}
    assert replicas() == before
    (stats,) = worker_stats((None, parse_config(data)), "draft-model")
    assert stats.model == new
