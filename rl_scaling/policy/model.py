"""A Llama-style decoder in Flax Linen: RMSNorm, RoPE, grouped-query attention, SwiGLU (mlp.py)
or mixture-of-experts (moe.py) feed-forward.

Layers are stacked and scanned (`nn.scan`), so compile time does not grow with depth.
Parameters carry logical axis names; `rl_scaling.sharding` maps them onto a mesh.

Shape letters used in tensor names:
  B batch, T new tokens in this call, S key/value cache length, D d_model,
  N query heads, K key/value heads, G query heads per key/value head (N = K*G),
  H head dim, F MLP hidden, V vocabulary, L layers.

One entry point serves training, prefill and decoding:
  logits_BTV, cache = model.apply(params, tokens_BT, positions_BT, token_mask_BT, cache)
With `cache=None` attention is causal over the call's own tokens (training). With a
cache, the T new tokens are written at each row's `cache["index"]` slot and attend
to every valid slot up to their own (prefill and decode, per-row offsets, so a
JetStream slot can be at any position).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from rl_scaling import sharding
from rl_scaling.policy import moe
from rl_scaling.policy.mlp import DTYPES, SwiGLU, dense_init  # model_lib.DTYPES stays importable
from rl_scaling.policy.model_config import ModelConfig  # model_lib.ModelConfig stays importable


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rope_frequencies(cfg: ModelConfig):
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling:  # Llama 3.1 long-context frequency scaling
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * jnp.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = jnp.where(is_mid, mid, scaled)
    return inv_freq


def apply_rope(x_BTNH, positions_BT, inv_freq):
    """Rotate-half RoPE (the HF Llama convention), computed in float32."""
    angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angles_BTh)[:, :, None, :], jnp.cos(angles_BTh)[:, :, None, :]
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    query_offset: int | None = None  # see Decoder

    @nn.compact
    def __call__(self, x_BTD, positions_BT, masks, cache_kv, cache_index_B, is_nope=None):
        """is_nope: None (every layer RoPE, global mask) or a traced bool (Llama 4: NoPE and the
        global mask on this layer, else RoPE and the chunked "local" mask); q, k and the mask are
        selected elementwise, so attention runs once either way."""
        cfg = self.cfg
        dtype = DTYPES[cfg.dtype]
        K, G, H = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        B, T, _ = x_BTD.shape

        q_BTNH, k_BTKH, v_BTKH = self.project_qkv(x_BTD)
        inv_freq = rope_frequencies(cfg)
        q_rope, k_rope = apply_rope(q_BTNH, positions_BT, inv_freq), apply_rope(k_BTKH, positions_BT, inv_freq)
        if cfg.use_qk_norm:
            q_rope, k_rope = _l2_norm(q_rope, cfg.norm_eps), _l2_norm(k_rope, cfg.norm_eps)
        if is_nope is None:
            q_BTNH, k_BTKH, masks = q_rope, k_rope, (masks["global"],)
        else:
            if cfg.attn_temperature_tuning:
                scale = jnp.log1p(jnp.floor((positions_BT.astype(jnp.float32) + 1.0) / cfg.floor_scale))
                q_BTNH = (q_BTNH * (scale * cfg.attn_scale + 1.0)[:, :, None, None]).astype(dtype)
            q_BTNH, k_BTKH = jnp.where(is_nope, q_BTNH, q_rope), jnp.where(is_nope, k_BTKH, k_rope)
            masks = (masks["local"], masks["global"])
        select = lambda ms: ms[0] if len(ms) == 1 else jnp.where(is_nope, ms[1], ms[0])  # noqa: E731

        if cache_kv is not None:
            # cache_kv: this layer's own [B, K, S, H] keys and values (separate buffers per layer,
            # so reading one never copies it out of a stack; heads before slots, so the attention
            # matmuls need no transpose); write the new ones at each row's own offset.
            rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
            slots_BT = cache_index_B[:, None] + jnp.arange(T)[None, :]

            def write(c, u_BTKH):
                return c.at[rows_BT, :, slots_BT].set(u_BTKH.astype(c.dtype), mode="promise_in_bounds")

            new_cache_kv = (write(cache_kv[0], k_BTKH), write(cache_kv[1], v_BTKH))
            k_BKSH, v_BKSH = (c.astype(dtype) for c in new_cache_kv)
        else:
            k_BKSH, v_BKSH, new_cache_kv = k_BTKH.swapaxes(1, 2), v_BTKH.swapaxes(1, 2), None

        q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
        C = cfg.attn_query_chunk
        if C and T > C:  # blocks of C queries (padded), each recomputed in the backward pass
            n, pad = -(-T // C), -T % C
            split = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(  # noqa: E731
                (B, n, C) + x.shape[2:]).swapaxes(0, 1)
            block = jax.checkpoint(lambda q, ms: _attend(q, k_BKSH, v_BKSH, select(ms), dtype))
            out_nBCKGH = jax.lax.map(lambda qm: block(*qm), (split(q_BTKGH), tuple(map(split, masks))))
            out_BTKGH = out_nBCKGH.swapaxes(0, 1).reshape(B, n * C, K, G, H)[:, :T]
        else:
            out_BTKGH = self.attend(q_BTKGH, k_BKSH, v_BKSH, select(masks))
        return self.project_out(out_BTKGH.reshape(B, T, cfg.n_heads, H)), new_cache_kv

    # The matmuls and the attention of a call, as named methods: a backend may replace them while it
    # decodes (flax.linen.intercept_methods; policy/cpu_kernels.py on XLA:CPU) with the same math.
    def project_qkv(self, x_BTD):
        """(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H])."""
        cfg = self.cfg
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]

        def proj(name, heads, axes):
            return nn.DenseGeneral(
                (heads, cfg.head_dim), dtype=dtype, param_dtype=pdtype, use_bias=False, name=name,
                kernel_init=nn.with_logical_partitioning(dense_init(), ("embed",) + axes),
            )(x_BTD)

        return (proj("q", cfg.n_heads, ("heads", "head_dim")), proj("k", cfg.n_kv_heads, ("kv_heads", "head_dim")),
                proj("v", cfg.n_kv_heads, ("kv_heads", "head_dim")))

    def attend(self, q_BTKGH, k_BKSH, v_BKSH, mask_BTS):
        """Softmax attention of the call's queries over the keys (_attend)."""
        return _attend(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, DTYPES[self.cfg.dtype], self.query_offset)

    def project_out(self, out_BTNH):
        """The output projection, [B, T, N, H] -> [B, T, D]."""
        cfg = self.cfg
        return nn.DenseGeneral(
            cfg.d_model, axis=(-2, -1), dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], use_bias=False,
            name="o", kernel_init=nn.with_logical_partitioning(dense_init(), ("heads", "head_dim", "embed")),
        )(out_BTNH)


