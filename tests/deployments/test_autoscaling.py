"""Worker autoscaling (`deployments.autoscaling`): the config, the policy Serve's controller runs, and the served
stack scaling its workers up under load and back down after, draining what it stops (real Ray Serve, tiny models).
"""

from __future__ import annotations

import grpc
import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import SESSIONS, SLOTS, WAITING, desired_replicas, serve_options
from deployments.serve_config import parse_config
from specdec_core.errors import InvalidArgument


def _config(**target):
    return parse_config({"target": {"model": "m", **target}, "draft": {"method": "draft_model", "model": "d"}})


# -- config ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling, field",
    [
        ({"min_replicas": 3, "max_replicas": 2}, "target.autoscaling"),
        ({"min_replicas": 0}, "target.autoscaling.min_replicas"),
        ({"max_replicas": 4, "initial_replicas": 5}, "target.autoscaling"),
        ({"target_sessions_per_replica": 0}, "target.autoscaling.target_sessions_per_replica"),
        ({"upscale_delay": 5}, "target.autoscaling.upscale_delay"),  # a misspelt key is named
        ({"look_back_period_s": 5}, "target.autoscaling"),  # within Serve's 10 s between reports
        ({"look_back_period_s": 2, "metrics_interval_s": 2}, "target.autoscaling"),
    ],
)
def test_bad_autoscaling_is_named(scaling, field):
    with pytest.raises(InvalidArgument) as err:
        _config(autoscaling=scaling)
    assert field in str(err.value)


def test_autoscaling_sets_the_replicas_the_router_waits_for_and_the_cluster_must_hold():
    from deployments.launch import cpus_needed

    fixed = _config(num_replicas=3, num_cpus=2)
    assert (fixed.target.initial_replicas, fixed.target.most_replicas) == (3, 3)
    scaled = _config(num_replicas=3, num_cpus=2, autoscaling={"min_replicas": 2, "max_replicas": 5})
    assert (scaled.target.initial_replicas, scaled.target.most_replicas) == (2, 5)  # num_replicas is ignored
    assert _config(autoscaling={"max_replicas": 5, "initial_replicas": 4}).target.initial_replicas == 4
    assert cpus_needed(scaled) == 2 * 5 + 0.5 + 1 + 1  # targets at most, router, one draft worker, Serve


def test_the_serve_options_are_serves_own_and_name_the_session_policy():
    fixed = serve_options(_config(num_replicas=2, drain_timeout_s=30).target)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["graceful_shutdown_timeout_s"] > 30  # Serve kills a stopping replica only after the drain
    options = serve_options(
        _config(
            autoscaling={"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 2, "target_sessions_per_replica": 5}
        ).target
    )
    assert "num_replicas" not in options
    serve_config = AutoscalingConfig(**options["autoscaling_config"])  # Serve validates it
    assert (serve_config.min_replicas, serve_config.max_replicas, serve_config.upscale_delay_s) == (1, 3, 2)
    assert serve_config.policy.policy_function == "deployments.autoscaling:SessionLoad"
    assert serve_config.policy.policy_kwargs == {"target_sessions_per_replica": 5}


# -- the policy ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "held, slots, waiting, target, replicas",
    [
        ([4, 4, 4], [4, 4, 4], 0, 4, 3),  # as many as hold the sessions
        ([4], [4], 8, 4, 3),  # waiting sessions count: one step to the replicas they need
        ([1, 0, 0], [4, 4, 4], 0, 4, 1),  # few sessions: fewer replicas
        ([0, 0], [8, 8], 0, None, 0),  # idle (Serve keeps min_replicas)
        ([6, 6], [8, 8], 6, None, 3),  # default: three quarters of the slots, 6 of 8
        ([5], [4], 0, 4, 2),  # rounded up
    ],
)
def test_the_replicas_for_a_load(held, slots, waiting, target, replicas):
    import math

    assert math.ceil(desired_replicas(held, slots, waiting, target)) == replicas


def _context(metrics, target_num_replicas=2):
    """A context as Serve's controller builds it for a deployment's policy."""
    replicas = sorted({r for by_replica in metrics.values() for r in by_replica})
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="TargetWorker",
        app_name="a",
        current_num_replicas=len(replicas),
        target_num_replicas=target_num_replicas,
        running_replicas=replicas,
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=None,
    )


def test_the_policy_serve_unpickles_reads_what_the_replicas_report():
    """Through Serve's own handling of the policy: resolved from its import path, pickled by value (as it travels
    to the controller), instantiated with its kwargs."""
    options = serve_options(_config(autoscaling={"max_replicas": 8, "target_sessions_per_replica": 3}).target)
    policy_config = AutoscalingConfig(**options["autoscaling_config"]).policy
    policy = policy_config.get_policy()(**policy_config.policy_kwargs)
    reported = {SESSIONS: {"r1": 3.0, "r2": 3.0}, SLOTS: {"r1": 4.0, "r2": 4.0}, WAITING: {"r1": 5.0, "r2": 6.0}}
    desired, state = policy(_context(reported))
    assert desired == 4  # (3 + 3 + 6) / 3: the waiting count is one figure, not one per replica
    assert state == {}
    noisy = {SESSIONS: {"r1": 2.0000000000000004, "r2": 1.0}, SLOTS: {"r1": 4.0, "r2": 4.0}, WAITING: {}}
    assert sum(noisy[SESSIONS].values()) / 3 > 1  # the float noise of time-weighted means...
    assert policy(_context(noisy))[0] == 1  # ...costs no replica: 3 sessions at 3 a replica
    assert policy(_context({}, target_num_replicas=2))[0] == 2  # nothing reported yet: no change


