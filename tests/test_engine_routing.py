"""MoE routing replay over the JetStream engine (rl.routing_replay="r3" with rollout.mode=pipeline):
each generated token's experts per layer come out of the engine, through the generator and the
pipeline (in process, and from a replica over the wire), in the sync sampler's layout; they are
the routing of a teacher-forced recompute for at least 98% of token-layers, and replaying them
gives the trainer the generator's log-probs; the wire refuses a corrupt routing array by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from rl_scaling import data, sharding, tasks
from rl_scaling.policy import model as model_lib, moe, presets
from rl_scaling.rl import train_step as ts
from rl_scaling.serving import client as client_lib
from rl_scaling.rollout import collect
from rl_scaling.rollout import engine as engine_lib
from rl_scaling.rollout import generator as generator_lib
from rl_scaling.rollout import pipeline as pipeline_lib
from rl_scaling.serving import server as server_lib
from rl_scaling.serving import wire
from rl_scaling.tasks.tokenizer import CharTokenizer

TOK = CharTokenizer()
# float32, top-2 of 4 experts: decode and recompute round differently only at rare near-ties
CFG = dataclasses.replace(presets.tiny_moe(vocab_size=64, d_model=32, head_dim=8, mlp_dim=32, moe_mlp_dim=16,
                                           n_layers=2), num_experts=4, num_experts_per_tok=2)
P, G, T, L = 2, 3, 8, 16
ROUTING = (CFG.n_layers, CFG.num_experts_per_tok)


@pytest.fixture(scope="module")
def params():
    with jax.set_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
        return jax.device_get(nn.unbox(jax.jit(lambda: model_lib.init_params(CFG, jax.random.key(0)))()))


def _engine(record=True):
    mesh = sharding.make_mesh({"fsdp": 1}, jax.devices()[:1])
    return engine_lib.PolicyEngine(CFG, mesh, slots=4, max_prefill_length=L, max_new_tokens=T,
                                   stop_tokens=(TOK.eos_id,), pad_id=TOK.pad_id, seed=3, record_routing=record)


def _pipeline(backend, task):
    return pipeline_lib.Pipeline(backend, task, data.prompt_stream(task, 0, P), prompts_per_step=P,
                                 samples_per_prompt=G, max_prompt_len=L, max_new_tokens=T, max_staleness=1,
                                 routing_shape=ROUTING)


def _check_against_recompute(params, step):
    """The batch's routing vs a teacher-forced forward over the same (left-padded) sequences."""
    N = P * G
    routing = np.asarray(step.out.routing_BSLK)
    assert routing.shape == (N, L + T) + ROUTING and routing.dtype == np.int32
    batch = collect.rl_batch(step.prompt_tokens, step.prompt_mask, step.out, step.rewards, P, G)
    np.testing.assert_array_equal(batch["routing"], routing)  # what rl_step gets under r3
    tokens, tmask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["token_mask"])
    logp, inter = ts.token_logprobs(params, CFG, tokens, tmask, with_router=True)
    own = np.sort(np.asarray(moe.routing_of(inter, N, L + T - 1)), -1)
    # the token-layers whose routing a trained log-prob depends on: a real token with a real successor
    fed = np.asarray(tmask[:, :-1] & tmask[:, 1:])
    agree = np.all(own == np.sort(routing[:, :-1], -1), -1)[fed]  # [tokens, layers]
    assert agree.mean() >= 0.98, agree.mean()
    assert len(np.unique(routing[:, :-1][fed])) == CFG.num_experts  # every expert in use: a real test
    # replaying the engine's routing gives the trainer the generator's log-probs of the sampled tokens
    replayed = ts.token_logprobs(params, CFG, tokens, tmask, routing_BLlk=jnp.asarray(routing))
    gen_lp = np.asarray(batch["old_logp"])[:, 1:]
    sampled = np.asarray(batch["loss_mask"])[:, 1:] > 0
    assert np.abs(np.asarray(replayed) - gen_lp)[sampled].max() < 1e-4
    return agree.mean()


def test_embedded_pipeline_carries_the_engines_routing(params):
    task = tasks.ArithmeticTask(0)
    eng = _engine()
    assert eng.routing_shape == ROUTING
    pipe = _pipeline(pipeline_lib.EmbeddedBackend(eng, eng.load_params()), task)
    try:
        pipe.push_weights(params, 0)
        for _ in range(2):
            _check_against_recompute(params, pipe.next_batch())
    finally:
        pipe.close()


