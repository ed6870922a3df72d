"""Hugging Face Llama / Llama-4 checkpoints -> the Flax policy's parameters (export: hf_export.py).

  cfg = config_from_hf(path, param_dtype="bfloat16")
  params = load_hf_checkpoint(path, cfg, mesh)      # sharded, unboxed params

Loading never holds the whole model on the host. The target of every parameter is a
NamedSharding derived from its logical axes (`jax.eval_shape` of `init_params`, then
`sharding.tree_shardings`); `jax.make_array_from_callback` asks for each device's block, and the
callback reads just that block from memory-mapped safetensors files, layer by layer, into the
stacked [L, ...] layout (host memory peaks at one device block). Files are parsed here (an
8-byte header length, a JSON header, raw little-endian data), so bfloat16 needs neither torch
nor the safetensors package.

Layout differences handled here:
  - HF Linear weights are [out, in]; Flax kernels are [in, out] split into heads.
  - Llama-4 applies RoPE to interleaved pairs (x0,x1),(x2,x3),... (`torch.view_as_complex`);
    model.py rotates halves (x[:H/2], x[H/2:]) like HF Llama-3, whose checkpoints are already
    permuted for it. For Llama-4 the q/k output features are permuted within each head
    (even features first, then odd): q.k is unchanged by a permutation applied to both, the
    qk L2 norm is too, and the rotation becomes rotate-half. Export applies the inverse.
  - Llama-4 experts are fused: gate_up_proj [E, D, 2F] (gate = first F columns) and
    down_proj [E, F, D]; the router is a Linear [E, D].
  - Multimodal Llama-4 checkpoints (Llama4ForConditionalGeneration) keep the text model
    under "language_model."; the vision tower is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import jax
import ml_dtypes
import numpy as np
from flax import linen as nn
from flax.core import FrozenDict

from rl_scaling import paths, sharding
from rl_scaling.policy import model as M

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


# ----------------------------------------------------------------------------- config

def _read_config(path):
    raw = json.loads(paths.read_text(paths.join(path, "config.json")))
    if raw.get("model_type") == "llama4" or "text_config" in raw:
        raw = dict(raw["text_config"], model_type="llama4_text")
    return raw


def _rope(raw):
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only default and llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), FrozenDict({k: float(scaling[k]) if k != "original_max_position_embeddings"
                                     else int(scaling[k]) for k in keys})


def config_from_hf(path: str, **overrides) -> M.ModelConfig:
    """A ModelConfig from a HF config.json (llama, llama4_text or multimodal llama4)."""
    raw = _read_config(path)
    mtype = raw.get("model_type")
    if mtype not in ("llama", "llama4_text"):
        raise NotImplementedError(f"{path}/config.json: model_type {mtype!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias") or raw.get("mlp_bias"):
        raise NotImplementedError(f"{path}/config.json: only bias-free SiLU Llama layers are supported")
    n_heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    kw = dict(
        vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_layers=raw["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads, mlp_dim=raw["intermediate_size"],
        rope_theta=theta, rope_scaling=scaling, norm_eps=raw.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    if mtype == "llama4_text":
        L = raw["num_hidden_layers"]
        moe_layers = raw.get("moe_layers")
        if moe_layers is None:
            step = raw.get("interleave_moe_layer_step", 1)
            moe_layers = list(range(step - 1, L, step))
        if list(moe_layers) != list(range(L)):
            raise NotImplementedError(f"{path}: only all-MoE Llama-4 models (Scout) are supported, moe_layers={moe_layers}")
        interval = raw.get("no_rope_layer_interval", 4)
        no_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
        if all(no_rope):
            interval = L + 1  # every layer RoPE + chunked
        elif list(no_rope) != [int((i + 1) % interval != 0) for i in range(L)]:
            raise NotImplementedError(f"{path}: no_rope_layers must be every {interval}-th layer, got {no_rope}")
        kw.update(
            num_experts=raw.get("num_local_experts", 16), num_experts_per_tok=raw.get("num_experts_per_tok", 1),
            moe_mlp_dim=raw["intermediate_size"], shared_expert=True,
            router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.0)),
            nope_layer_interval=interval, attention_chunk_size=int(raw.get("attention_chunk_size") or 0),
            use_qk_norm=bool(raw.get("use_qk_norm", False)),
            attn_temperature_tuning=bool(raw.get("attn_temperature_tuning", False)),
            floor_scale=float(raw.get("floor_scale", 8192)), attn_scale=float(raw.get("attn_scale", 0.1)),
        )
    kw.update(overrides)
    return M.ModelConfig(**kw)


# Fields that are choices of how to run the model, not part of the checkpoint's architecture.
_RUN_FIELDS = ("dtype", "param_dtype", "fp32_lm_head", "remat", "scan_layers", "attn_query_chunk", "moe_impl",
               "router_aux_loss_coef")


def is_hf_checkpoint(path: str) -> bool:
    """A directory (local or gs://) with a config.json and safetensors weights."""
    return (paths.isfile(paths.join(path, "config.json"))
            and any(f.endswith(".safetensors") for f in paths.listdir(path)))


def check_architecture(path: str, cfg: M.ModelConfig) -> None:
    """Raise naming every model field in which `cfg` differs from the checkpoint's config.json."""
    hf = config_from_hf(path)
    diffs = []
    for field in dataclasses.fields(M.ModelConfig):
        name = field.name
        if name in _RUN_FIELDS:
            continue
        ours, theirs = getattr(cfg, name), getattr(hf, name)
        if isinstance(ours, float) or isinstance(theirs, float):
            same = math.isclose(float(ours), float(theirs), rel_tol=1e-6)
        elif name == "rope_scaling":
            same = dict(ours or {}) == dict(theirs or {})
        else:
            same = ours == theirs
        if not same:
            diffs.append(f"model.{name}: config {ours!r}, checkpoint {theirs!r}")
    if diffs:
        raise ValueError(f"{path}/config.json does not match the configured model:\n  " + "\n  ".join(diffs))


# ----------------------------------------------------------------------------- safetensors

class _SafetensorsDir:
    """Tensors of a checkpoint directory (single file or sharded index): memory-mapped when
    local, read by byte ranges when on gs://."""

    def __init__(self, path, progress=None):
        self.progress = progress  # progress(tensors read, tensors in the checkpoint), or None
        index = paths.join(path, "model.safetensors.index.json")
        if paths.exists(index):
            files = sorted(set(json.loads(paths.read_text(index))["weight_map"].values()))
        else:
            files = sorted(n for n in paths.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        self.entries = {}
        for name in files:
            fname = paths.join(path, name)
            with paths.open_file(fname, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for key, info in header.items():
                if info["dtype"] not in _ST_DTYPES:
                    raise NotImplementedError(f"{fname}: tensor {key} has unsupported dtype {info['dtype']}")
                self.entries[key] = (fname, 8 + n + info["data_offsets"][0], info["dtype"], tuple(info["shape"]))
        self._maps = {}

    def keys(self):
        return self.entries.keys()

    def __getitem__(self, key):
        """A read-only np.memmap view: slicing it reads only the pages needed."""
        if key not in self._maps:
            fname, offset, dt, shape = self.entries[key]
            if math.prod(shape) == 0:
                self._maps[key] = np.zeros(shape, _ST_DTYPES[dt])
            elif paths.is_gcs(fname):
                self._maps[key] = _RangeTensor(fname, offset, np.dtype(_ST_DTYPES[dt]), shape)
            else:
                self._maps[key] = np.memmap(fname, dtype=_ST_DTYPES[dt], mode="r", offset=offset, shape=shape)
            if self.progress is not None:
                self.progress(len(self._maps), len(self.entries))
        return self._maps[key]


class _RangeTensor:
    """A tensor in a remote safetensors file: indexing with slices reads only the rows (range of
    the first axis) it touches, one byte-range read per call."""

    def __init__(self, fname, offset, dtype, shape):
        self.fname, self.offset, self.dtype, self.shape = fname, offset, dtype, shape

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not self.shape:
            return self._read(0, 1).reshape(())[idx]
        start, stop, step = (idx[0] if idx else slice(None)).indices(self.shape[0])
        rows = self._read(start, max(stop - start, 0)).reshape((max(stop - start, 0),) + self.shape[1:])
        return rows[(slice(None, None, step),) + idx[1:]]

    def _read(self, row, n_rows):
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        with paths.open_file(self.fname, "rb") as f:
            f.seek(self.offset + row * row_bytes)
            return np.frombuffer(f.read(n_rows * row_bytes), self.dtype)


# ----------------------------------------------------------------------------- name mapping

def _rope_perm(H):
    """Feature order that turns interleaved-pair RoPE into rotate-half RoPE."""
    return np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])


def _param_specs(cfg: M.ModelConfig):
    """Our parameter path -> (HF key template or None, reader kind). '{i}' is the layer."""
    llama4 = bool(cfg.num_experts)
    a = "model.layers.{i}.self_attn."
    specs = {
        ("embed",): ("model.embed_tokens.weight", "same"),
        ("final_norm", "scale"): ("model.norm.weight", "same"),
        ("layers", "attn_norm", "scale"): ("model.layers.{i}.input_layernorm.weight", "same"),
        ("layers", "mlp_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", "same"),
        ("layers", "attn", "q", "kernel"): (a + "q_proj.weight", "in_rope" if llama4 else "in_heads"),
        ("layers", "attn", "k", "kernel"): (a + "k_proj.weight", "in_rope" if llama4 else "in_heads"),
        ("layers", "attn", "v", "kernel"): (a + "v_proj.weight", "in_heads"),
        ("layers", "attn", "o", "kernel"): (a + "o_proj.weight", "out_heads"),
    }
    if not cfg.tie_embeddings:
        specs[("lm_head",)] = ("lm_head.weight", "T")
    if llama4:
        f = "model.layers.{i}.feed_forward."
        specs.update({
            ("layers", "moe", "router"): (f + "router.weight", "T"),
            ("layers", "moe", "wi_gate"): (f + "experts.gate_up_proj", "gate_half"),
            ("layers", "moe", "wi_up"): (f + "experts.gate_up_proj", "up_half"),
            ("layers", "moe", "wo"): (f + "experts.down_proj", "same"),
        })
        mlp, prefix = ("layers", "moe", "shared"), f + "shared_expert."
    else:
        mlp, prefix = ("layers", "mlp"), "model.layers.{i}.mlp."
    for name in ("gate", "up", "down"):
        specs[mlp + (name, "kernel")] = (prefix + f"{name}_proj.weight", "T")
    return specs


def _norm_index(index, shape):
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def _read_block(src, kind, idx, shape):
    """Our-layout block `idx` (tuple of slices over the per-layer `shape`) of HF tensor `src`."""
    if kind == "same":
        return src[idx]
    if kind == "T":  # HF [out, in] -> ours [in, out]
        return src[idx[1], idx[0]].T
    if kind in ("gate_half", "up_half"):  # fused [E, D, 2F] -> [E, D, F]
        F = shape[2]
        off = 0 if kind == "gate_half" else F
        return src[idx[0], idx[1], slice(idx[2].start + off, idx[2].stop + off)]
    if kind in ("in_heads", "in_rope"):  # HF [N*H, D] -> ours [D, N, H]
        sd, sn, sh = idx
        H = shape[2]
        blk = np.asarray(src[sn.start * H:sn.stop * H, sd]).reshape(sn.stop - sn.start, H, -1)
        if kind == "in_rope":
            blk = blk[:, _rope_perm(H)]
        return blk[:, sh].transpose(2, 0, 1)
    if kind == "out_heads":  # HF [D, N*H] -> ours [N, H, D]
        sn, sh, sd = idx
        H = shape[1]
        blk = np.asarray(src[sd, sn.start * H:sn.stop * H]).reshape(-1, sn.stop - sn.start, H)
        return blk[:, :, sh].transpose(1, 2, 0)
    raise ValueError(kind)


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------- load / save

def abstract_params(cfg: M.ModelConfig, mesh):
    """(ShapeDtypeStructs, NamedShardings) of the unboxed params, allocating nothing."""
    with jax.set_mesh(mesh):
        boxed = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
    shapes = nn.unbox(boxed)
    return shapes, sharding.tree_shardings(mesh, nn.get_partition_spec(boxed))


def load_hf_checkpoint(path: str, cfg: M.ModelConfig | None = None, mesh=None, progress=None):
    """Unboxed params (a dict like init_params' after nn.unbox), each a global jax.Array with
    the sharding its logical axes give on `mesh` (default: one device)."""
    cfg = cfg or config_from_hf(path)
    mesh = mesh or sharding.make_mesh(devices=jax.devices()[:1])
    files = _SafetensorsDir(path, progress)
    prefix = ""
    if "model.embed_tokens.weight" not in files.keys():
        hits = [k[: -len("model.embed_tokens.weight")] for k in files.keys() if k.endswith("model.embed_tokens.weight")]
        if len(hits) != 1:
            raise KeyError(f"{path}: no (unique) model.embed_tokens.weight among the checkpoint tensors")
        prefix = hits[0]
    shapes, shardings = abstract_params(cfg, mesh)
    specs = _param_specs(cfg)
    out = {}
    for ppath, sds in _flat(shapes):
        if ppath not in specs:
            raise KeyError(f"no HF tensor known for parameter {'/'.join(ppath)}")
        key, kind = specs[ppath]
        key = prefix + key
        stacked = ppath[0] == "layers"
        per_layer_shape = sds.shape[1:] if stacked else sds.shape
        for i in range(cfg.n_layers if stacked else 1):
            k = key.format(i=i)
            if k not in files.keys():
                raise KeyError(f"{path}: tensor {k} (for {'/'.join(ppath)}) is missing")

        def cb(index, key=key, kind=kind, stacked=stacked, shape=per_layer_shape, dtype=sds.dtype):
            index = _norm_index(index, ((cfg.n_layers,) if stacked else ()) + tuple(shape))
            if not stacked:
                return np.asarray(_read_block(files[key], kind, index, shape), dtype=dtype)
            return np.stack([np.asarray(_read_block(files[key.format(i=i)], kind, index[1:], shape), dtype=dtype)
                             for i in range(index[0].start, index[0].stop)])

        _set(out, ppath, jax.make_array_from_callback(sds.shape, shardings_at(shardings, ppath), cb))
    return out


def shardings_at(tree, path):
    for k in path:
        tree = tree[k]
    return tree
