"""JetStream's Orchestrator API on the rollout server, through JetStream's own generated stub
over loopback gRPC: Decode streams the policy's greedy continuation (checked against a greedy
decode by full forward passes, no KV cache), HealthCheck, and malformed requests on both
services answered INVALID_ARGUMENT while the server keeps serving."""

import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import zipfile

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_scaling.policy import model as model_lib
from rl_scaling.rollout import engine as engine_lib
from rl_scaling.rollout import generator as generator_lib
from rl_scaling.serving import client as client_lib
from rl_scaling.serving import wire
from rl_scaling.serving import server as server_lib
from rl_scaling.rollout.jetstream_compat import jetstream_pb2 as pb
from rl_scaling.rollout.jetstream_compat import jetstream_pb2_grpc
from rl_scaling.tasks.tokenizer import CharTokenizer
from tests.conftest import TINY

TOK = CharTokenizer()
PB, T = 16, 8  # max prompt length, max new tokens
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def served(mesh1, tiny_params):
    """A server with both services. Temperature 1e-6: the engine's draw is the argmax (the
    reference checks each step's top-2 logit gap dwarfs the scaled Gumbel noise)."""
    eng = engine_lib.PolicyEngine(TINY, mesh1, slots=4, max_prefill_length=PB, max_new_tokens=T,
                                  temperature=1e-6, stop_tokens=(TOK.eos_id,), pad_id=TOK.pad_id, tokenizer=TOK)
    srv = server_lib.RolloutServer(eng, eng.load_params(), jetstream=True).start()
    channel = grpc.insecure_channel(srv.address)
    try:
        yield srv, channel
    finally:
        channel.close()
        srv.stop()


def greedy_decoder(cfg, params, max_len=PB + T, max_new_tokens=T):
    """Greedy continuation of a prompt by full forward passes over the whole sequence so far."""
    L = max_len

    @jax.jit
    def logits_at(tokens_L, n):
        mask = (jnp.arange(L) < n)[None]
        logits, _ = model_lib.Decoder(cfg).apply({"params": params}, tokens_L[None], jnp.arange(L)[None], mask)
        return logits[0, n - 1]

    def run(prompt_ids, max_tokens=max_new_tokens):
        seq, out = list(prompt_ids), []
        while len(out) < max_tokens:
            logits = np.asarray(logits_at(jnp.asarray(seq + [0] * (L - len(seq)), jnp.int32), len(seq)))
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] > 1e-3, "a near tie: pick another prompt"
            token = int(np.argmax(logits))
            if token == TOK.eos_id:
                break
            out.append(token)
            seq.append(token)
        return out

    return run


@pytest.fixture(scope="module")
def greedy(tiny_params):
    return greedy_decoder(TINY, tiny_params)


def _stub(channel):
    return jetstream_pb2_grpc.OrchestratorStub(channel)


def _text_request(text, max_tokens=0):
    return pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=text), max_tokens=max_tokens)


def _token_request(ids, max_tokens=0):
    return pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=ids), max_tokens=max_tokens)


def _samples(stub, request):
    responses = list(stub.Decode(request, timeout=60))
    assert all(len(r.stream_content.samples) == 1 for r in responses)
    return [r.stream_content.samples[0] for r in responses]


def test_stock_stub_health_then_decode_matches_greedy_reference(served, greedy, tiny_params):
    srv, channel = served
    stub = _stub(channel)
    if srv.holder.version < 0:  # first test of the module: no weights yet
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).is_live is False
        with pytest.raises(grpc.RpcError) as err:
            _samples(stub, _text_request("12+3="))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no weights" in err.value.details()
        srv.holder.set(tiny_params, 0)
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).is_live is True

    for text in ("12+3=", "045+007=", "hello"):  # the first ends at <eos>, the others at the budget
        expected = greedy([TOK.bos_id, *TOK.encode(text)])  # JetStream prepends BOS
        assert expected, text
        samples = _samples(stub, _text_request(text))  # max_tokens unset: the engine's budget
        # one response per token, as JetStream streams them, each with its text
        assert [list(s.token_ids) for s in samples] == [[t] for t in expected]
        assert "".join(s.text for s in samples) == TOK.decode(expected)
        assert [s.text for s in samples] == [TOK.decode([t]) for t in expected]

        # max_tokens cuts the stream; a prompt that already starts with BOS gets no second one
        samples = _samples(stub, _text_request("<bos>" + text, max_tokens=2))
        assert [t for s in samples for t in s.token_ids] == expected[:2]

        # token ids in, token ids out (client-side tokenization: no text)
        samples = _samples(stub, _token_request(TOK.encode(text), max_tokens=T + 5))  # capped at the budget
        assert [t for s in samples for t in s.token_ids] == expected and all(s.text == "" for s in samples)