def test_a_group_without_routing_is_refused(params):
    """r3 asks for routing: an engine that does not record it stops the pipeline, naming it."""
    task = tasks.ArithmeticTask(0)
    eng = _engine(record=False)
    assert eng.routing_shape is None
    pipe = _pipeline(pipeline_lib.EmbeddedBackend(eng, eng.load_params()), task)
    try:
        pipe.push_weights(params, 0)
        with pytest.raises(pipeline_lib.RolloutError, match=r"routing of shape None, expected \(3, .*, 2, 2\)"):
            pipe.next_batch()
    finally:
        pipe.close()


def test_replica_sends_routing_over_the_wire(params):
    task = tasks.ArithmeticTask(0)
    eng = _engine()
    srv = server_lib.RolloutServer(eng, eng.load_params(), host="127.0.0.1").start()
    backend = client_lib.RemoteBackend([srv.address], routing=ROUTING + (CFG.num_experts,))
    pipe = _pipeline(backend, task)
    try:
        pipe.push_weights(params, 0)
        _check_against_recompute(params, pipe.next_batch())
    finally:
        pipe.close()
        srv.stop()


def _result(gid=7, n=5):
    rng = np.random.default_rng(0)
    return generator_lib.GroupResult(
        gid, np.arange(1, n + 1, dtype=np.int32), rng.integers(0, 64, (G, T), dtype=np.int32),
        np.zeros((G, T), np.float32), np.zeros((G, T), np.int32), np.full((G,), T, np.int32), np.zeros((G,), bool),
        np.zeros((G, T), bool), rng.integers(0, CFG.num_experts, (G, n + T) + ROUTING).astype(np.int32))


def test_wire_routing_round_trip_and_bounds():
    r = _result()
    spec = ROUTING + (CFG.num_experts,)
    arrays = wire.result_arrays(r, CFG.num_experts)
    assert arrays["routing_7"].dtype == np.uint8  # 4 experts: one byte a choice on the wire
    _, back = wire.unpack(wire.pack({}, arrays))
    got = wire.read_result(7, back, spec)
    assert got.routing.dtype == np.int32
    np.testing.assert_array_equal(got.routing, r.routing)
    np.testing.assert_array_equal(got.tokens, r.tokens)

    def refused(routing, match):
        bad = dict(back, routing_7=routing)
        with pytest.raises(wire.BadRouting, match=match):
            wire.read_result(7, wire.unpack(wire.pack({}, bad))[1], spec)

    high = r.routing.copy()
    high[1, 4, 0, 1] = CFG.num_experts
    refused(high, r"routing_7: expert ids must be in \[0, 4\), got 4 at \(sample, token, layer, k\) = \(1, 4, 0, 1\)")
    low = r.routing.copy()
    low[0, 0, 1, 0] = -1
    refused(low, r"routing_7: expert ids must be in \[0, 4\), got -1")
    refused(r.routing[:, :, :1], r"routing_7: shape \(3, 13, 1, 2\), expected \(3, 13, 2, 2\).*n_layers=2, k=2")
    refused(r.routing[..., :1], r"routing_7: shape .* expected \(3, 13, 2, 2\)")
    refused(r.routing[:, 1:], r"routing_7: shape \(3, 12, 2, 2\)")
    refused(r.routing.astype(np.float32), r"routing_7: expert ids must be integers, got float32")
    missing = {k: v for k, v in back.items() if k != "routing_7"}
    with pytest.raises(wire.BadRouting, match="routing_7: missing"):
        wire.read_result(7, missing, spec)
    # without routing replay the routing array is neither needed nor read
    assert wire.read_result(7, missing, None).routing is None


@pytest.mark.slow  # a warm start and 2 RL steps of a tiny MoE (~1-2 min on two cores)
def test_train_loop_runs_r3_in_pipeline_mode(tmp_path):
    """rl.routing_replay="r3" with rollout.mode=pipeline: the engine's routing reaches rl_step."""
    import json

    from rl_scaling import train
    from tests.test_pipeline import _tiny_run_config

    c = _tiny_run_config("pipeline", steps=2)
    c.model.num_experts, c.model.num_experts_per_tok, c.model.moe_mlp_dim = 4, 1, 32
    c.rl.routing_replay = "r3"
    result = train.train(c, str(tmp_path))
    assert result["step"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "router/replay_disagreement" in r]
    assert len(steps) == 2  # the trainer compared its own routers with the engine's record
    # replayed routing: the trainer's log-probs are the engine's to float32 rounding
    assert all(r["router/logp_mismatch"] < 1e-4 for r in steps), [r["router/logp_mismatch"] for r in steps]