# Training attention runs as up to this many blocks of queries, each over the keys up to its last
# query (the rest are masked): 5/8 of the [T, T] scores at 80 tokens. Blocks of fewer than
# MIN_CAUSAL_BLOCK queries cost more in extra kernels than they save, so short sequences keep one
# block (measurements: docs/benchmarks.md).
CAUSAL_BLOCKS, MIN_CAUSAL_BLOCK = 4, 16


def even_split_ends(total: int, at_most: int, min_len: int) -> list[int]:
    """Ends of up to `at_most` near-equal consecutive parts of range(total), each of at least
    `min_len` (one part when total is shorter): causal attention blocks, decode segments."""
    n = max(1, min(at_most, total // min_len))
    return [total * (i + 1) // n for i in range(n)]


def causal_blocks(T: int) -> list[tuple[int, int]]:
    """(first, end) query rows of each training attention block; block [lo, hi) reads keys [0, hi)."""
    ends = even_split_ends(T, CAUSAL_BLOCKS, MIN_CAUSAL_BLOCK)
    return list(zip([0] + ends[:-1], ends))


def _attend(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype, query_offset=None):
    """Softmax attention of T queries over S keys; scores and softmax in float32. Training:
    causal blocks; with a cache _attend_cached, in causal blocks too where every row's queries
    sit at cache slots [query_offset, +T)."""
    B, T, K, G, H = q_BTKGH.shape
    if T == k_BKSH.shape[2] and T > 1:  # training: the queries are the keys
        return _in_causal_blocks(_attend_block, q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype, 0)
    if query_offset is not None and T > 1:
        return _in_causal_blocks(_attend_cached, q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype, query_offset)
    return _attend_cached(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype)


def _in_causal_blocks(attend, q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype, offset):
    """`attend` over blocks of the T queries, which sit at slots [offset, offset + T): block
    [lo, hi) reads only the slots up to its last query's, [0, offset + hi); the rest are masked."""
    return jnp.concatenate([attend(q_BTKGH[:, lo:hi], k_BKSH[:, :, :offset + hi], v_BKSH[:, :, :offset + hi],
                                   mask_BTS[:, lo:hi, :offset + hi], dtype) for lo, hi in causal_blocks(q_BTKGH.shape[1])],
                           axis=1)


def _attend_cached(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype):
    """_attend over a cache (decode, prefill) as XLA ops. The queries of a kv head are one
    [G*T, H] matrix, so both matmuls are plain batched matmuls over (B, K) whose outputs need
    no transpose: XLA:CPU runs a decode step's probs x V that way several times faster than with
    the (t, g) output layout (docs/benchmarks.md)."""
    B, T, K, G, H = q_BTKGH.shape
    q_BKQH = q_BTKGH.transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)  # Q = (g, t)
    if T == 1:  # a decode step
        scores = jax.lax.platform_dependent(q_BKQH, k_BKSH, cpu=_scores_keys_first, default=_scores)
    else:
        scores = _scores(q_BKQH, k_BKSH)
    scores = scores.reshape(B, K, G, T, -1) * (H ** -0.5)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype).reshape(B, K, G * T, -1)
    out_BKQH = jnp.einsum("bkqs,bksh->bkqh", probs, v_BKSH)
    return out_BKQH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4)


