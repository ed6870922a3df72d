"""One generator mesh, used everywhere: the engine the pipeline and launch/serve.py build
(topology.make_engine) lives on config.tpu.gen_mesh with the shardings the dry run compiles
generation with (dry_run.generation_layout), on 8 fake CPU devices; decoding on a
tensor-parallel generator mesh gives the single-device engine's tokens and log-probs."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from configs import tiny
from rl_scaling import config as config_lib, dry_run, sharding
from rl_scaling.rollout import engine as engine_lib
from rl_scaling.rollout import generator as generator_lib
from rl_scaling.rollout import topology
from rl_scaling.tasks.tokenizer import CharTokenizer
from tests.conftest import TINY

TOK = CharTokenizer()
GEN_MESH = dict(data=1, fsdp=4, tensor=2, expert=1)
ROWS = ("data", "fsdp", "expert")  # sharding.LOGICAL_RULES' "batch"


def _config():
    config = tiny.get_config()
    config.tpu.gen_mesh = dict(GEN_MESH)
    config.rollout.engine_slots = 8
    return config


def _specs(tree):
    return jax.tree.map(lambda s: s.spec, tree, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))


def test_engine_shardings_equal_the_dry_runs():
    config = _config()
    gen_cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    eng, holder = topology.make_engine(config, gen_cfg, TOK, jax.devices())
    assert dict(eng.mesh.shape) == GEN_MESH
    from flax import linen as nn

    from rl_scaling.policy import model as model_lib

    holder.set(nn.unbox(model_lib.init_params(gen_cfg, jax.random.key(0))), 0)
    live_params, _ = holder.get()  # what the decode step reads: split per layer
    live_cache = eng.init_decode_state()["cache"]

    dry = dry_run.generation_layout(config, jax.devices())  # what compile_generation compiles
    assert dict(dry["mesh"].shape) == dict(dry["replica_mesh"].shape) == GEN_MESH
    want_params = _specs(jax.tree.map(lambda a: a.sharding, dry["params"]))
    want_cache = _specs(jax.tree.map(lambda a: a.sharding, dry["cache"]))
    assert _specs(jax.tree.map(lambda a: a.sharding, live_params)) == want_params
    assert _specs(jax.tree.map(lambda a: a.sharding, live_cache)) == want_cache
    assert jax.tree.structure(live_cache) == jax.tree.structure(dry["cache"])

    # ... and both are the layout sharding.LOGICAL_RULES gives, written out by hand
    layer = want_params["layers"][0]
    assert layer["attn"]["q"]["kernel"] == PS(("fsdp", "expert"), "tensor", None)
    assert layer["attn"]["o"]["kernel"] == PS("tensor", None, ("fsdp", "expert"))
    assert layer["mlp"]["down"]["kernel"] == PS("tensor", ("fsdp", "expert"))
    assert want_params["embed"] == PS("tensor", ("fsdp", "expert"))
    assert want_cache["k"][0] == want_cache["v"][1] == PS(ROWS, "tensor", None, None)
    assert want_cache["index"] == PS(ROWS)
    # every live leaf really is spread over the 8 devices it says
    assert {d.id for d in live_cache["k"][0].sharding.device_set} == {d.id for d in jax.devices()}
    assert "tensor" in dry["replica_layout"].describe() and "fsdp" in dry["replica_layout"].describe()


def test_generator_mesh_is_one_replica_of_gen_mesh():
    devices = jax.devices()
    # gen_mesh's `data` counts replicas over the whole slice: one engine on 2 chips is one replica
    assert dict(engine_lib.generator_mesh(dict(data=8, tensor=2), devices[:2]).shape) == dict(
        data=1, fsdp=1, tensor=2, expert=1)
    assert dict(engine_lib.generator_mesh(dict(data=8, tensor=2), devices).shape)["data"] == 4
    assert dict(engine_lib.generator_mesh(dict(data=-1, fsdp=1), devices[:1]).shape) == dict(
        data=1, fsdp=1, tensor=1, expert=1)
    with pytest.raises(ValueError, match=r"config\.tpu\.gen_mesh=.*tensor.*8.*3 engine device"):
        engine_lib.generator_mesh(dict(data=1, tensor=8), devices[:3])


def _decode(eng, params, prompts, G=3):
    holder = eng.load_params()
    holder.set(params, 0)
    gen = generator_lib.Generator(eng, holder).start()
    try:  # one submit: the loop sees every group at once, slot order is the same on both meshes
        gen.submit([generator_lib.GroupRequest(i, np.asarray(TOK.encode(p), np.int32), G)
                    for i, p in enumerate(prompts)])
        results = sorted((gen.results.get(timeout=300) for _ in prompts), key=lambda r: r.group_id)
        gen.check()
    finally:
        gen.stop()
    return results


def test_tensor_parallel_decode_equals_single_device(tiny_params):
    def engine(mesh):
        return engine_lib.PolicyEngine(TINY, mesh, slots=4, max_prefill_length=16, max_new_tokens=8,
                                       stop_tokens=(TOK.eos_id,), pad_id=TOK.pad_id, seed=5)

    one = engine(sharding.make_mesh({"fsdp": 1}, jax.devices()[:1]))
    tp = engine(engine_lib.generator_mesh(GEN_MESH, jax.devices()))
    assert dict(tp.mesh.shape)["tensor"] == 2
    prompts = ["<bos>045+007=<think>", "<bos>", "<bos>12*3=<think>"]
    ref, got = _decode(one, tiny_params, prompts), _decode(tp, tiny_params, prompts)
    assert any("tensor" in str(s.spec) for s in jax.tree.leaves(tp.param_shardings))
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.lengths, a.lengths)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    # sampled at temperature 1: the 9 samples are not all the same (a real comparison of draws)
    assert len({r.tokens[j].tobytes() for r in ref for j in range(len(r.lengths))}) > 1
