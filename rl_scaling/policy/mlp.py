"""The dense SwiGLU feed-forward and the jax dtypes of ModelConfig's dtype names, shared by the
decoder (model.py) and the mixture of experts (moe.py, whose shared expert is this MLP)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from rl_scaling.policy.model_config import DTYPE_NAMES, ModelConfig

DTYPES = dict(zip(DTYPE_NAMES, (jnp.float32, jnp.bfloat16)))


def dense_init():
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); a decoding backend may replace the whole call (see
    model.Attention.project_qkv)."""

    cfg: ModelConfig
    hidden: int

    @nn.compact
    def __call__(self, x_BTD):
        cfg = self.cfg
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]

        def dense(name, features, axes):
            return nn.Dense(features, dtype=dtype, param_dtype=pdtype, use_bias=False, name=name,
                            kernel_init=nn.with_logical_partitioning(dense_init(), axes))

        # Tokens flattened to one axis: the weight gradients are then plain [N, D]^T @ [N, F]
        # matmuls; with (batch, length) as two contracted axes XLA:CPU transposes the [N, F]
        # activation gradients inside their elementwise fusions, which dominated the step.
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        gate_NF = dense("gate", self.hidden, ("embed", "mlp"))(x_ND)
        up_NF = dense("up", self.hidden, ("embed", "mlp"))(x_ND)
        out_ND = dense("down", cfg.d_model, ("mlp", "embed"))(nn.silu(gate_NF) * up_NF)
        return out_ND.reshape(x_BTD.shape[:-1] + (cfg.d_model,))