def _scores(q_BKQH, k_BKSH):
    return jnp.einsum("bkqh,bksh->bkqs", q_BKQH, k_BKSH, preferred_element_type=jnp.float32)


def _scores_keys_first(q_BKQH, k_BKSH):
    """The same scores as keys x queries^T, then transposed: XLA:CPU runs a decode step's
    [S, H] x [H, G] batched matmul faster than [G, H] x [H, S] (docs/benchmarks.md). The barrier
    keeps XLA from folding the transpose back into the dot's output layout."""
    scores_BKSQ = jnp.einsum("bksh,bkqh->bksq", k_BKSH, q_BKQH, preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(scores_BKSQ).swapaxes(2, 3)


def _attend_block(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, dtype):
    """Training attention of T queries over their S keys: [T, S] score blocks per head."""
    H = q_BTKGH.shape[-1]
    scores = jnp.einsum("btkgh,bksh->bkgts", q_BTKGH, k_BKSH, preferred_element_type=jnp.float32)
    scores = scores * (H ** -0.5)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bkgts,bksh->btkgh", probs, v_BKSH)


def _l2_norm(x, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Block(nn.Module):
    """One decoder layer; scanned over the layer axis by `Decoder`."""

    cfg: ModelConfig
    query_offset: int | None = None  # see Decoder

    @nn.compact
    def __call__(self, carry, layer_idx, positions_BT, masks, cache_index_B, routing_BTK=None):
        cfg = self.cfg
        dtype = DTYPES[cfg.dtype]
        x_BTD, cache_kv = carry  # cache_kv: None (training) or this layer's (k, v)
        x_BTD = sharding.constrain(x_BTD, ("batch", "length", "embed"))
        h_BTD = RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x_BTD)
        attn = Attention(cfg, self.query_offset, name="attn")
        # Llama 4: every n-th layer has no RoPE and attends globally; the others are chunked.
        # The layer index is a traced scan input (or a Python int when the layers run one by one):
        # Attention selects q, k and the mask.
        is_nope = (layer_idx + 1) % cfg.nope_layer_interval == 0 if cfg.nope_layer_interval else None
        attn_BTD, cache_kv = attn(h_BTD, positions_BT, masks, cache_kv, cache_index_B, is_nope)
        x_BTD = x_BTD + attn_BTD
        h_BTD = RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x_BTD)
        if cfg.num_experts:
            mlp_BTD = moe.MoeMlp(cfg, name="moe")(h_BTD, routing_BTK)
        else:
            mlp_BTD = SwiGLU(cfg, cfg.mlp_dim, name="mlp")(h_BTD)
        x_BTD = x_BTD + mlp_BTD
        return (x_BTD, cache_kv), None