def test_generator_streams_each_token_then_the_result_and_reset_keeps_streamed_groups(served, tiny_params):
    """What Decode builds on: a streamed group's tokens arrive one by one, in order, before its
    result, never on the trainer's result queue; a new trainer session (reset) keeps it pending."""
    import queue

    srv, _ = served
    srv.holder.set(tiny_params, max(srv.holder.version, 0))
    version = srv.holder.version
    stream = queue.SimpleQueue()
    prompt = np.asarray(TOK.encode("<bos>045+007="), np.int32)
    srv.generator.submit([generator_lib.GroupRequest(-100, prompt, 2, min_version=version + 1, stream=stream)])
    srv.generator.reset()  # it waits for newer weights when the session changes: it stays
    srv.holder.set(tiny_params, version + 1)
    items = [stream.get(timeout=60)]
    while not isinstance(items[-1], generator_lib.GroupResult):
        items.append(stream.get(timeout=60))
    result, tokens = items[-1], items[:-1]
    assert result.group_id == -100 and srv.generator.results.empty()
    for j in range(2):
        streamed = [t for sample, t in tokens if sample == j]
        assert streamed == result.tokens[j, :result.lengths[j]].tolist()
    assert len(tokens) == int(result.lengths.sum())


def _rpc_error(call, *args, **kw):
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=30, **kw)
        if not isinstance(result, bytes):  # a response stream
            list(result)
    return err.value


def _assert_serves(srv, channel, greedy):
    """Both services still answer a well-formed request correctly."""
    samples = _samples(_stub(channel), _token_request(TOK.encode("12+3=")))
    assert [t for s in samples for t in s.token_ids] == greedy([TOK.bos_id, *TOK.encode("12+3=")])
    backend = client_lib.RemoteBackend(srv.address, reconnect_s=5)
    try:
        backend.submit([generator_lib.GroupRequest(7, np.asarray(TOK.encode("<bos>1+2="), np.int32), 2)])
        results = []
        for _ in range(100):
            results += backend.poll(0.5)
            if results:
                break
        assert [r.group_id for r in results] == [7] and results[0].tokens.shape == (2, T)
    finally:
        backend.close()
    assert srv.generator.alive and not srv.error()


def test_malformed_decode_and_health_check_get_invalid_argument(served, greedy, tiny_params):
    srv, channel = served
    if srv.holder.version < 0:
        srv.holder.set(tiny_params, 0)
    decode = channel.unary_stream("/jetstream_proto.Orchestrator/Decode")
    health = channel.unary_unary("/jetstream_proto.Orchestrator/HealthCheck")
    stub = _stub(channel)
    cases = [
        (decode, b"\xff\x00garbage", "not a jetstream_proto.DecodeRequest"),
        (decode, wire.pack({"session": "x", "groups": []}), "not a jetstream_proto.DecodeRequest"),
        # another message type that parses (its field 1 becomes an unknown field): no content
        (decode, pb.HealthCheckResponse(is_live=True).SerializeToString(), "neither"),
        (health, b"\xff\x00garbage", "not a jetstream_proto.HealthCheckRequest"),
        (stub.Decode, _token_request([5, 64, 3]), r"token ids must be in \[0, 64\)"),
        (stub.Decode, _token_request([5, -1]), r"token ids must be in \[0, 64\)"),
        (stub.Decode, _token_request([5] * PB), f"prompt of {PB + 1} tokens; this engine takes 1..{PB}"),
        (stub.Decode, _text_request("12+3=\u00e9"), "not in the vocabulary"),
        (stub.Decode, _text_request("12+3=", max_tokens=-1), "max_tokens=-1"),
        (stub.Decode, pb.DecodeRequest(session_cache="s1", text_content=pb.DecodeRequest.TextContent(text="1")),
         "session_cache"),
    ]
    for call, request, message in cases:
        err = _rpc_error(call, request)
        assert err.code() == INVALID, (request, err.code(), err.details())
        assert err.details().startswith(("Decode: ", "HealthCheck: ")) and "Traceback" not in err.details()
        assert re.search(message, err.details()), err.details()
    _assert_serves(srv, channel, greedy)


