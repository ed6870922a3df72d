"""MoE layer: dropless ragged dispatch == dense oracle (values and gradients), the sharded
shard_map path == the single-device path, expert parallelism over 2, 4 and 8 fake devices ==
the dense oracle (values and gradients, balanced and all-to-one-expert routing), the padded
stand-in for ragged_all_to_all == the collective's documented semantics, the TPU/GPU exchange's
offsets against a numpy model of that collective and its whole path (moe.ragged_exchange) run on
CPU through an emulation of it, indivisible shapes as an error or a warning, sown router metrics. (KV-cache decode == recompute
on an MoE model is in test_hf_parity.py, on a model imported from transformers.)"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import linen as nn  # noqa: E402

from rl_scaling import sharding  # noqa: E402
from rl_scaling.policy import model as M  # noqa: E402
from rl_scaling.policy import moe, presets  # noqa: E402

CFG = presets.tiny_moe(vocab_size=64, d_model=32, head_dim=8, mlp_dim=32, moe_mlp_dim=16, n_layers=2)


def _one_device_mesh():
    return sharding.make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def params():
    with jax.set_mesh(_one_device_mesh()):
        return jax.device_get(nn.unbox(jax.jit(lambda: M.init_params(CFG, jax.random.key(0)))()))


def _batch(B=4, T=8, seed=1):
    toks = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)
    mask = jnp.ones((B, T), bool).at[0, :3].set(False)  # one left-padded row
    return toks, M.positions_from_mask(mask), mask


def _apply(cfg, params, toks, pos, mask):
    return _apply_jit(cfg, params, toks, pos, mask)


@jax.jit(static_argnums=0)
def _apply_jit(cfg, params, toks, pos, mask):
    return M.Decoder(cfg).apply({"params": params}, toks, pos, mask, mutable="intermediates")


def _moe_only(cfg, k):
    """A bare MoeMlp (no shared expert) and its params, to compare dispatchers directly."""
    cfg = dataclasses.replace(cfg, num_experts_per_tok=k, shared_expert=False)
    x = jax.random.normal(jax.random.key(3), (3, 5, cfg.d_model))
    with jax.set_mesh(_one_device_mesh()):
        p = nn.unbox(jax.jit(moe.MoeMlp(cfg).init)(jax.random.key(4), x))["params"]
    p = dict(p, router=p["router"] * 5.0)  # sharper routing: more distinct choices
    return cfg, p, x


@pytest.mark.parametrize("k", [1, 2])
def test_ragged_equals_dense_oracle_values_and_grads(k):
    cfg, p, x = _moe_only(CFG, k)

    def f(impl):
        c = dataclasses.replace(cfg, moe_impl=impl)
        return lambda p, x: moe.MoeMlp(c).apply({"params": p}, x)

    def both(p, x):  # one compile: outputs and gradients of both dispatchers
        outs = {}
        for impl in ("ragged", "dense"):
            loss = lambda p, x: jnp.sum(jnp.sin(f(impl)(p, x)))  # noqa: E731
            outs[impl] = (f(impl)(p, x), jax.grad(loss, argnums=(0, 1))(p, x))
        return outs

    outs = jax.jit(both)(p, x)
    (y_r, g_r), (y_d, g_d) = outs["ragged"], outs["dense"]
    np.testing.assert_allclose(y_r, y_d, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_gate_scales_expert_input_like_hf():
    """y = sum_e expert_e(sigmoid(l_e) x): with one expert and top-1, compare to a hand formula."""
    cfg = dataclasses.replace(CFG, num_experts=1, num_experts_per_tok=1, shared_expert=False)
    _, p, x = _moe_only(cfg, 1)
    y = jax.jit(moe.MoeMlp(cfg).apply)({"params": p}, x)
    g = jax.nn.sigmoid(x @ p["router"])  # [B, T, 1]
    xs = x * g
    want = (nn.silu(xs @ p["wi_gate"][0]) * (xs @ p["wi_up"][0])) @ p["wo"][0]
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)


def test_router_metrics_sown(params):
    (logits, _), inter = _apply(CFG, params, *_batch())
    assert np.isfinite(np.asarray(logits)).all()
    m = moe.router_metrics(inter)
    assert m["expert_load"].shape == (CFG.n_layers, CFG.num_experts)
    np.testing.assert_allclose(m["expert_load"].sum(-1), 1.0, rtol=1e-6)
    assert m["router_aux_loss"].shape == () and float(m["router_aux_loss"]) > 0.0
    assert moe.router_metrics({"intermediates": {}}) == {}


def test_sharded_path_matches_single_device(params):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    toks, pos, mask = _batch()
    (want, _), _ = _apply(CFG, params, toks, pos, mask)  # no mesh: plain ragged path
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(lambda: M.init_params(CFG, jax.random.key(0)))
        shard = sharding.tree_shardings(mesh, nn.get_partition_spec(abstract))
        p = jax.device_put(params, shard)
        fn = jax.jit(lambda p: M.Decoder(CFG).apply({"params": p}, toks, pos, mask)[0])
        assert "shard_map" in str(jax.make_jaxpr(fn)(p))
        got = fn(p)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert p["layers"]["moe"]["wi_gate"].sharding.spec[1] == "expert"


def test_bfloat16_runs_and_rejects_bad_impl(params):
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    (logits, _), _ = _apply(cfg, params, *_batch())
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="moe_impl"):
        _apply(dataclasses.replace(CFG, moe_impl="capacity"), params, *_batch())


# ---- expert parallelism ------------------------------------------------------------------------


def _ragged_all_to_all_numpy(operands, input_offsets, send_sizes, output_offsets, recv_sizes, out_rows):
    """jax.lax.ragged_all_to_all's documented pseudocode, over a list of per-device arrays."""
    n, K = len(operands), len(input_offsets[0])
    per = K // n
    outs = [np.zeros((out_rows,) + operands[0].shape[1:], operands[0].dtype) for _ in range(n)]
    for src in range(n):
        for j in range(K):
            dst = j // per
            # numpy slicing would clip silently; the collective's slices must lie inside both buffers
            assert 0 <= input_offsets[src][j] and input_offsets[src][j] + send_sizes[src][j] <= len(operands[src])
            assert 0 <= output_offsets[src][j] and output_offsets[src][j] + send_sizes[src][j] <= out_rows
            rows = operands[src][input_offsets[src][j]:input_offsets[src][j] + send_sizes[src][j]]
            # the receiver's slice index for it: (src, j % per); sizes must agree
            assert recv_sizes[dst][src * per + j % per] == send_sizes[src][j]
            outs[dst][output_offsets[src][j]:output_offsets[src][j] + len(rows)] = rows
    return outs


