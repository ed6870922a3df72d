"""The Flax policy's parameters -> a Hugging Face Llama / Llama-4 checkpoint directory.

  save_hf_checkpoint(params, cfg, out_dir, tokenizer=tok, generation=dict(temperature=1.0))
      # safetensors shards + config.json (+ the tokenizer files, the special-token ids and
      # generation_config.json when a tokenizer is given): AutoTokenizer and
      # AutoModelForCausalLM.generate read the directory as it is

The inverse of hf_io.py's loading, through the same name map (hf_io._param_specs): each
(layer, weight) is fetched to the host, laid out as HF stores it and streamed into its shard.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from rl_scaling import paths
from rl_scaling.policy import model as M
from rl_scaling.policy.hf_io import _NP_TO_ST, _flat, _param_specs, _rope_perm


def hf_config_dict(cfg: M.ModelConfig) -> dict:
    """config.json contents for a ModelConfig (LlamaForCausalLM or Llama4ForCausalLM)."""
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu", attention_bias=False, dtype=cfg.param_dtype,
        rope_scaling=dict(cfg.rope_scaling, rope_type="llama3") if cfg.rope_scaling else None,
    )
    if not cfg.num_experts:
        if cfg.nope_layer_interval or cfg.use_qk_norm:
            raise NotImplementedError("dense models with Llama-4 attention have no HF equivalent here")
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                    intermediate_size=cfg.mlp_dim, mlp_bias=False)
    if cfg.moe_mlp_dim != cfg.mlp_dim or not cfg.shared_expert:
        raise NotImplementedError("HF Llama-4 needs a shared expert as wide as the routed ones")
    L, n = cfg.n_layers, cfg.nope_layer_interval
    no_rope = [int(not n or (i + 1) % n != 0) for i in range(L)]
    return dict(
        common, architectures=["Llama4ForCausalLM"], model_type="llama4_text",
        intermediate_size=cfg.moe_mlp_dim, intermediate_size_mlp=cfg.mlp_dim,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        interleave_moe_layer_step=1, moe_layers=list(range(L)), no_rope_layers=no_rope,
        no_rope_layer_interval=n if 0 < n <= L else 4,
        # HF chunks every RoPE layer; no chunk here means a chunk longer than any sequence.
        attention_chunk_size=cfg.attention_chunk_size or (1 << 30), use_qk_norm=cfg.use_qk_norm,
        attn_temperature_tuning=cfg.attn_temperature_tuning, floor_scale=int(cfg.floor_scale),
        attn_scale=cfg.attn_scale, router_aux_loss_coef=cfg.router_aux_loss_coef,
    )


def _write_safetensors(fname, tensors: dict[str, Callable[[], np.ndarray]], specs: dict[str, tuple]):
    """Stream tensors into one file: the header first (from specs: name -> (dtype, shape)), then
    each tensor produced on demand, so only one is on the host at a time."""
    header, offset = {}, 0
    for name, (dt, shape) in specs.items():
        size = math.prod(shape) * np.dtype(dt).itemsize
        header[name] = {"dtype": _NP_TO_ST[np.dtype(dt)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with paths.open_file(fname, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (dt, shape) in specs.items():
            arr = np.ascontiguousarray(np.asarray(tensors[name](), dtype=dt))
            assert arr.shape == tuple(shape), (name, arr.shape, shape)
            f.write(arr.tobytes())


def _to_hf(arr, kind, H=None):
    """Inverse of _read_block on a whole per-layer array (for saving)."""
    if kind == "same":
        return arr
    if kind == "T":
        return arr.T
    if kind in ("in_heads", "in_rope"):
        if kind == "in_rope":
            arr = arr[:, :, np.argsort(_rope_perm(arr.shape[2]))]
        return arr.reshape(arr.shape[0], -1).T
    if kind == "out_heads":
        return arr.reshape(-1, arr.shape[2]).T
    raise ValueError(kind)


_layer = jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False))


def _host(arr, i):
    """Layer i of a stacked (possibly sharded) array, or the whole array, on the host."""
    return np.asarray(jax.device_get(arr if i is None else _layer(arr, i)))


def save_hf_checkpoint(params, cfg: M.ModelConfig, path: str, dtype: str | None = None,
                       max_shard_bytes: int = 5 << 30, tokenizer=None, generation: dict | None = None,
                       progress=None):
    """Write `params` (unboxed) as HF safetensors shards + index + config.json.

    With `tokenizer` (a CharTokenizer or HFTokenizer) also its files (save_hf_tokenizer), its
    bos/eos/pad ids in config.json and generation_config.json (those ids plus `generation`,
    e.g. the run's sampling temperature and max_new_tokens), so generate() stops at EOS.
    Tensors are fetched to the host one (layer, weight) at a time; progress(done, total), when
    given, is called after each. Single-process only: on a multi-host mesh gather with
    process_allgather first."""
    paths.makedirs(path)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.param_dtype) == "bfloat16" else np.dtype(np.float32)
    specs = _param_specs(cfg)
    flat = dict(_flat(params))
    jobs = {}  # hf name -> (dtype, shape, producer)
    for ppath, (key, kind) in specs.items():
        arr = flat[ppath]
        layers = range(cfg.n_layers) if ppath[0] == "layers" else [None]
        for i in layers:
            def produce(arr=arr, i=i, kind=kind, ppath=ppath):
                x = _host(arr, i)
                if kind == "gate_half":  # fuse gate and up: [E, D, F] x2 -> [E, D, 2F]
                    x = np.concatenate([x, _host(flat[ppath[:-1] + ("wi_up",)], i)], axis=-1)
                return _to_hf(x, "same" if kind == "gate_half" else kind)
            if kind == "up_half":
                continue
            shape = arr.shape[1:] if i is not None else arr.shape
            if kind == "gate_half":
                shape = shape[:-1] + (2 * shape[-1],)
            elif kind == "T":
                shape = shape[::-1]
            elif kind in ("in_heads", "in_rope"):
                shape = (shape[1] * shape[2], shape[0])
            elif kind == "out_heads":
                shape = (shape[2], shape[0] * shape[1])
            jobs[key.format(i=i)] = (np_dtype, tuple(shape), produce)
    # Shards in layer order, each at most max_shard_bytes (one tensor may exceed it alone).
    groups, cur, size = [], [], 0
    for name, (dt, shape, _) in jobs.items():
        nbytes = math.prod(shape) * dt.itemsize
        if cur and size + nbytes > max_shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    groups.append(cur)
    weight_map, done = {}, [0]

    def counted(produce):
        def run():
            x = produce()
            done[0] += 1
            if progress is not None:
                progress(done[0], len(jobs))
            return x
        return run

    for g, names in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(paths.join(path, fname), {n: counted(jobs[n][2]) for n in names},
                           {n: jobs[n][:2] for n in names})
        weight_map.update({n: fname for n in names})
    if len(groups) > 1:
        total = sum(math.prod(s) * d.itemsize for d, s, _ in jobs.values())
        paths.write_text(paths.join(path, "model.safetensors.index.json"),
                         json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = hf_config_dict(cfg)
    if tokenizer is not None:
        ids = dict(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        config.update(ids)
        paths.write_text(paths.join(path, "generation_config.json"),
                         json.dumps(dict(ids, **(generation or {})), indent=2))
        save_hf_tokenizer(tokenizer, path)
    paths.write_text(paths.join(path, "config.json"), json.dumps(config, indent=2))


# Post-processors that add special tokens around the text (BOS, EOS, CLS, ...).
_ADDS_SPECIALS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def save_hf_tokenizer(tokenizer, path: str) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json that AutoTokenizer loads
    as a PreTrainedTokenizerFast encoding text to the ids the run trained on.

    The run's prompt text carries its own BOS and encode() adds nothing, so the exported tokenizer
    adds nothing either: a post-processor adding special tokens is dropped and add_bos_token is
    off (`tokenizer("<bos>12+3=")` is the prompt's ids, `tokenizer("12+3=")` has no BOS). An
    HFTokenizer's own tokenizer_config.json (chat template, ...) is kept with those overrides."""
    data = json.loads(tokenizer.tok.to_str())
    post = data.get("post_processor")
    if post and post.get("type") in _ADDS_SPECIALS:
        data["post_processor"] = None
    elif post and post.get("type") == "Sequence":
        post["processors"] = [p for p in post["processors"] if p.get("type") not in _ADDS_SPECIALS]
    paths.write_text(paths.join(path, "tokenizer.json"), json.dumps(data, ensure_ascii=False))
    specials = {name: tokenizer.tok.id_to_token(i) for name, i in
                (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id), ("pad_token", tokenizer.pad_id))}
    tok_config = {}
    source = getattr(tokenizer, "path", None)  # an HFTokenizer's tokenizer.json
    if source and paths.exists(paths.join(paths.dirname(source), "tokenizer_config.json")):
        tok_config = json.loads(paths.read_text(paths.join(paths.dirname(source), "tokenizer_config.json")))
    # PreTrainedTokenizerFast: a Llama tokenizer class would re-add BOS from add_bos_token.
    tok_config.update(specials, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False,
                      add_eos_token=False, clean_up_tokenization_spaces=False, padding_side="left")
    paths.write_text(paths.join(path, "tokenizer_config.json"), json.dumps(tok_config, indent=2, ensure_ascii=False))
    paths.write_text(paths.join(path, "special_tokens_map.json"), json.dumps(specials, indent=2))