class Decoder(nn.Module):
    cfg: ModelConfig
    # With a cache: every row's first new token goes to this slot (static; the trainer's
    # completions after a shared prompt, train_step.shared_prompt_logprobs), so attention runs
    # in causal blocks of queries, each over the slots up to its last query's.
    query_offset: int | None = None

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, token_mask_BT, cache=None, return_hidden=False, routing=None):
        """Logits [B, T, V] in float32 and the updated cache. With return_hidden=True (training
        at large vocab) it returns the final hidden states and the LM head kernel instead,
        so the caller can compute log-probs chunk by chunk without all the logits at once.
        routing [B, T, n_layers, k] (MoE routing replay): the experts each token takes in each
        layer instead of the router's top-k (moe.MoeMlp); the routers' own choices are sown
        (`moe.routing_of`) when "intermediates" is mutable."""
        cfg = self.cfg
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        embed = self.param(
            "embed", nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
            (cfg.vocab_size, cfg.d_model), pdtype,
        )
        # Lookup from a table gathered along `embed` (as FSDP gathers any weight; cast first, the
        # values are cast anyway), still split along `vocab`: a masked local lookup plus a sum
        # over `tensor`, already split over the batch. Taking straight from the [vocab, embed]-
        # sharded table makes the partitioner replicate the looked-up activations.
        table_VD = sharding.constrain(embed.astype(dtype), ("vocab", None))
        x_BTD = sharding.constrain(jnp.take(table_VD, tokens_BT, axis=0), ("batch", "length", "embed"))

        masks, cache_index_B, new_valid, new_pos = attention_masks(cfg, positions_BT, token_mask_BT, cache)
        unrolled = cache is not None or not (cfg.scan_layers or cfg.num_experts or self.is_initializing())
        if not unrolled:  # training and scoring: one scanned layer, compiled once
            block = Block
            if cfg.remat:
                block = nn.remat(Block, prevent_cse=False, static_argnums=())
            routing_LBTK = None if routing is None else jnp.moveaxis(routing, 2, 0)
            layers = nn.scan(
                block,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast if routing is None else 0),
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, self.query_offset, name="layers")
            (x_BTD, _), _ = layers((x_BTD, None), jnp.arange(cfg.n_layers), positions_BT, masks, None, routing_LBTK)
            new_kv = None
        else:
            # Layer by layer over the same stacked params. Decoding: over per-layer cache buffers,
            # since a scan would slice (copy) the layer's cache and weights out of the stacks at
            # every step; the weights may come pre-split (`split_layers`, once per sampling
            # call) so their slices are not copied per step either.
            record = bool(cfg.num_experts) and self.is_mutable_collection("intermediates")
            x_BTD, new_kv, expert_idx = _unrolled_layers(cfg, self.query_offset, self.variables["params"]["layers"],
                                                         x_BTD, cache, positions_BT, masks, cache_index_B, routing, record)
            if record:  # the scan's layout: [n_layers, B*T, k]
                self.sow("intermediates", "expert_idx", jnp.stack(expert_idx))
        x_BTD = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x_BTD)

        if cfg.tie_embeddings:
            kernel_DV = embed.T
        else:
            kernel_DV = self.param(
                "lm_head", nn.with_logical_partitioning(dense_init(), ("embed", "vocab")),
                (cfg.d_model, cfg.vocab_size), pdtype,
            )
        if return_hidden:
            return x_BTD, kernel_DV
        logits_BTV = self.head(x_BTD, kernel_DV)

        if cache is None:
            return logits_BTV, None
        new_cache = {
            "k": new_kv[0], "v": new_kv[1], "valid": new_valid, "pos": new_pos,
            "index": cache_index_B + tokens_BT.shape[1],
        }
        return logits_BTV, new_cache

    def head(self, x_BTD, kernel_DV):
        """The LM head's logits [B, T, V] in float32 (lm_head); a named method that a decoding
        backend may replace (see Attention.project_qkv)."""
        return lm_head(x_BTD, kernel_DV, self.cfg)


