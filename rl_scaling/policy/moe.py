"""Mixture-of-experts MLP as in Llama 4 (Scout): a top-k router, routed SwiGLU experts and a
shared SwiGLU expert that sees every token.

Routing (transformers `Llama4TextMoe` / `Llama4Router`):
  logits_SE = x_SD @ router_DE; the top-k logits of a token go through a sigmoid, and that
  gate scales the expert's *input*: y = shared(x) + sum_{e in topk} expert_e(sigmoid(l_e) * x).
  (There is no softmax and no renormalisation of the gates.)

Parameters (per layer; `Block` is scanned, so each gets a leading [L] axis):
  router [D, E]                       logical ("embed", None)
  wi_gate, wi_up [E, D, F]            logical ("expert", "expert_embed", "expert_mlp")
  wo [E, F, D]                        logical ("expert", "expert_mlp", "expert_embed")
  shared/{gate,up,down}               the dense `SwiGLU` of mlp.py with hidden cfg.mlp_dim

Dispatch: `cfg.moe_impl`
  "ragged" (default) sort-based, dropless: the S*k (token, expert) pairs of a shard are sorted by
      expert, gathered into one [S*k, D] slab, and the three expert matmuls run as grouped
      matmuls (`jax.lax.ragged_dot`, which XLA lowers to a grouped GEMM on TPU); the outputs are
      un-sorted with the inverse permutation and summed over the k choices. (XLA lowers
      ragged_dot natively on TPU and GPU (chlo.ragged_dot); the Pallas megablox `gmm` kernel is
      a drop-in alternative on TPU. On CPU jax expands it into a masked dense dot, E times the
      FLOPs: fine for tests, which is all CPU runs are for.)
  "expert_parallel" the same dropless grouped matmuls, but the experts stay where they rest
      (mesh axis `expert`) and the tokens travel to them; see Sharding. Without a mesh or with an
      `expert` axis of 1 it is "ragged".
  "dense" the oracle: every expert runs on every token, weighted by its gate (0 if not chosen).

Why sort + ragged_dot and not GShard capacity dispatch (per token, D model, F expert hidden,
E experts, k chosen, capacity C = cf*S*k/E per group of S tokens):
  - FLOPs. ragged: 6*D*F*k (exactly the active experts) plus an O(S*k log(S*k)) int sort.
    capacity einsums: 6*D*F*k*cf for the experts (padding slots are computed too) plus the
    dispatch and combine einsums, 2 * 2*E*C*D = 4*cf*S*k*D per token: for Scout (D 5120,
    F 8192, k 1) with groups of S = 4096 tokens and cf 1.25 that is +42% over the expert FLOPs
    (smaller groups cost less but drop more tokens).
    dense oracle: 6*D*F*E (16x the routed FLOPs for Scout).
  - Memory. ragged: the [S*k, D] sorted slab and the [S*k, F] hidden. capacity: a one-hot
    dispatch tensor [S, E, C] per group (S^2*k*cf values) and an [E, C, D] slab.
  - Semantics, which decide it for RL: capacity dispatch drops tokens when an expert overflows,
    so a token's logits depend on which other tokens share its group. Then the trainer's
    recomputed log-probs differ from the generator's (the importance ratio the losses use is
    biased by routing noise, not by the policy change), and KV-cache decoding (a group of one
    token) disagrees with the full-sequence recompute. Dropless dispatch makes every token's
    output independent of the rest of the batch: the same numbers in prefill, decode and
    training, and exact parity with the transformers reference.

Sharding. With a mesh in context (`jax.set_mesh`, or sharding.tracing_mesh inside the project's jitted
steps; jax's deprecated `with mesh:` is not read) the grouped matmuls run
inside `shard_map`: each data shard sorts only its own tokens (a global sort would gather every
token to every device), the expert weights enter cast to the body dtype and sharded along
`expert_mlp` (the `tensor` mesh axis), and the partial outputs of the down projection are
summed with one psum over it.
  "ragged" (gather variant): the expert weights rest sharded over `expert` and `fsdp` and are
      all-gathered per layer at the shard_map boundary, as FSDP does for dense weights (Scout:
      3*D*F*E = 2.0B parameters, 4 GB in bf16, per layer, pass and microbatch). A generator mesh
      should put its devices on `tensor` (and `data`), where no weight moves.
  "expert_parallel": tokens are split over (data, fsdp, expert), experts over `expert` (n
      devices, L = E/n each; only a device's own experts are gathered over `fsdp`). Each device
      sorts its S*k (token, expert) pairs by expert, all-gathers the [n, E] pair counts (every
      device then derives every offset, no second handshake) and sends each expert's rows to its
      device with `jax.lax.ragged_all_to_all`, which writes them grouped by local expert (sources
      in order within an expert), ready for ragged_dot; the outputs return by the mirror-image
      exchange and are un-sorted and summed over k in float32 (they travel in the body dtype).
      Dropless means static buffers sized for the worst case: a device may receive every pair
      of its n-device group, so its receive slab is [n*S*k, D] (rows past the received count are
      padding outside every group, never sent back; whether the grouped matmul also skips their
      FLOPs is up to the backend: megablox `gmm` does). Bytes per device, per
      layer and pass: out and back 2*S*k*D values, (n-1)/n of them off-chip under balanced
      routing, against 3*D*F*E weights for the gather variant (Scout, S = 16k tokens a chip and
      microbatch, n = 16: 0.3 GB against 4 GB; rl_scaling/dry_run.py prints both per step).
      XLA:CPU has no ragged-all-to-all, so `exchange` picks at lowering time
      (`jax.lax.platform_dependent`): the collective on TPU and GPU, and on CPU
      `ragged_all_to_all_padded`, the same semantics from one all_to_all of [n, S*k, D] per-peer
      buffers padded to the worst case (n times the ragged bytes; CPU runs are tests).

Sown into the "intermediates" collection (stacked over layers by the scan), computed from the
router logits outside the shard_map, so over the global batch whatever the dispatch and mesh:
  router_aux_loss  Switch load-balancing loss E * sum_e f_e * P_e (f_e: share of the S*k
                   choices that went to expert e, P_e: mean softmax router probability);
                   the train step adds cfg.router_aux_loss_coef times its layer mean.
  expert_load      f_e, [E]; dropless dispatch drops nothing, so there is no dropped fraction.
  expert_idx       [S, k] int32, the router's own top-k (also under replay): the routing a
                   generator records and the trainer replays (`routing_of`, rl.routing_replay).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from rl_scaling import sharding
from rl_scaling.policy.mlp import DTYPES, SwiGLU
from rl_scaling.policy.model_config import MOE_IMPLS as IMPLS, MOE_INDIVISIBLE as INDIVISIBLE, ModelConfig

log = logging.getLogger(__name__)


def indivisible(on, what, S, E, F, D, mesh, dtype):
    """Shapes the mesh does not divide: the routed experts' weights are then gathered whole per
    layer instead of staying sharded. `on` = cfg.moe_indivisible: "error" raises, naming the shapes
    and the config fields that set them; "warn" logs the bytes it costs and carries on."""
    gathered = 3 * D * F * E * jnp.dtype(dtype).itemsize
    msg = (f"MoE {what}: {S} tokens (batch x length of this step), {E} experts, expert hidden {F} on mesh "
           f"{dict(mesh.shape)} do not divide, so every device gathers all routed expert weights: "
           f"{gathered / 2**30:.2f} GiB per layer and pass. Make the tokens per step divisible by the batch "
           "axes (data x fsdp x expert: rollout.engine_slots, rollout.prompts_per_step x samples_per_prompt, "
           "rl.grad_accum), model.num_experts by mesh.expert and model.moe_mlp_dim by mesh.tensor "
           "(tpu.gen_mesh for the generators), or set model.moe_indivisible='warn' to accept it")
    if on == "error":
        raise ValueError(msg)
    if on != "warn":
        raise ValueError(f"model.moe_indivisible must be one of {INDIVISIBLE}, got {on!r}")
    log.warning(msg)


def _expert_init():
    # fan_in over D (or F) only: the expert axis is a batch of independent matrices.
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))


def route(x_SD, router_DE, k, replay_SK=None):
    """Top-k routing in float32: (logits [S, E], chosen experts [S, k], sigmoid gates [S, k]).
    replay_SK (routing replay): these experts are taken instead of the top-k, their gates still
    the sigmoid of the live logits, so the router keeps its gradient (as Megatron/verl replay)."""
    logits_SE = jnp.dot(x_SD.astype(jnp.float32), router_DE.astype(jnp.float32))
    if replay_SK is not None:
        idx_SK = replay_SK.astype(jnp.int32)
        return logits_SE, idx_SK, jax.nn.sigmoid(jnp.take_along_axis(logits_SE, idx_SK, axis=1))
    top_SK, idx_SK = jax.lax.top_k(logits_SE, k)
    return logits_SE, idx_SK, jax.nn.sigmoid(top_SK)


def experts_dense(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD, dtype):
    """Oracle: every expert on every token, input scaled by its gate (0 when not chosen)."""
    E = wg_EDF.shape[0]
    scores_SE = jnp.sum(jax.nn.one_hot(idx_SK, E, dtype=jnp.float32) * gate_SK[..., None], axis=1)
    xs_ESD = (scores_SE.T[:, :, None] * x_SD.astype(jnp.float32)[None]).astype(dtype)
    g = jnp.einsum("esd,edf->esf", xs_ESD, wg_EDF.astype(dtype))
    u = jnp.einsum("esd,edf->esf", xs_ESD, wu_EDF.astype(dtype))
    o_ESD = jnp.einsum("esf,efd->esd", nn.silu(g) * u, wo_EFD.astype(dtype), preferred_element_type=jnp.float32)
    return o_ESD.sum(0)


def experts_ragged(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD, dtype):
    """Dropless sort + grouped matmul over the tokens given (one shard's worth)."""
    S, K = idx_SK.shape
    E = wg_EDF.shape[0]
    flat_e = idx_SK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # (token, choice) pairs grouped by expert
    token = order // K
    xs = (x_SD[token].astype(jnp.float32) * gate_SK.reshape(-1)[order][:, None]).astype(dtype)
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    g = jax.lax.ragged_dot(xs, wg_EDF.astype(dtype), group_sizes)
    u = jax.lax.ragged_dot(xs, wu_EDF.astype(dtype), group_sizes)
    o = jax.lax.ragged_dot(nn.silu(g) * u, wo_EFD.astype(dtype), group_sizes, preferred_element_type=jnp.float32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return o[inverse].reshape(S, K, -1).sum(1)


def _context_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def _mesh_axes(logical, mesh):
    """Mesh axes (of size > 1) that a logical axis maps to."""
    spec = nn.logical_to_mesh_axes((logical,), sharding.LOGICAL_RULES)[0]
    axes = spec if isinstance(spec, tuple) else ((spec,) if spec else ())
    return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def experts_sharded(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD, dtype, on_indivisible="warn"):
    """`experts_ragged` per data shard inside shard_map, summed over the expert_mlp shards."""
    mesh = _context_mesh()
    fn = lambda *a: experts_ragged(*a, dtype)  # noqa: E731
    if mesh is None:
        return fn(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD)
    batch_axes, tensor_axes = _mesh_axes("batch", mesh), _mesh_axes("expert_mlp", mesh)
    n_batch = 1
    for a in batch_axes:
        n_batch *= mesh.shape[a]
    n_tensor = 1
    for a in tensor_axes:
        n_tensor *= mesh.shape[a]
    if not batch_axes and not tensor_axes:
        return fn(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD)  # nothing to split
    if x_SD.shape[0] % n_batch or wg_EDF.shape[-1] % n_tensor:
        (E, D, F), S = wg_EDF.shape, x_SD.shape[0]
        indivisible(on_indivisible, "dispatch (model.moe_impl='ragged')", S, E, F, D, mesh, dtype)
        return fn(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD)  # leave it to the partitioner
    P = jax.sharding.PartitionSpec
    tok = P(batch_axes or None, None)
    t = tensor_axes or None

    def local(x, idx, gate, wg, wu, wo):
        y = fn(x, idx, gate, wg, wu, wo)
        return jax.lax.psum(y, tensor_axes) if tensor_axes else y

    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(tok, tok, tok, P(None, None, t), P(None, None, t), P(None, t, None)),
        out_specs=tok,
    )(x_SD, idx_SK, gate_SK, *(w.astype(dtype) for w in (wg_EDF, wu_EDF, wo_EFD)))  # gathered in the body dtype


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def ragged_all_to_all_padded(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
                             peer_rows):
    """`jax.lax.ragged_all_to_all` into a zero buffer of `out_rows` rows, built from a plain
    all_to_all (which every backend lowers; XLA:CPU has no ragged-all-to-all).

    Same arguments and result as the ragged collective (K = len(send_sizes) slices, K/n to each
    of the n devices on the axis). Each device packs its slices for destination d one after
    another into a [n, peer_rows, ...] buffer, so `peer_rows` must bound the rows sent to any one
    peer; the buffer crosses the axis whole, padding included: n * peer_rows rows per device."""
    n = jax.lax.axis_size(axis_name)
    per = send_sizes.shape[0] // n
    rows = jnp.arange(peer_rows)

    def slots(sizes_nP):
        """For each buffer row of each peer: (slice within the peer's chunk, row within the slice, valid)."""
        start_nP = _exclusive_cumsum(sizes_nP, axis=1)
        s_nC = jnp.sum(rows[None, None, :] >= (start_nP + sizes_nP)[:, :, None], axis=1)
        s_nC = jnp.minimum(s_nC, per - 1)
        within = rows[None, :] - jnp.take_along_axis(start_nP, s_nC, axis=1)
        valid = within < jnp.take_along_axis(sizes_nP, s_nC, axis=1)
        return s_nC, within, valid

    s, within, valid = slots(send_sizes.reshape(n, per))
    src = jnp.take_along_axis(input_offsets.reshape(n, per), s, axis=1) + within
    trailing = (1,) * (operand.ndim - 1)
    buf = jnp.where(valid.reshape(valid.shape + trailing), operand[jnp.where(valid, src, 0)], 0)  # [n, peer_rows, ...]
    got = jax.lax.all_to_all(buf, axis_name, 0, 0)  # got[i]: what device i packed for this one
    s, within, valid = slots(recv_sizes.reshape(n, per))
    dst_offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True).reshape(n, per)
    dst = jnp.where(valid, jnp.take_along_axis(dst_offsets, s, axis=1) + within, out_rows)  # out_rows: dropped
    out = jnp.zeros((out_rows,) + operand.shape[1:], operand.dtype)
    return out.at[dst.reshape(-1)].add(got.reshape((-1,) + operand.shape[1:]), mode="drop")


