"""The JetStream engine over the Flax policy: exact log-probs and versions through the
Engine API, forced interruption, weight pushes (resharded, in flight) without
recompilation, fault reporting, and the stock JetStream orchestrator driving the engine."""

import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_scaling import sharding
from rl_scaling.rl import train_step as ts
from rl_scaling.rollout import engine as engine_lib
from rl_scaling.rollout import generator as generator_lib
from rl_scaling.rollout.jetstream_compat import jetstream_pb2, orchestrator
from rl_scaling.tasks.tokenizer import CharTokenizer
from tests.conftest import TINY

TOK = CharTokenizer()
T = 8  # max new tokens


# ScaleRL's forced interruption: thinking budget U{4, 5}, then </think> injected, 2 tokens to answer
INTERRUPT = engine_lib.Interrupt((TOK.think_end_id,), 4, 5, 2, TOK.think_end_id)


def make_engine(mesh, cls=engine_lib.PolicyEngine):
    """The tests' engine; the same settings everywhere, so a test process compiles it once."""
    return cls(TINY, mesh, slots=4, max_prefill_length=16, max_new_tokens=T, stop_tokens=(TOK.eos_id,),
               pad_id=TOK.pad_id, tokenizer=TOK, interrupt=INTERRUPT)


@pytest.fixture(scope="module")
def engine(mesh1):
    return make_engine(mesh1)


def _prompt(text):
    return np.asarray(TOK.encode(text), np.int32)


def _recompute(params, prompt, tokens, lengths):
    """Teacher-forced log-probs of the generated tokens, on the packed sequences."""
    G, P = tokens.shape[0], len(prompt)
    seq = np.concatenate([np.tile(prompt, (G, 1)), tokens], 1)
    mask = np.concatenate([np.ones((G, P), bool), np.arange(T)[None] < lengths[:, None]], 1)
    return np.asarray(ts.token_logprobs(params, TINY, jnp.asarray(seq), jnp.asarray(mask)))[:, P - 1:], mask[:, P:]


@pytest.mark.parametrize("sharded", [False, True], ids=["1_device", "8_devices"])
def test_logprobs_through_engine_match_teacher_forced_recompute(engine, tiny_params, sharded):
    if sharded:  # slots over data x fsdp, heads and MLP over tensor, traced under the mesh
        engine = make_engine(sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    holder = engine.load_params()
    holder.set(tiny_params, 3)
    gen = generator_lib.Generator(engine, holder).start()
    try:
        prompts = ["<bos>045+007=<think>", "<bos>", "<bos>12*3=<think>"]  # 1-token prompt included
        # 3 groups x 3 samples on 4 slots: groups are split over slots and waves
        gen.submit([generator_lib.GroupRequest(i, _prompt(p), 3) for i, p in enumerate(prompts)])
        results = sorted((gen.results.get(timeout=120) for _ in prompts), key=lambda r: r.group_id)
        gen.check()
    finally:
        gen.stop()
    assert not gen.alive
    n_interrupted = 0
    for r, text in zip(results, prompts):
        np.testing.assert_array_equal(r.prompt, _prompt(text))
        lp, mask = _recompute(tiny_params, r.prompt, r.tokens, r.lengths)
        sampled = mask & ~r.forced
        assert np.abs(np.where(sampled, lp - r.logprobs, 0)).max() < 1e-5
        assert np.all(np.where(mask, r.versions, -1) == np.where(mask, 3, -1)) and np.all(r.versions[~mask] == -1)
        assert r.v_first == r.v_last == 3
        for j in range(3):
            n, toks = r.lengths[j], r.tokens[j]
            assert np.all(toks[n:] == TOK.pad_id)
            if r.interrupted[j]:  # the phrase came at the budget, was not trained on, and the answer was cut at 2
                k = int(np.argmax(r.forced[j]))
                n_interrupted += 1
                assert k in (4, 5) and toks[k] == TOK.think_end_id and r.logprobs[j, k] == 0.0
                assert TOK.think_end_id not in toks[:k] and r.forced[j].sum() == 1
                assert r.stopped[j] and (n == k + 1 + 2 or toks[n - 1] == TOK.eos_id)
            elif r.stopped[j]:  # finish reasons: a stop token ends a sample, otherwise the budget does
                assert r.finish_reasons[j] == "stop"
            else:
                assert n == T and r.finish_reasons[j] == "length"
    assert n_interrupted > 0


def test_weight_push_in_flight_is_resharded_and_never_recompiles(engine, tiny_params):
    # Trainer-side params on an 8-device fsdp mesh; the engine lives on one device.
    train_mesh = sharding.make_mesh({"fsdp": -1})
    param_sh = engine_lib.param_shardings(TINY, train_mesh)
    # a jitted copy: device_put could alias the session fixture's buffers, which are donated below
    train_params = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=param_sh)(tiny_params)
    bump = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.05, p), donate_argnums=0)

    holder = engine.load_params()
    holder.set(train_params, 0)
    state = engine.init_decode_state()
    prefix = engine.prefill(params=holder, padded_tokens=np.pad(_prompt("<bos>045+007=<think>"), (0, 6)),
                            true_length=10)
    for slot in range(4):
        state = engine.insert(prefix, state, slot)
    state, _ = engine.generate(holder, state)
    train_params = bump(train_params)  # one push to warm up the test's own update function
    holder.set(train_params, 0)
    jax.block_until_ready(train_params)  # everything is compiled now
    before = engine.compile_counts()
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        versions = []
        for step in range(1, 4):  # sequences stay in flight across three pushes
            train_params = bump(train_params)  # the trainer donates its old params
            holder.set(train_params, step)
            state, result = engine.generate(holder, state)
            cols = engine_lib.unpack(result.data)
            live = cols["valid"]
            assert live.any() and np.all(cols["length"][live] == step + 1)
            versions.append(set(cols["version"][live].tolist()))
        train_params = bump(train_params)  # donating the last pushed params must not hurt the engine
        state, result = engine.generate(holder, state)
        jax.block_until_ready(result.data)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert versions == [{1}, {2}, {3}]
    assert engine.compile_counts() == before and compiles == []
    params, version = holder.get()
    assert version == 3 and jax.tree.leaves(params)[0].sharding.mesh.devices.size == 1