def attention_masks(cfg: ModelConfig, positions_BT, token_mask_BT, cache):
    """(masks, cache_index_B, the cache's new valid and pos rows) for one forward: "global" is
    causal over the valid slots (the T new tokens', or the cache's once they are written), and
    with NoPE layers "local" also keeps each query to its own attention chunk. Without a cache
    the last three are None."""
    B, T = token_mask_BT.shape
    if cache is None:
        cache_index_B = new_valid = new_pos = None
        q_slot_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        valid_BS, kv_slot_S, kv_pos_BS = token_mask_BT, jnp.arange(T), positions_BT
    else:
        cache_index_B = cache["index"]
        q_slot_BT = cache_index_B[:, None] + jnp.arange(T)
        write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i,)))
        new_valid = write(cache["valid"], token_mask_BT, cache_index_B)
        new_pos = write(cache["pos"], positions_BT.astype(cache["pos"].dtype), cache_index_B)
        valid_BS, kv_slot_S, kv_pos_BS = new_valid, jnp.arange(cache["valid"].shape[1]), new_pos
    global_BTS = (kv_slot_S[None, None, :] <= q_slot_BT[:, :, None]) & valid_BS[:, None, :]
    masks = {"global": global_BTS}
    if cfg.nope_layer_interval:
        chunk = cfg.attention_chunk_size or (1 << 30)
        same_chunk = (kv_pos_BS[:, None, :] // chunk) == (positions_BT[:, :, None] // chunk)
        masks["local"] = global_BTS & same_chunk
    return masks, cache_index_B, new_valid, new_pos


def _unrolled_layers(cfg, query_offset, layers, x_BTD, cache, positions_BT, masks, cache_index_B, routing, record):
    """The decoder layers one by one over the stacked (or `split_layers`) params: (x_BTD, the
    new (k, v) per layer, each layer's recorded experts when `record`)."""
    def run_layer(layer_variables, x_BTD, kv, i):
        r = None if routing is None else routing[:, :, i]
        out = Block(cfg, query_offset).apply(layer_variables, (x_BTD, kv), i, positions_BT, masks,
                                             cache_index_B, r, mutable=["intermediates"] if record else False)
        ((x_BTD, kv), _), inter = out if record else (out, {})
        return x_BTD, kv, inter.get("intermediates", {}).get("moe", {}).get("expert_idx", (None,))[0]

    if cfg.remat and cache is None:
        run_layer = jax.checkpoint(run_layer, static_argnums=(3,), prevent_cse=False)
    if not isinstance(layers, (list, tuple)):
        layers = split_layers({"layers": layers})["layers"]
    new_k, new_v, expert_idx = [], [], []
    for i, layer_params in enumerate(layers):
        kv = None if cache is None else (cache["k"][i], cache["v"][i])
        x_BTD, kv, idx_SK = run_layer({"params": layer_params}, x_BTD, kv, i)
        expert_idx.append(idx_SK)
        # The scan's carry stores the residual stream in cfg.dtype between layers; without
        # the barrier XLA fuses across layers and skips that rounding, and a bfloat16
        # generator would drift from the trainer's recompute of its log-probs.
        x_BTD = jax.lax.optimization_barrier(x_BTD)
        if kv is not None:
            new_k.append(kv[0])
            new_v.append(kv[1])
    return x_BTD, (tuple(new_k), tuple(new_v)), expert_idx


def lm_head(x_BTD, kernel_DV, cfg: ModelConfig):
    """Logits in float32; the matmul itself runs in float32 when cfg.fp32_lm_head (ScaleRL's
    FP32 head), otherwise in the body's dtype and is then cast."""
    head_dtype = jnp.float32 if cfg.fp32_lm_head else DTYPES[cfg.dtype]
    return jnp.dot(x_BTD.astype(head_dtype), kernel_DV.astype(head_dtype)).astype(jnp.float32)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None):
    """An empty KV cache: per layer [B, K, S, H] keys and values (tuples of n_layers arrays),
    plus per-slot bookkeeping."""
    dtype = dtype or DTYPES[cfg.dtype]
    shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
    return {
        "k": tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
        "v": tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
        "valid": jnp.zeros((batch, length), bool),
        "pos": jnp.zeros((batch, length), jnp.int32),
        "index": jnp.zeros((batch,), jnp.int32),
    }