def _run_padded(mesh, operand, args, out_rows, peer_rows):
    P = jax.sharding.PartitionSpec
    f = lambda o, *a: moe.ragged_all_to_all_padded(o, out_rows, *a, "expert", peer_rows)  # noqa: E731
    with jax.set_mesh(mesh):
        g = jax.jit(lambda o, *a: jax.shard_map(f, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert"))(o, *a))
        return np.asarray(g(operand, *[jnp.asarray(np.concatenate(a)) for a in args]))


def test_padded_exchange_matches_documented_example():
    """The two-device example of the jax.lax.ragged_all_to_all docstring."""
    mesh = sharding.make_mesh({"expert": 2}, devices=jax.devices()[:2])
    operand = jnp.array([1, 2, 2, 3, 4, 0], jnp.float32)
    args = ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    got = _run_padded(mesh, operand, [np.array(a, np.int32) for a in args], out_rows=4, peer_rows=3)
    np.testing.assert_array_equal(got, [1, 3, 0, 0, 2, 2, 4, 0])


def test_padded_exchange_matches_pseudocode_with_several_slices_per_peer():
    """4 devices, 2 slices to each peer (as when each device holds 2 experts), random sizes."""
    n, per, rows, out_rows = 4, 2, 6, 12
    rng = np.random.default_rng(0)
    send = [rng.multinomial(rng.integers(0, rows + 1), np.ones(n * per) / (n * per)).astype(np.int32) for _ in range(n)]
    in_off = [np.cumsum(s) - s for s in send]
    recv = [np.concatenate([send[src][dst * per:(dst + 1) * per] for src in range(n)]) for dst in range(n)]
    # receiver layout: source-major, so each receiver's slices are packed in order
    out_off = [np.zeros(n * per, np.int32) for _ in range(n)]
    for dst in range(n):
        start = np.cumsum(recv[dst]) - recv[dst]
        for src in range(n):
            out_off[src][dst * per:(dst + 1) * per] = start[src * per:(src + 1) * per]
    operands = [rng.normal(size=(rows, 3)).astype(np.float32) for _ in range(n)]
    want = _ragged_all_to_all_numpy(operands, in_off, send, out_off, recv, out_rows)
    mesh = sharding.make_mesh({"expert": n}, devices=jax.devices()[:n])
    got = _run_padded(mesh, jnp.asarray(np.concatenate(operands)), [in_off, send, out_off, recv], out_rows, rows)
    np.testing.assert_array_equal(got, np.concatenate(want))


EP_CFG = dataclasses.replace(CFG, num_experts=8, shared_expert=False)
EP_K = {"spread": 2, "one_expert": 1}  # experts per token of each case
EP_MESHES = [{"expert": 2, "fsdp": 2, "tensor": 2}, {"expert": 4, "tensor": 2}, {"expert": 8}]


@pytest.fixture(scope="module")
def ep_cases():
    """Two routings over 16 tokens and 8 experts: spread (top-2, sharp router) and all tokens to
    expert 5 (top-1: one device receives every token of its expert group)."""
    x = jax.random.normal(jax.random.key(3), (4, 4, EP_CFG.d_model))
    with jax.set_mesh(_one_device_mesh()):
        p = nn.unbox(jax.jit(moe.MoeMlp(EP_CFG).init)(jax.random.key(4), x))["params"]
    spread = dict(p, router=p["router"] * 5.0)
    one = dict(p, router=(p["router"] * 0.1).at[0, 5].set(1.0))
    x_one = x.at[..., 0].set(4.0)  # logit of expert 5 ~ 4, the others ~ 0.1
    return jax.device_get({"spread": (spread, x), "one_expert": (one, x_one)})


def _values_and_grads(cases, impl, token_chunk=0):
    outs = {}
    for name, (p, x) in cases.items():
        cfg = dataclasses.replace(EP_CFG, num_experts_per_tok=EP_K[name], moe_impl=impl, moe_token_chunk=token_chunk)

        def f(p, x):
            return moe.MoeMlp(cfg).apply({"params": p}, x, mutable="intermediates")

        loss = lambda p, x: jnp.sum(jnp.sin(f(p, x)[0]))  # noqa: E731
        (y, inter) = f(p, x)
        outs[name] = (y, inter["intermediates"], jax.grad(loss, argnums=(0, 1))(p, x))
    return outs


@pytest.fixture(scope="module")
def ep_dense(ep_cases):
    with jax.set_mesh(_one_device_mesh()):
        return jax.jit(lambda c: _values_and_grads(c, "dense"))(ep_cases)


# 16 tokens over 8 devices: 2 per device; with expert=2 x fsdp=2 x tensor=2, 4 per device: 2 chunks
# of 2, or 2 of 3 with 2 padding tokens
@pytest.mark.parametrize("shape,token_chunk", [(s, 0) for s in EP_MESHES] + [(EP_MESHES[0], 2), (EP_MESHES[0], 3)],
                         ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()) if isinstance(s, dict) else f"chunk{s}")
def test_expert_parallel_equals_dense_values_and_grads(shape, token_chunk, ep_cases, ep_dense):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = sharding.make_mesh(shape)
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda c: _values_and_grads(c, "expert_parallel", token_chunk))
        text = fn.lower(ep_cases).as_text()
        assert "all_to_all" in text and "ragged" not in text  # the padded stand-in on CPU
        if token_chunk:
            assert "while" in text  # the chunks are exchanged one after another
        got = fn(ep_cases)
    one_load = np.asarray(got["one_expert"][1]["expert_load"][0])
    np.testing.assert_array_equal(one_load, np.eye(8)[5])  # every token went to expert 5
    for name in ep_cases:
        (y, inter, grads), (y_d, inter_d, grads_d) = got[name], ep_dense[name]
        np.testing.assert_allclose(y, y_d, atol=1e-5, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_d)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        # the router metrics are over the global batch, whatever the mesh
        np.testing.assert_allclose(inter["router_aux_loss"][0], inter_d["router_aux_loss"][0], rtol=1e-6)
        np.testing.assert_allclose(inter["expert_load"][0], inter_d["expert_load"][0], rtol=1e-6)


