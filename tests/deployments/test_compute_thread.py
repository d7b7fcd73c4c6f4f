"""The worker's compute thread: every call on one thread, in order; nested calls inline; errors to the caller."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deployments import worker_codec
from deployments.compute_thread import ComputeThread
from deployments.workers import TargetServicer
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import TokenShaping
from specdec_core.runner import ModelRunner
from specdec_core.target import LocalTarget, PrefillItem
from tests.deployments.loopback_workers import RUNNER, serve_locally


def test_calls_from_many_threads_all_run_on_the_one_compute_thread():
    compute = ComputeThread()
    with ThreadPoolExecutor(8) as pool:
        seen = set(pool.map(lambda _: compute.run(threading.get_ident), range(64)))
    assert len(seen) == 1 and threading.get_ident() not in seen


def test_a_call_made_from_the_compute_thread_runs_at_once():
    compute = ComputeThread()
    outer = compute.run(lambda: (threading.get_ident(), compute.run(threading.get_ident)))
    assert outer[0] == outer[1]


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    compute = ComputeThread()

    def fail():
        raise KeyboardInterrupt  # even what is no Exception: the caller gets it, the thread survives

    with pytest.raises(KeyboardInterrupt):
        compute.run(fail)
    assert compute.run(lambda a, b: a + b, 2, 3) == 5


def test_a_workers_forwards_run_on_the_thread_its_model_was_loaded_on(pair):
    """The servicer runs its calls on the compute thread it is given (`worker_deployments` loads the model there)."""
    compute = ComputeThread()
    target = LocalTarget(ModelRunner(pair[0].model, RUNNER))
    seen = []
    extend = target.runner.extend

    def recording(*args, **kwargs):
        seen.append(threading.get_ident())
        return extend(*args, **kwargs)

    target.runner.extend = recording
    servicer = TargetServicer(target, "tiny", compute=compute)
    server, address = serve_locally(servicer)
    try:
        stub = wpb_grpc.TargetServiceStub(grpc.insecure_channel(address))
        items = [PrefillItem(f"s{i}", list(range(5 + i, 20 + i)), TokenShaping(), None) for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda item: stub.Prefill(worker_codec.encode_prefill([item])), items))
    finally:
        server.stop(0)
    assert len(seen) == 3 and set(seen) == {compute.run(threading.get_ident)}