def grow_cache(cache, length: int):
    """The cache with room for `length` slots: new slots empty, as init_cache makes them."""
    pad = length - cache["valid"].shape[1]
    if pad < 0:
        raise ValueError(f"grow_cache: length {length} is below the cache's {cache['valid'].shape[1]} slots")

    def widen(x, axis):
        return jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)]) if pad else x

    return {"k": tuple(widen(c, 2) for c in cache["k"]), "v": tuple(widen(c, 2) for c in cache["v"]),
            "valid": widen(cache["valid"], 1), "pos": widen(cache["pos"], 1), "index": cache["index"]}


def split_layers(params):
    """Params with the stacked [L, ...] layer weights split into a tuple of per-layer trees, for
    decoding (`Decoder` with a cache takes either form)."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda p: p[i], stacked) for i in range(n))}


def positions_from_mask(token_mask_BT):
    """Position of each token among the real tokens of its row (pads get 0)."""
    return jnp.maximum(jnp.cumsum(token_mask_BT.astype(jnp.int32), axis=1) - 1, 0)


def init_params(cfg: ModelConfig, rng, batch: int = 1, length: int = 8):
    """Boxed (logically annotated) parameters; use nn.unbox / nn.get_partition_spec on them."""
    tokens = jnp.zeros((batch, length), jnp.int32)
    mask = jnp.ones((batch, length), bool)
    return Decoder(cfg).init(rng, tokens, positions_from_mask(mask), mask)["params"]


def compute_params(cfg: ModelConfig, active: bool = True) -> int:
    """Parameters that do a matmul per token: all but the embedding lookup, the LM head
    included (for MoE with active=True, only the experts a token is routed to).
    Model FLOPs use it: 2N per token forward, 6N forward+backward."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    if cfg.num_experts:
        per_expert = 3 * cfg.d_model * cfg.moe_mlp_dim
        experts = per_expert * (cfg.num_experts_per_tok if active else cfg.num_experts)
        shared = 3 * cfg.d_model * cfg.mlp_dim if cfg.shared_expert else 0
        mlp = experts + shared + cfg.d_model * cfg.num_experts
    else:
        mlp = 3 * cfg.d_model * cfg.mlp_dim
    norms = 2 * cfg.d_model
    head = cfg.d_model * cfg.vocab_size  # the LM head multiplies every token, tied to the embedding or not
    return cfg.n_layers * (attn + mlp + norms) + cfg.d_model + head