def ragged_exchange(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
                    peer_rows=None, collective=None):
    """The TPU/GPU exchange: `jax.lax.ragged_all_to_all` into a zero buffer of `out_rows` rows.
    `collective` replaces the collective (same signature): XLA:CPU cannot run it (jax 0.10.2:
    "ragged-all-to-all is not supported by XLA:CPU"), so tests pass an emulation of its documented
    semantics and run this path, argument plumbing included, on fake CPU devices."""
    del peer_rows  # the ragged collective needs no per-peer bound
    out = jnp.zeros_like(operand, shape=(out_rows,) + operand.shape[1:])  # varying like the operand
    collective = collective or jax.lax.ragged_all_to_all
    return collective(operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def exchange(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, peer_rows):
    """ragged_all_to_all where the backend has it (TPU, GPU), its padded stand-in on CPU; the
    choice is made when the program is lowered for its platform."""
    args = (operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    ragged = lambda o, *a: ragged_exchange(o, out_rows, *a, axis_name)  # noqa: E731
    padded = lambda o, *a: ragged_all_to_all_padded(o, out_rows, *a, axis_name, peer_rows)  # noqa: E731
    return jax.lax.platform_dependent(*args, cpu=padded, default=ragged)


def exchange_offsets(count_nE, me, L):
    """The ragged_all_to_all arguments (input_offsets, send_sizes, output_offsets, recv_sizes) of
    device `me`'s two exchanges, from every device's per-expert pair counts count_nE [n, E]
    (E = n*L, device d holding experts d*L .. d*L+L-1; each device's pairs sorted by expert).

    Out: slice e goes to device e // L; there its rows sit grouped by local expert, sources in
    order within one (expert e's block starts after the same device's earlier experts).
    Back: slice i*L + l (source i's rows of local expert l) returns to its place in i's buffer.
    A pure function, so the offsets the TPU/GPU collective reads are tested on CPU
    (tests/test_moe.py, against a numpy model of the collective's documented semantics)."""
    n, E = count_nE.shape
    total_E = count_nE.sum(0)
    block_nL = _exclusive_cumsum(total_E).reshape(n, L)
    block_E = (block_nL - block_nL[:, :1]).reshape(E)
    dst_off_nE = block_E[None] + _exclusive_cumsum(count_nE, axis=0)  # source i's rows of e, there
    src_off_nE = _exclusive_cumsum(count_nE, axis=1)  # the same rows in source i's sorted buffer
    mine = lambda a_nE: jax.lax.dynamic_slice_in_dim(a_nE, me * L, L, axis=1).reshape(-1)  # noqa: E731
    fwd = (src_off_nE[me], count_nE[me], dst_off_nE[me], mine(count_nE))
    back = (mine(dst_off_nE), mine(count_nE), mine(src_off_nE), count_nE[me])
    return fwd, back


def experts_expert_parallel_local(x_SD, idx_SK, gate_SK, wg_LDF, wu_LDF, wo_LFD, *, dtype, axis_name, exchange_fn):
    """One device's share of expert parallelism (inside shard_map over `axis_name`, n devices,
    each holding L = E / n consecutive experts): its S tokens' S*K (token, expert) pairs go to
    the devices that hold their experts and come back with the outputs. Returns [S, D] float32,
    a partial sum when the expert hidden dimension is split (the caller psums it)."""
    S, K = idx_SK.shape
    L = wg_LDF.shape[0]
    n = jax.lax.axis_size(axis_name)
    E, N = n * L, S * K
    me = jax.lax.axis_index(axis_name)
    flat_e = idx_SK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # pairs grouped by expert, hence by destination
    xs_ND = (x_SD[order // K].astype(jnp.float32) * gate_SK.reshape(-1)[order][:, None]).astype(dtype)

    # Everyone's counts (n*E ints): every device derives every offset, no second handshake.
    count_nE = jax.lax.all_gather(jnp.bincount(flat_e, length=E).astype(jnp.int32), axis_name)
    total_E = count_nE.sum(0)
    fwd, back = exchange_offsets(count_nE, me, L)
    recv_MD = exchange_fn(xs_ND, n * N, *fwd, axis_name, N)

    group_sizes = jax.lax.dynamic_slice_in_dim(total_E, me * L, L)  # rows past their sum are padding
    g = jax.lax.ragged_dot(recv_MD, wg_LDF.astype(dtype), group_sizes)
    u = jax.lax.ragged_dot(recv_MD, wu_LDF.astype(dtype), group_sizes)
    # Down projection straight to the body dtype: what travels back (half the bytes of float32 in
    # bfloat16, and no [n*N, D] float32 slab); the k choices and tensor shards then add in float32.
    o_MD = jax.lax.ragged_dot(nn.silu(g) * u, wo_LFD.astype(dtype), group_sizes, preferred_element_type=dtype)

    back_ND = exchange_fn(o_MD, N, *back, axis_name, N)  # each slice returns to where it came from
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(N, dtype=order.dtype))
    return back_ND[inverse].astype(jnp.float32).reshape(S, K, -1).sum(1)


def experts_expert_parallel(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD, dtype, exchange_fn=exchange,
                            token_chunk=0, on_indivisible="warn"):
    """Expert parallelism inside shard_map: tokens split over the batch axes (which include
    `expert`), experts over `expert`, the expert hidden over `expert_mlp` (psum at the end).
    Without a mesh or with an `expert` axis of 1 it is `experts_sharded`; with shapes the mesh does
    not divide too, after `indivisible` (an error or a warning, `on_indivisible`).

    `token_chunk` > 0 exchanges a device's tokens in chunks of that many, one after another
    (`lax.map`, each chunk rematerialised): the same bytes travel, but the worst-case receive
    slab and the grouped matmuls' [n*chunk*k, F] activations shrink by S / token_chunk (Scout:
    n = 16, S = 16k, F = 8k: 13 GB of bf16 activations per layer at once without chunks)."""
    mesh = _context_mesh()
    ep_axes = _mesh_axes("expert", mesh) if mesh is not None else ()
    if not ep_axes:
        return experts_sharded(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD, dtype, on_indivisible)
    if len(ep_axes) != 1:
        raise ValueError(f"expert parallelism needs the logical axis 'expert' on one mesh axis, got {ep_axes}")
    (ep,) = ep_axes
    batch_axes, tensor_axes = _mesh_axes("batch", mesh), _mesh_axes("expert_mlp", mesh)
    n_batch = math.prod(mesh.shape[a] for a in batch_axes)
    n_tensor = math.prod(mesh.shape[a] for a in tensor_axes)
    if (ep not in batch_axes or x_SD.shape[0] % n_batch or wg_EDF.shape[0] % mesh.shape[ep]
            or wg_EDF.shape[-1] % n_tensor):
        (E, D, F), S = wg_EDF.shape, x_SD.shape[0]
        indivisible(on_indivisible, "expert parallelism (model.moe_impl='expert_parallel')", S, E, F, D, mesh,
                    dtype)
        return experts_sharded(x_SD, idx_SK, gate_SK, wg_EDF, wu_EDF, wo_EFD, dtype, "warn")  # said once
    P = jax.sharding.PartitionSpec
    tok, t = P(batch_axes, None), tensor_axes or None

    def one_chunk(x, idx, gate, wg, wu, wo):
        return experts_expert_parallel_local(x, idx, gate, wg, wu, wo, dtype=dtype, axis_name=ep,
                                             exchange_fn=exchange_fn)

    def local(x, idx, gate, wg, wu, wo):
        S = x.shape[0]
        if 0 < token_chunk < S:
            c = -(-S // token_chunk)  # padding tokens have gate 0: zero input, zero output, sliced off

            def chunks(a):
                a = jnp.pad(a, [(0, c * token_chunk - S)] + [(0, 0)] * (a.ndim - 1))
                return a.reshape((c, token_chunk) + a.shape[1:])

            body = jax.checkpoint(lambda xs: one_chunk(*xs, wg, wu, wo))
            y = jax.lax.map(body, (chunks(x), chunks(idx), chunks(gate))).reshape(c * token_chunk, -1)[:S]
        else:
            y = one_chunk(x, idx, gate, wg, wu, wo)
        return jax.lax.psum(y, tensor_axes) if tensor_axes else y

    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(tok, tok, tok, P(ep, None, t), P(ep, None, t), P(ep, t, None)),
        out_specs=tok,
    )(x_SD, idx_SK, gate_SK, *(w.astype(dtype) for w in (wg_EDF, wu_EDF, wo_EFD)))  # gathered in the body dtype


class MoeMlp(nn.Module):
    """Llama-4 MoE feed-forward: y_BTD = shared(h) + sum over the top-k experts."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, replay_BTK=None):
        """replay_BTK: expert indices to use instead of the router's top-k (routing replay)."""
        cfg = self.cfg
        if cfg.moe_impl not in IMPLS:
            raise ValueError(f"model.moe_impl must be one of {IMPLS}, got {cfg.moe_impl!r}")
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts or cfg.moe_mlp_dim <= 0:
            raise ValueError(
                f"MoE needs 1 <= num_experts_per_tok ({cfg.num_experts_per_tok}) <= num_experts "
                f"({cfg.num_experts}) and moe_mlp_dim > 0 (got {cfg.moe_mlp_dim})"
            )
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        E, K, F, D = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim, cfg.d_model
        router = self.param(
            "router", nn.with_logical_partitioning(nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                                                   ("embed", None)), (D, E), pdtype)
        w_in = nn.with_logical_partitioning(_expert_init(), ("expert", "expert_embed", "expert_mlp"))
        wg = self.param("wi_gate", w_in, (E, D, F), pdtype)
        wu = self.param("wi_up", w_in, (E, D, F), pdtype)
        wo = self.param("wo", nn.with_logical_partitioning(_expert_init(), ("expert", "expert_mlp", "expert_embed")),
                        (E, F, D), pdtype)

        B, T, _ = x_BTD.shape
        x_SD = x_BTD.reshape(B * T, D)
        replay_SK = None if replay_BTK is None else replay_BTK.reshape(B * T, K)
        logits_SE, idx_SK, gate_SK = route(x_SD, router, K, replay_SK)
        # The router's own choice, whatever was replayed: what a generator records, and what the
        # trainer compares with the replayed routing (router/replay_disagreement).
        self.sow("intermediates", "expert_idx", idx_SK if replay_SK is None else jax.lax.top_k(logits_SE, K)[1])
        impl = {"ragged": functools.partial(experts_sharded, on_indivisible=cfg.moe_indivisible),
                "dense": experts_dense,
                "expert_parallel": functools.partial(experts_expert_parallel, token_chunk=cfg.moe_token_chunk,
                                                     on_indivisible=cfg.moe_indivisible)}
        y_SD = impl[cfg.moe_impl](x_SD, idx_SK, gate_SK, wg, wu, wo, dtype)

        # Switch-style load balancing (f_e * P_e) and the per-expert load.
        load_E = jnp.mean(jnp.sum(jax.nn.one_hot(idx_SK, E, dtype=jnp.float32), axis=1), axis=0) / K
        prob_E = jnp.mean(jax.nn.softmax(logits_SE, axis=-1), axis=0)
        self.sow("intermediates", "router_aux_loss", E * jnp.sum(load_E * prob_E))
        self.sow("intermediates", "expert_load", load_E)

        y_BTD = y_SD.reshape(B, T, D)
        if cfg.shared_expert:
            y_BTD = y_BTD + SwiGLU(cfg, cfg.mlp_dim, name="shared")(x_BTD).astype(jnp.float32)
        return y_BTD.astype(dtype)


def router_metrics(intermediates):
    """Layer-mean aux loss and the [L, E] expert loads from `apply(..., mutable="intermediates")`.
    Returns {} for a dense model."""
    inter = intermediates.get("intermediates", intermediates)
    moe = inter.get("layers", {}).get("moe") if hasattr(inter, "get") else None
    if not moe:
        return {}
    return {"router_aux_loss": jnp.mean(moe["router_aux_loss"][0]), "expert_load": moe["expert_load"][0]}


def routing_of(intermediates, B, T):
    """The routers' own choices of one forward pass, [B, T, n_layers, k] int32, from its sown
    intermediates (scanned layers, or the unrolled decoding path's stack); None for a dense model."""
    inter = intermediates.get("intermediates", intermediates)
    if "expert_idx" in inter:  # unrolled (Decoder stacks the layers' choices itself)
        idx_LSK = inter["expert_idx"][0]
    else:
        moe = inter.get("layers", {}).get("moe")
        if not moe:
            return None
        idx_LSK = moe["expert_idx"][0]
    L, _, K = idx_LSK.shape
    return jnp.moveaxis(idx_LSK.reshape(L, B, T, K), 0, 2)


def replay_disagreement(own_BTLK, replayed_BTLK, mask_BT):
    """Share of (real token, layer) pairs where the router's own top-k set differs from the
    replayed one (order within the k does not count)."""
    differ = jnp.any(jnp.sort(own_BTLK, -1) != jnp.sort(replayed_BTLK, -1), axis=-1)  # [B, T, L]
    w = mask_BT.astype(jnp.float32)[..., None]
    return (differ * w).sum() / jnp.maximum(w.sum() * differ.shape[-1], 1.0)
