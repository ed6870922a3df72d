"""The policy's shape and numerics (`ModelConfig`), with the dtype and MoE choice names it is
checked against: its own module, without jax, so the decoder (model.py), its feed-forwards (mlp.py,
moe.py) and the experiment config's checks (config.py, which run before jax is imported) import it
without importing one another."""

from __future__ import annotations

import dataclasses
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16")  # mlp.DTYPES maps them to jax dtypes
MOE_IMPLS = ("ragged", "expert_parallel", "dense")  # moe.py
MOE_INDIVISIBLE = ("error", "warn")  # moe.indivisible


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"  # activations and matmuls of the body
    param_dtype: str = "float32"
    fp32_lm_head: bool = True  # logits in float32 even when the body runs in bfloat16
    tie_embeddings: bool = False
    remat: bool = False
    # Training: False runs the layers one after another (dense models; the params stay stacked)
    # instead of a scan, which saves XLA:CPU the zero-filled stacks of saved activations and
    # their per-layer slices (docs/benchmarks.md) at the cost of compile time
    # that grows with depth. Decoding always runs layer by layer.
    scan_layers: bool = True
    # >0: attention runs over blocks of this many queries under jax.checkpoint, so the
    # [T, S] scores of a long sequence never exist at once (16k-token RL sequences)
    attn_query_chunk: int = 0
    # Mixture of experts (0 experts = dense SwiGLU in every layer); see moe.py.
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_mlp_dim: int = 0
    shared_expert: bool = True
    router_aux_loss_coef: float = 0.0
    moe_impl: str = "ragged"  # MOE_IMPLS: "ragged" / "expert_parallel": dropless grouped matmul (moe.py); "dense": test oracle
    moe_token_chunk: int = 0  # expert_parallel: tokens per device and exchange (0: all at once); bounds the buffers
    # Shapes the mesh does not divide make the experts' weights gather whole per layer (moe.indivisible):
    # "error" stops at trace time naming the shapes and config fields, "warn" logs the bytes it costs.
    moe_indivisible: str = "warn"
    # Llama-4 attention details (off for Llama-3 shapes).
    nope_layer_interval: int = 0  # every n-th layer uses no RoPE (Llama 4: 4)
    attention_chunk_size: int = 0  # RoPE layers attend within chunks (Llama 4: 8192)
    use_qk_norm: bool = False  # L2-normalize q and k on RoPE layers (Llama 4)
    attn_temperature_tuning: bool = False  # scale q on NoPE layers at long context (Llama 4)
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    rope_scaling: Any = None  # Llama-3.1 style frequency scaling dict, or None

    def __post_init__(self):
        if self.moe_indivisible not in MOE_INDIVISIBLE:
            raise ValueError(f"model.moe_indivisible must be one of {MOE_INDIVISIBLE}, got {self.moe_indivisible!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(f"model.{name} must be one of {sorted(DTYPE_NAMES)}, got {getattr(self, name)!r}")
