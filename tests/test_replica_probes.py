"""Replica health probes run off the trainer's step path: a replica that is stopped (its
connection stays open, no RPC is ever answered) costs a poll nothing while it is probed in the
background;
a trainer that waits on its backend logs what it waits for."""

import logging
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from rl_scaling import data, tasks
from rl_scaling.serving import client as client_lib
from rl_scaling.rollout import pipeline as pipeline_lib
from rl_scaling.serving import wire
from rl_scaling.serving import server as server_lib
from tests.test_engine import make_engine
from tests.test_pipeline import G, P, T, _Scripted

HEALTH_TIMEOUT_S = 2.0  # client._health's RPC deadline: what an inline probe of a hung replica costs


class _Hung:
    """A gRPC server on loopback whose every rl_scaling.Rollout RPC blocks until the test ends: to its
    clients, a replica process that was stopped (SIGSTOP) with its connections open."""

    def __init__(self):
        self.release = threading.Event()

        def block(request, context):
            self.release.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

        def block_stream(request_iterator, context):
            return block(None, context)

        handlers = {n: grpc.unary_unary_rpc_method_handler(block) for n in ("Health", "Submit", "Fetch")}
        handlers["PushWeights"] = grpc.stream_unary_rpc_method_handler(block_stream)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(wire.SERVICE, handlers)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self):
        self.release.set()
        self.server.stop(0)


def test_a_hung_replica_is_probed_off_the_step_path(mesh1, tiny_params):
    hung = _Hung()
    eng = make_engine(mesh1)
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1").start()
    backend = client_lib.RemoteBackend([srv.address, f"127.0.0.1:{hung.port}"], probe_s=0.2)
    task = tasks.ArithmeticTask(0)
    pipe = pipeline_lib.Pipeline(backend, task, data.prompt_stream(task, 0, P), prompts_per_step=P,
                                 samples_per_prompt=G, max_prompt_len=16, max_new_tokens=T, max_staleness=1)
    try:
        pipe.push_weights(tiny_params, 0)
        assert [r.live for r in backend.replicas] == [True, False]
        calls, t_end = [], time.monotonic() + 2.5 * HEALTH_TIMEOUT_S
        while time.monotonic() < t_end:  # the trainer's polls while the hung replica is probed
            t0 = time.perf_counter()
            backend.check()
            backend.poll(0.01)
            calls.append(time.perf_counter() - t0)
        assert backend.counts["probes"] >= 1  # probes ran (and timed out) meanwhile ...
        assert max(calls) < HEALTH_TIMEOUT_S / 4, max(calls)  # ... but no poll waited for one
        assert "DEADLINE_EXCEEDED" in backend.replicas[1].last_error and not backend.replicas[1].live
        for step in range(1, 3):  # and the run goes on with the live replica
            batch = pipe.next_batch()
            assert batch.out.tokens_BT.shape == (P * G, T)
            pipe.push_weights(tiny_params, step)
    finally:
        pipe.close()
        srv.stop()
        hung.close()


def test_a_waiting_trainer_logs_what_it_waits_for(caplog):
    class Late(_Scripted):
        """Finishes every group 0.5 s after it was submitted."""

        t_submit = float("inf")

        def submit(self, requests):
            super().submit(requests)
            self.t_submit = time.monotonic()

        def poll(self, timeout):
            time.sleep(timeout)
            if time.monotonic() - self.t_submit > 0.5 and not self.done:
                for r in self.submitted:
                    self.finish(r.group_id, 0)
                self.submitted = []
            return super().poll(timeout)

        def waiting(self):
            return "replica A live, 2 groups in flight"

    task = tasks.ArithmeticTask(0)
    pipe = pipeline_lib.Pipeline(Late(), task, data.prompt_stream(task, 0, P), prompts_per_step=P,
                                 samples_per_prompt=G, max_prompt_len=16, max_new_tokens=T, max_staleness=1,
                                 poll_s=0.02, wait_log_s=0.2)
    pipe.push_weights(None, 0)
    with caplog.at_level(logging.INFO, logger="rl_scaling.rollout.pipeline"):
        batch = pipe.next_batch()
    assert np.asarray(batch.sample_ids).size == P * G
    lines = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert 1 <= len(lines) <= 4, lines  # about every wait_log_s, not every poll
    assert "groups [0, 1] (the oldest, in order)" in lines[0] and "replica A live, 2 groups in flight" in lines[0]
    assert "4 outstanding" in lines[0]