def test_server_fault_is_internal_with_one_line(served, monkeypatch):
    srv, channel = served

    def broken():
        raise RuntimeError("injected fault")

    monkeypatch.setattr(srv, "_stats", broken)
    err = _rpc_error(channel.unary_unary("/rl_scaling.Rollout/Health"), wire.pack({}))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "Health: server error: RuntimeError: injected fault"


class _Marker:
    """Unpickling this creates a file: proof that the server unpickled client data."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _npz(members: dict, compress=False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name + ".npy", data)
    return buf.getvalue()


def _npy(array, allow_pickle=False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def _meta(meta: dict) -> bytes:
    return _npy(np.frombuffer(json.dumps(meta).encode(), np.uint8))


def test_malformed_rollout_requests_get_invalid_argument_and_nothing_is_unpickled(served, greedy, tiny_params,
                                                                                   tmp_path):
    srv, channel = served
    if srv.holder.version < 0:
        srv.holder.set(tiny_params, 0)
    version = srv.holder.version
    rpc = {name: channel.unary_unary(f"/rl_scaling.Rollout/{name}") for name in ("Health", "Submit", "Fetch")}
    push = channel.stream_unary("/rl_scaling.Rollout/PushWeights")
    marker = tmp_path / "unpickled"
    pickled = np.empty(1, object)
    pickled[0] = _Marker(str(marker))
    huge_header = io.BytesIO()
    np.lib.format.write_array_header_1_0(huge_header, {"descr": "<i4", "fortran_order": False, "shape": (10**12,)})

    def submit(groups, **arrays):
        return wire.pack({"session": "s", "groups": groups}, arrays)

    good_group = {"id": 1, "num_samples": 2, "min_version": 0}
    prompt = np.asarray(TOK.encode("<bos>1+2="), np.int32)
    leaf = "['embed']['embedding']" if "['embed']['embedding']" in srv._shapes else next(iter(srv._shapes))
    shape = srv._shapes[leaf]

    def chunk(dtype=np.float32, shp=shape, key=leaf):
        data = np.zeros(shp, dtype).reshape(-1).view(np.uint8)
        return wire.pack({"version": 9, "key": key, "dtype": np.dtype(dtype).name, "shape": list(shp),
                                "part": 0, "parts": 1}, {"data": data})

    cases = [
        (rpc["Submit"], b"garbage bytes", "not a message of this service"),
        (rpc["Submit"], _token_request([1, 2]).SerializeToString(), "not a message of this service"),
        (rpc["Submit"], _npz({"__meta__": _meta({"session": "s", "groups": [good_group]}),
                              "prompt_1": _npy(pickled, allow_pickle=True)}), "not a message of this service"),
        (rpc["Submit"], _npz({"__meta__": _meta({"session": "s", "groups": [good_group]}),
                              "prompt_1": _npy(prompt)}, compress=True), "not an uncompressed .npy"),
        (rpc["Submit"], _npz({"__meta__": _meta({"session": "s", "groups": [good_group]}),
                              "prompt_1": huge_header.getvalue() + b"\0" * 16}), "not a plain array of its size"),
        (rpc["Submit"], _npz({"__meta__": _npy(np.arange(3.0))}), "__meta__ is float64"),
        (rpc["Submit"], wire.pack({"session": 3, "groups": []}), "field 'session' must be a str"),
        (rpc["Submit"], submit([good_group]), "no array prompt_1"),
        (rpc["Submit"], submit([good_group], prompt_1=prompt.astype(np.float32)), "1-D array of integer token ids"),
        (rpc["Submit"], submit([good_group], prompt_1=np.stack([prompt, prompt])), "1-D array of integer token ids"),
        (rpc["Submit"], submit([good_group], prompt_1=np.full(PB + 1, 5, np.int32)), "prompt of 17 tokens"),
        (rpc["Submit"], submit([good_group], prompt_1=np.asarray([1, 99], np.int32)), "token ids must be in"),
        (rpc["Submit"], submit([{**good_group, "num_samples": 10**9}], prompt_1=prompt), "num_samples=1000000000"),
        (rpc["Submit"], submit([{**good_group, "id": "1"}], prompt_1=prompt), "field 'id' must be an int"),
        (rpc["Fetch"], b"\x00\x01", "not a message of this service"),
        (rpc["Fetch"], wire.pack({"ack": ["x"], "timeout": 0}), "ack a list of group ids"),
        (rpc["Fetch"], wire.pack({"timeout": "soon"}), "field 'timeout' must be a float"),
        (rpc["Health"], b"garbage", "not a message of this service"),
        (push, iter([b"garbage"]), "not a message of this service"),
        (push, iter([chunk(np.int32)]), "weights are floating point, got dtype int32"),
        (push, iter([chunk(shp=(3, 5))]), f"has shape (3, 5), the server's model expects {tuple(shape)}"),
        (push, iter([chunk(key="['nope']")]), "the server's model has no weight ['nope']"),
        (push, iter([chunk(), wire.pack({"version": 9, "done": True, "leaves": 1})]), "weight push has no"),
        (push, iter([chunk()]), "ended before its last chunk"),
    ]
    session = ((server_lib.SESSION_METADATA, "s"),)  # a push without one is refused first (test_server_edges.py)
    for call, request, message in cases:
        err = _rpc_error(call, request, **({"metadata": session} if call is push else {}))
        assert not marker.exists(), f"the server unpickled client data ({message})"
        assert err.code() == INVALID, (message, err.code(), err.details())
        assert message in err.details() and "Traceback" not in err.details(), (message, err.details())
    assert srv.holder.version == version  # no malformed push changed the weights
    rpc["Health"](wire.pack({"session": "s", "release": True}), timeout=30)  # as a closing trainer does
    _assert_serves(srv, channel, greedy)


def test_pickle_marker_is_live():
    """The marker above would show an unpickling: unpickling it does create the file."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m")
        pickle.loads(pickle.dumps(_Marker(path))).close()
        assert os.path.exists(path)