class _FailingEngine(engine_lib.PolicyEngine):
    calls = 0

    def generate(self, params, decode_state):
        self.calls += 1
        if self.calls > 2:
            raise FloatingPointError("injected engine fault")
        return super().generate(params, decode_state)


def test_engine_fault_is_reported_not_fatal(mesh1, tiny_params):
    eng = make_engine(mesh1, _FailingEngine)
    holder = eng.load_params()
    holder.set(tiny_params, 0)
    gen = generator_lib.Generator(eng, holder).start()
    gen.submit([generator_lib.GroupRequest(0, _prompt("<bos>1+2=<think>"), 2)])
    deadline = time.time() + 60
    while gen.alive and time.time() < deadline:
        time.sleep(0.05)
    assert not gen.alive
    with pytest.raises(RuntimeError, match="injected engine fault"):
        gen.check()
    gen.stop()


def test_stock_jetstream_driver_serves_the_engine(engine, tiny_params):
    """JetStream's own orchestrator (prefill/transfer/generate/detokenize threads) runs
    the engine unchanged; it returns token ids only (hence our Generator for RL)."""
    holder = engine.load_params()
    holder.set(tiny_params, 0)
    driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine], prefill_params=[holder],
                                 generate_params=[holder], interleaved_mode=True)
    # The loop must outlive the Driver's threads: they still call into it right after the stream ends
    # (an exception in a Driver thread SIGKILLs the process).
    loop = asyncio.new_event_loop()
    try:
        servicer = orchestrator.LLMOrchestrator(driver)
        ids = TOK.encode("045+007=<think>")  # the Driver prepends <bos>
        request = jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids),
                                              max_tokens=T)

        async def decode():
            out = []
            async for response in servicer.Decode(request):
                out.extend(response.stream_content.samples[0].token_ids)
            return out

        tokens = loop.run_until_complete(asyncio.wait_for(decode(), 120))
    finally:
        driver.stop()
        loop.close()
    assert 1 <= len(tokens) <= T and all(0 <= t < TINY.vocab_size for t in tokens)