# -- served --------------------------------------------------------------------------------------------------------

APP = "specdec-scale"
SLOTS_PER_REPLICA = 4
PROMPTS = [list(range(5 + 9 * i, 17 + 9 * i)) for i in range(6)]
MAX_TOKENS = 200  # long enough that a replica being stopped holds sessions to drain
PEAK_STREAMS = 12  # target: (4 held + 8 waiting) / 4 -> 3 replicas
LOW_STREAMS = 2  # target: 2 / 4 -> 1 replica; draft: 2 / 2.5 -> 1


@pytest.fixture(scope="module")
def scaling_app(served):
    from ray import serve

    from deployments.app import build_app

    address, base = served
    fast = {
        "min_replicas": 1,
        "upscale_delay_s": 1,
        "downscale_delay_s": 3,
        "look_back_period_s": 2,
        "metrics_interval_s": 0.5,
    }
    worker = {"max_sequences": SLOTS_PER_REPLICA, "num_cpus": 0.5, "threads": 1, "drain_timeout_s": 60}
    config = parse_config(
        {
            **base.model_dump(mode="json"),
            "app_name": APP,
            "target": {
                **base.target.model_dump(mode="json"),
                **worker,
                "autoscaling": {**fast, "max_replicas": 3, "target_sessions_per_replica": 4},
            },
            "draft": {
                **base.draft.model_dump(mode="json"),
                **worker,
                "autoscaling": {**fast, "max_replicas": 2, "target_sessions_per_replica": 2.5},
            },
            # Requests wait for a slot while replicas start: longer than a start takes here.
            "router": {
                **base.router.model_dump(mode="json"),
                "worker_refresh_s": 1,
                "calibrate": False,
                "queue_timeout_s": 300,
            },
        }
    )
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield address, config
    serve.delete(APP)


@pytest.fixture(scope="module")
def greedy_reference(tiny_dir):
    from specdec_core.config import SamplingParams
    from specdec_core.models.loader import load_model
    from tests.helpers import make_engine, run_to_completion

    engine = make_engine(load_model(tiny_dir / "target", dtype="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    done = run_to_completion(engine, [(str(i), prompt, params, 0) for i, prompt in enumerate(PROMPTS)])
    return [tuple(done[str(i)][0]) for i in range(len(PROMPTS))]


def _request(stream: int, index: int):
    from specdec.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(
        prompt_token_ids=PROMPTS[(stream + index) % len(PROMPTS)],
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        cache_salt=f"{stream}-{index}",
    )  # no prefix shared: sessions spread by load
    message.speculation.num_speculative_tokens = 3
    return message


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")  # Serve's, at every status
def test_workers_scale_up_under_load_and_drain_down_after_with_every_request_exact(
    scaling_app, greedy_reference, capsys
):
    from specdec.v1 import generation_pb2_grpc as pb_grpc
    from specdec_tools.scaling import ScalingTimeline, StepLoad

    address, _ = scaling_app
    channel = grpc.insecure_channel(address)
    load = StepLoad(pb_grpc.GenerationServiceStub(channel), _request, metadata=[("application", APP)], timeout_s=300)
    timeline = ScalingTimeline(APP, load=load, interval_s=0.25).start()
    try:
        assert timeline.wait_for(lambda s: s.running("target") == 1 and s.running("draft") == 1, 60)
        load.set_streams(PEAK_STREAMS)
        peak = timeline.wait_for(lambda s: s.running("target") == 3 and s.running("draft") == 2, 180)
        # On at the peak until every target replica has held sessions, so that the scale-down has some to drain.
        every = timeline.wait_for(
            lambda s: (
                len(s.registered["target"]) == 3 and all(s.sessions["target"].get(a) for a in s.registered["target"])
            ),
            30,
        )
        load.set_streams(LOW_STREAMS)
        low = timeline.wait_for(
            lambda s: (
                (s.running("target"), s.stopping("target"), s.running("draft"), s.stopping("draft")) == (1, 0, 1, 0)
            ),
            180,
        )
        load.stop()
    finally:
        load.stop()
        timeline.stop()
        channel.close()
        with capsys.disabled():
            print(f"\nworker autoscaling timeline ({APP}; * = sessions on a draining replica):")
            print(timeline.table(changes_only=True))
    story = timeline.table()
    assert peak and every and low, story
    failed = [r for r in load.results if r.error is not None]
    assert not failed, (failed[:5], story)
    wrong = [r for r in load.results if r.token_ids != greedy_reference[(r.stream + r.index) % len(PROMPTS)]]
    assert not wrong, (len(wrong), story)
    assert len(load.results) > PEAK_STREAMS
    # The scale-down stopped replicas while requests ran, and none failed: a cut session would have. Whether a sample
    # caught a replica draining depends on how fast its sessions ended against the sampling interval, so it is not
    # asserted here; the drain itself is tested deterministically in test_remote.py (refusal, requeue, finish).