def test_stock_script_runs_through_the_compat_module(served, greedy, tiny_params, tmp_path):
    """A script written as JetStream's tools/requester.py is (it imports jetstream.engine.token_utils,
    which needs seqio) runs with `python -m rl_scaling.rollout.jetstream_compat SCRIPT ARGS`."""
    srv, _ = served
    if srv.holder.version < 0:
        srv.holder.set(tiny_params, 0)
    script = tmp_path / "requester.py"
    script.write_text(
        "import sys, grpc\n"
        "from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc\n"
        "from jetstream.engine.token_utils import load_vocab  # noqa: F401 - needs seqio\n"
        "with grpc.insecure_channel(sys.argv[1]) as channel:\n"
        "    grpc.channel_ready_future(channel).result()\n"
        "    stub = jetstream_pb2_grpc.OrchestratorStub(channel)\n"
        "    request = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text=sys.argv[2]),\n"
        "                                          max_tokens=3)\n"
        "    print('Response:', ''.join(r.stream_content.samples[0].text for r in stub.Decode(request)))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "rl_scaling.rollout.jetstream_compat", str(script), srv.address,
                          "12+3="], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = TOK.decode(greedy([TOK.bos_id, *TOK.encode("12+3=")], max_tokens=3))
    assert out.stdout.strip().splitlines()[-1] == f"Response: {expected}"


@pytest.mark.slow
def test_launcher_serves_jetstream_from_a_params_checkpoint(tmp_path):
    """`launch/serve.py --jetstream --params=DIR` in its own process, asked by the stock stub."""
    from flax import linen as nn

    from configs import tiny
    from rl_scaling import checkpoint, config as config_lib

    config = tiny.get_config()
    cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    params = nn.unbox(model_lib.init_params(cfg, jax.random.key(3)))
    checkpoint.save_params(str(tmp_path / "params"), params)
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "serve.py"), "--port=0", f"--port_file={port_file}",
                             "--jetstream", f"--params={tmp_path / 'params'}", "--config.rollout.temperature=1e-6",
                             "--config.rollout.length_control=none", f"--config.rollout.max_new_tokens={T}",
                             "--config.rollout.engine_slots=4"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
            stub = _stub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).is_live is True
            err = _rpc_error(channel.unary_stream("/jetstream_proto.Orchestrator/Decode"), b"\xff\x00")
            assert err.code() == INVALID
            greedy = greedy_decoder(cfg, params, config.task.max_prompt_len + T)
            for text in ("12+3=", "045+007="):
                samples = _samples(stub, _text_request(text))
                expected = greedy([TOK.bos_id, *TOK.encode(text)])
                assert [t for s in samples for t in s.token_ids] == expected
                assert "".join(s.text for s in samples) == TOK.decode(expected)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(30)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