def test_expert_parallel_without_expert_axis_is_the_ragged_path(ep_cases):
    p, x = ep_cases["spread"]
    cfg = dataclasses.replace(EP_CFG, num_experts_per_tok=EP_K["spread"])
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        ys = [jax.jit(moe.MoeMlp(dataclasses.replace(cfg, moe_impl=i)).apply)({"params": p}, x)
              for i in ("expert_parallel", "ragged")]
        assert "all_to_all" not in str(jax.make_jaxpr(moe.MoeMlp(dataclasses.replace(cfg, moe_impl="expert_parallel")).apply)(
            {"params": p}, x))
    np.testing.assert_array_equal(ys[0], ys[1])


# ---- the TPU/GPU exchange path --------------------------------------------------------------------
# XLA:CPU has no ragged-all-to-all (jax 0.10.2: "HLO opcode `ragged-all-to-all` is not supported by
# XLA:CPU"), so its offsets are checked against the numpy model above, and the path that calls it runs
# with `emulated_ragged_all_to_all`, an independent jnp rendering of the documented pseudocode.


@pytest.mark.parametrize("n,L", [(2, 1), (4, 2), (8, 1)])
def test_exchange_offsets_route_rows_to_their_experts_and_back(n, L):
    """Every device's offsets (moe.exchange_offsets) through the collective's documented semantics:
    out, device d holds its experts' rows grouped by local expert, sources in order within one, then
    padding; back, every source gets its own buffer again."""
    E, N = n * L, 6
    rng = np.random.default_rng(n)
    counts = [rng.multinomial(N, rng.dirichlet(np.ones(E) * 0.3)) for _ in range(n)]
    counts[0] = np.eye(E, dtype=np.int64)[E - 1] * N  # one source sends everything to the last expert
    count_nE = np.stack(counts).astype(np.int32)
    # source i's buffer, sorted by expert: rows labelled (source, expert, rank within the expert)
    bufs = [np.array([(i, e, r) for e in range(E) for r in range(count_nE[i, e])], np.float32) for i in range(n)]
    plans = [jax.tree.map(np.asarray, moe.exchange_offsets(jnp.asarray(count_nE), d, L)) for d in range(n)]
    recv = _ragged_all_to_all_numpy(bufs, *zip(*[p[0] for p in plans]), out_rows=n * N)
    for d in range(n):
        want = [(i, e, r) for e in range(d * L, (d + 1) * L) for i in range(n) for r in range(count_nE[i, e])]
        want = np.array(want, np.float32).reshape(-1, 3)
        np.testing.assert_array_equal(recv[d][:len(want)], want)
        np.testing.assert_array_equal(recv[d][len(want):], 0)
    back = _ragged_all_to_all_numpy(recv, *zip(*[p[1] for p in plans]), out_rows=N)
    for i in range(n):
        np.testing.assert_array_equal(back[i], bufs[i])


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all's documented semantics from all_gathers (inside shard_map): slice j of
    source i (operand[input_offsets[j]:][:send_sizes[j]]) goes to device j // per, where it is written
    at the source's output_offsets[j]; the receiver reads the slice's length from its recv_sizes."""
    n, R = jax.lax.axis_size(axis_name), operand.shape[0]
    per = send_sizes.shape[0] // n
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)
    mine = lambda a: jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(a, axis_name), me * per, per, 1)  # noqa: E731
    src_start, dst_start = mine(input_offsets), mine(output_offsets)  # [n sources, per]
    rows = jnp.arange(R)
    valid = rows < recv_sizes.reshape(n, per)[..., None]
    src = jnp.clip(src_start[..., None] + rows, 0, R - 1)
    dst = jnp.where(valid, dst_start[..., None] + rows, output.shape[0])  # invalid rows: dropped
    vals = ops[jnp.arange(n)[:, None, None], src]
    return output.at[dst.reshape(-1)].set(vals.reshape((-1,) + operand.shape[1:]), mode="drop")


def test_ragged_exchange_path_equals_dense_on_cpu(ep_cases):
    """The TPU/GPU branch of moe.exchange (moe.ragged_exchange, with the collective emulated) through
    the whole expert-parallel layer == the dense oracle, both routings, expert=4 x tensor=2."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    ex = functools.partial(moe.ragged_exchange, collective=emulated_ragged_all_to_all)
    mesh = sharding.make_mesh({"expert": 4, "tensor": 2})

    def both(cases):
        out = {}
        for name, (p, x) in cases.items():
            x_SD = x.reshape(-1, x.shape[-1])
            _, idx, gate = moe.route(x_SD, p["router"], EP_K[name])
            w = (p["wi_gate"], p["wi_up"], p["wo"])
            out[name] = (moe.experts_expert_parallel(x_SD, idx, gate, *w, jnp.float32, exchange_fn=ex),
                         moe.experts_dense(x_SD, idx, gate, *w, jnp.float32))
        return out

    with jax.set_mesh(mesh):
        fn = jax.jit(both)
        assert "all_to_all" not in fn.lower(ep_cases).as_text()  # the emulation, not the padded stand-in
        got = fn(ep_cases)
    for name, (y, want) in got.items():
        np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_indivisible_shapes_error_or_warn(ep_cases, caplog):
    """15 tokens on 8 devices: "error" names the shapes and the config fields; "warn" logs the bytes and
    computes the same values by the gather."""
    p, x = ep_cases["spread"]
    x = x.reshape(16, -1)[:15].reshape(3, 5, -1)
    mesh = sharding.make_mesh({"expert": 8}) if len(jax.devices()) >= 8 else pytest.skip("needs 8 devices")
    cfg = dataclasses.replace(EP_CFG, num_experts_per_tok=EP_K["spread"], moe_impl="expert_parallel")
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"15 tokens.*8 experts.*model.num_experts.*mesh.expert.*"
                                             r"model.moe_indivisible='warn'"):
            jax.jit(moe.MoeMlp(dataclasses.replace(cfg, moe_indivisible="error")).apply)({"params": p}, x)
        with caplog.at_level("WARNING", logger="rl_scaling.policy.moe"):
            y = jax.jit(moe.MoeMlp(dataclasses.replace(cfg, moe_indivisible="warn")).apply)({"params": p}, x)
    assert re.search(r"expert parallelism .*15 tokens.* GiB per layer and pass", caplog.text)
    want = jax.jit(moe.MoeMlp(dataclasses.replace(cfg, moe_impl="dense")).apply)({"params": p}, x)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="moe_indivisible"):
        dataclasses.replace(cfg, moe_indivisible="ignore")
