"""Rollout serving at pod shape, on loopback: the shared secret on every RPC, request bounds,
versions that only go up, several engine replicas with failover and rejoin, the weight
directory channel (local and gs://), and a resumed pipeline seeing every prompt of the stream."""

import collections
import time

import grpc
import jax
import numpy as np
import pytest

from rl_scaling import data, tasks
from rl_scaling.serving import client as client_lib
from rl_scaling.rollout import pipeline as pipeline_lib
from rl_scaling.serving import server as server_lib
from rl_scaling.serving import weights_dir as weights_dir_lib
from rl_scaling.serving import wire
from tests.test_engine import make_engine
from tests.test_gcs import gcs  # noqa: F401 - the GCS emulator fixture

P, G, T = 2, 2, 8
TOKEN = "s3cret-for-tests"


def _server(mesh, **kw):
    eng = make_engine(mesh)
    return server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1", **kw).start()


def _pipeline(backend, stream=None, skip=None):
    task = tasks.ArithmeticTask(0)
    return pipeline_lib.Pipeline(backend, task, stream or data.prompt_stream(task, 0, P), prompts_per_step=P,
                                 samples_per_prompt=G, max_prompt_len=16, max_new_tokens=T, max_staleness=1,
                                 skip_prompts=skip)


def _raw(address, metadata=()):
    channel = grpc.insecure_channel(address)
    rpc = {n: channel.unary_unary(f"/rl_scaling.Rollout/{n}") for n in ("Health", "Submit", "Fetch")}
    push = channel.stream_unary("/rl_scaling.Rollout/PushWeights")
    return channel, rpc, push


def _code(call, request, metadata=()):
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=10, metadata=metadata)
    return e.value.code(), e.value.details()


def _zeros_push(params, version):
    return wire.weight_chunks(jax.tree.map(np.zeros_like, jax.device_get(params)), version)


def test_every_rpc_needs_the_token_and_a_run_is_unaffected_by_a_client_without_it(mesh1, tiny_params):
    srv = _server(mesh1, port=0, token=TOKEN)
    channel, rpc, push = _raw(srv.address)
    prompt = np.asarray([1, 5, 6], np.int32)
    submit = wire.pack({"session": "rogue", "groups": [{"id": 0, "num_samples": 2, "min_version": 0}]},
                       {"prompt_0": prompt})
    pipe = None
    try:
        for metadata in ((), ((wire.TOKEN_METADATA, "wrong"),)):
            for call, request in ((rpc["Health"], wire.pack({})), (rpc["Submit"], submit),
                                  (rpc["Fetch"], wire.pack({"ack": [], "timeout": 0})),
                                  (push, _zeros_push(tiny_params, 10**6))):
                code, details = _code(call, request, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED and "x-rl-scaling-token" in details, details
        with pytest.raises(pipeline_lib.RolloutError, match="UNAUTHENTICATED.*RL_SCALING_ROLLOUT_TOKEN"):
            client_lib.RemoteBackend(srv.address, reconnect_s=2)  # a trainer without the token: a named error

        pipe = _pipeline(client_lib.RemoteBackend(srv.address, reconnect_s=5, token=TOKEN))
        pipe.push_weights(tiny_params, 0)
        for step in range(1, 5):
            batch = pipe.next_batch()
            # the rogue client tries again between steps: zero weights at a huge version, a session change
            assert _code(push, _zeros_push(tiny_params, 10**6))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert _code(rpc["Submit"], submit)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert batch.v_last.max() <= step - 1 and srv.holder.version == step - 1
            assert np.all(batch.out.logprobs_BT[~batch.out.forced_BT & (batch.out.tokens_BT != 0)] < 0)
            pipe.push_weights(jax.tree.map(lambda x: x * 0.99, tiny_params), step)
        assert srv._session == pipe.backend.session  # never switched to the rogue's
        weights = jax.device_get(srv.holder.get()[0])
        assert all(np.abs(x).max() > 0 for x in jax.tree.leaves(weights))  # never the zeros
    finally:
        if pipe is not None:
            pipe.close()
        channel.close()
        srv.stop()


def test_bounds_and_versions_that_go_back_are_refused(mesh1, tiny_params):
    srv = _server(mesh1, port=0, token=TOKEN, max_submit_samples=64, max_fetches=1, session_lease_s=1.0)
    channel, rpc, push = _raw(srv.address)
    md = ((wire.TOKEN_METADATA, TOKEN),)
    prompt = np.asarray([1, 5, 6], np.int32)
    try:
        huge = wire.pack({"session": "a", "groups": [{"id": 0, "num_samples": 10**9, "min_version": 0}]},
                         {"prompt_0": prompt})
        code, details = _code(rpc["Submit"], huge, md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_samples=1000000000, allowed 1..4096" in details
        many = wire.pack({"session": "a", "groups": [{"id": i, "num_samples": 4, "min_version": 0} for i in range(17)]},
                         {f"prompt_{i}": prompt for i in range(17)})
        code, details = _code(rpc["Submit"], many, md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "68 samples; at most max_submit_samples=64" in details
        code, details = _code(rpc["Fetch"], wire.pack({"timeout": 1e6}), md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout must be in [0, 60" in details
        session = md + (("x-rl-scaling-session", "a"),)
        push(wire.weight_chunks(jax.device_get(tiny_params), 5), timeout=30, metadata=session)
        code, details = _code(push, wire.weight_chunks(jax.device_get(tiny_params), 4), session)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "version 4 is older than the server's 5" in details
        assert srv.holder.version == 5
        # a new trainer session (resumed from an older checkpoint, once session a's lease has lapsed)
        # starts its versions afresh
        time.sleep(1.2)
        push(wire.weight_chunks(jax.device_get(tiny_params), 2), timeout=30, metadata=md + (("x-rl-scaling-session", "b"),))
        assert srv.holder.version == 2
        # concurrent Fetches beyond the bound: RESOURCE_EXHAUSTED while one long-polls
        slow = rpc["Fetch"].future(wire.pack({"timeout": 3.0}), timeout=10, metadata=md)
        time.sleep(0.5)
        code, details = _code(rpc["Fetch"], wire.pack({"timeout": 0}), md)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent Fetch" in details
        slow.result()
    finally:
        channel.close()
        srv.stop()


def test_two_replicas_one_dies_the_run_continues_and_it_rejoins(mesh1, tiny_params):
    a, b = _server(mesh1, port=0), _server(mesh1, port=0)
    port_a = a.port
    pipe = _pipeline(client_lib.RemoteBackend([a.address, b.address], reconnect_s=5, probe_s=0.2))
    c = None
    seen = collections.Counter()
    killed_at = None
    try:
        params = tiny_params
        pipe.push_weights(params, 0)
        for step in range(1, 16):
            # from step 4, the first step at which both replicas hold groups in flight (how the
            # stream is spread at a given moment depends on the replicas' timing): a dies
            if killed_at is None and step >= 4 and all(r.outstanding for r in pipe.backend.replicas):
                a.stop(grace=0)
                killed_at = step
            if step == 9:  # a replica comes back on the same address
                assert killed_at is not None, "both replicas never held groups in flight at once by step 8"
                c = _server(mesh1, port=port_a)
                deadline = time.time() + 20
                while pipe.backend.counts["rejoins"] == 0 and time.time() < deadline:
                    pipe.backend.check()
                    time.sleep(0.1)
                assert c.holder.version == step - 1  # it got the current weights on rejoining
            batch = pipe.next_batch()
            assert batch.staleness.max() <= 1
            seen.update(batch.sample_ids.tolist())
            params = jax.tree.map(lambda x: x * 0.999, params)
            pipe.push_weights(params, step)
        # every group of the stream, in order (the wait policy is FIFO), each trained on once
        assert sorted(seen) == list(range(15 * P * G)) and max(seen.values()) == 1
        m = batch.metrics
        assert m["rollout/failovers"] >= 1 and m["rollout/redispatched_groups"] >= 1
        assert m["rollout/rejoins"] == 1 and m["rollout/replicas_live"] == 2
        assert c.holder.version == 15  # the rejoined replica has the current weights
        assert pipe.counts["consumed"] == 15 * P
    finally:
        pipe.close()
        for s in (a, b, c):
            if s is not None:
                s.stop()


def test_no_replica_left_stops_with_a_named_error(mesh1, tiny_params):
    a, b = _server(mesh1, port=0), _server(mesh1, port=0)
    pipe = _pipeline(client_lib.RemoteBackend([a.address, b.address], reconnect_s=2))
    try:
        pipe.push_weights(tiny_params, 0)
        pipe.next_batch()
        a.stop(grace=0)
        b.stop(grace=0)
        t = time.time()
        with pytest.raises(pipeline_lib.RolloutError, match=f"rollout servers {a.address}, {b.address} lost for 2 s"):
            for _ in range(100):
                pipe.next_batch()
        assert time.time() - t < 2 + 10
    finally:
        pipe.close()


@pytest.mark.parametrize("where", ["local", "gs"])
def test_weights_directory_channel(mesh1, tiny_params, tmp_path, where, request):
    directory = str(tmp_path / "weights")
    if where == "gs":
        request.getfixturevalue("gcs")
        directory = "gs://bucket/unit/weights"
    host = jax.device_get(tiny_params)
    for v in range(5):
        weights_dir_lib.write(directory, jax.tree.map(lambda x: x * (v + 1), host), v, keep=2)
    assert weights_dir_lib.latest(directory) == 4
    got, arrays = weights_dir_lib.read(directory, 4)
    leaf, key = jax.tree_util.tree_leaves_with_path(host)[0]
    assert got == 4 and np.array_equal(arrays[jax.tree_util.keystr(leaf)], key * 5)
    from rl_scaling import paths

    assert [n for n in paths.listdir(directory) if n.startswith("v")] == ["v0000000003", "v0000000004"]
    if where == "gs":
        return
    # a trainer writing, a replica polling: the run's weights reach the engine with no push
    srv = _server(mesh1, port=0, weights_dir=directory, poll_s=0.1)
    pipe = _pipeline(client_lib.RemoteBackend(srv.address, reconnect_s=5, weights_dir=directory))
    try:
        pipe.push_weights(tiny_params, 5)
        for step in range(6, 9):
            batch = pipe.next_batch()
            assert batch.v_first.min() >= 5
            pipe.push_weights(jax.tree.map(lambda x: x * 0.99, tiny_params), step)
        deadline = time.time() + 10
        while srv.holder.version != 8 and time.time() < deadline:
            time.sleep(0.05)
        assert srv.holder.version == 8
    finally:
        pipe.close()
        srv.stop()


def test_resumed_pipeline_regenerates_groups_in_flight(task=None):
    """Stop after some steps with groups in flight, resume from resume_state(): the two runs
    together train on exactly the stream's prompts, in order, none twice."""
    from tests.test_pipeline import _Scripted

    task = tasks.ArithmeticTask(0)
    reference = [p.prompt for batch in _take(data.prompt_stream(task, 0, P), 12) for p in batch]

    def run(pipe, backend, steps, start_version):
        prompts = []
        pipe.push_weights(None, start_version)
        for step in range(steps):
            pipe._top_up()
            for r in list(backend.submitted):
                if r.group_id in pipe._outstanding and r.group_id not in pipe._ready:
                    backend.finish(r.group_id, pipe.version)
            backend.submitted = [r for r in backend.submitted if r.group_id in pipe._outstanding]
            out = pipe.next_batch()
            prompts += [task.tokenizer.decode(out.prompt_tokens[i][out.prompt_mask[i]]) for i in range(0, P * G, G)]
            pipe.push_weights(None, start_version + step + 1)
        return prompts

    b1, s1 = _Scripted(), data.prompt_stream(task, 0, P)
    p1 = _pipeline(b1, s1)
    first = run(p1, b1, 5, 0)
    p1._top_up()  # groups in flight at the checkpoint
    assert len(p1._outstanding) > 0
    state = p1.resume_state()
    s2 = data.prompt_stream(task, 0, P)
    s2.set_state(state["stream"])
    b2 = _Scripted()
    second = run(_pipeline(b2, s2, skip=state["skip"]), b2, 5, 5)
    assert first + second == reference[: 10 * P]


def _take(it, n):
    return [next(it) for _ in range(n)]
