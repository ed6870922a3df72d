"""A decode step's attention and matmuls on XLA:CPU as custom calls (the AVX-512 kernels in
decode_attention.cc and decode_matmul.cc, sharing cpu_kernels.h).

- Attention: XLA:CPU runs a decode step's attention as B*K tiny batched matmuls and a few
  softmax fusions; the kernel does each (row, kv head) in one pass, rows split over XLA's
  threads. At the RL step's generation shapes (256 rows, 64 new tokens) it takes a third off the
  tiny preset's generation time and a fifth off the small preset's (launch/bench.py presets).
- Matmuls of up to MAX_PANEL_ROWS rows (q/k/v, o, SwiGLU, LM head in decode steps and short
  prefills): YNN runs the sampler's [64, 256] @ [256, 1024] at ~55% of the float32 peak inside
  the decode loop. The kernel reads the weights as contiguous 32-column panels, laid out once
  per sampling call (`decode_panels`, a "panels" variable collection the modules use when
  present), at ~80%; SwiGLU's silu(gate) * up is computed in the same pass. The 64-row sampler
  +27-37% at small, +40% at tiny; 256 rows (the RL step's generation): +3%.

The sources are compiled on first use with the host's C++ compiler ($CXX, else c++) for this CPU
(-march=native) into $XDG_CACHE_HOME/rl_scaling (default ~/.cache/rl_scaling), keyed by the
sources, the compiler flags, jaxlib and the CPU. Where they cannot be built (no compiler, a CPU
without AVX-512, another architecture) one warning says why and XLA's attention and matmuls
run, as they do for other dtypes and shapes and in TPU and GPU lowerings
(`lax.platform_dependent`). RL_SCALING_CPU_KERNELS=0 turns the kernels off.

Their outputs match XLA's to float32 rounding (tests/test_cpu_kernels.py). Differentiating
through the attention kernel runs XLA's backward pass; the panel matmuls are for sampling only
and have no gradient.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from rl_scaling.policy.model import ModelConfig

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, name) for name in ("decode_attention.cc", "decode_matmul.cc"))
HEADER = os.path.join(_HERE, "cpu_kernels.h")
TARGETS = {"RlScalingDecodeAttention": "rl_scaling_decode_attention",
           "RlScalingPanelMatmul": "rl_scaling_panel_matmul", "RlScalingPanelSwiglu": "rl_scaling_panel_swiglu",
           "RlScalingPanelLayout": "rl_scaling_panel_layout"}
ATTENTION, MATMUL, SWIGLU, LAYOUT = TARGETS.values()
ENV_SWITCH = "RL_SCALING_CPU_KERNELS"
PANEL = 32  # columns per weight panel (decode_matmul.cc)
# Rows up to which the panel kernel runs: YNN's own blocking is no faster at 256 and 1024 rows (a
# prefill of 64 prompts of 16 tokens); beyond, unmeasured, XLA's matmul.
MAX_PANEL_ROWS = 1024


def attention_applies(q_BTKGH, k_BKSH, v_BKSH, dtype) -> bool:
    """Whether a call's attention can run as the kernel: one float32 query per row on a CPU
    backend, head_dim a multiple of 16, and the kernels built."""
    return (q_BTKGH.shape[1] == 1 and q_BTKGH.shape[-1] % 16 == 0 and jnp.dtype(dtype) == jnp.float32
            and all(x.dtype == jnp.float32 for x in (q_BTKGH, k_BKSH, v_BKSH))
            and jax.default_backend() == "cpu" and available())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def decode_attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference):
    """`reference(q_BTKGH, k_BKSH, v_BKSH, mask_BTS)` (model._attend's XLA path, T = 1) computed
    by the kernel; the backward pass is the reference's."""
    B, _, K, G, H = q_BTKGH.shape
    out_BKGH = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct((B, K, G, H), jnp.float32), vmap_method="sequential")(
        q_BTKGH[:, 0], k_BKSH, v_BKSH, mask_BTS[:, 0], scale=np.float32(H ** -0.5))
    return out_BKGH[:, None]


def _forward(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference):
    return decode_attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference), (q_BTKGH, k_BKSH, v_BKSH, mask_BTS)


def _backward(reference, saved, grad):
    q_BTKGH, k_BKSH, v_BKSH, mask_BTS = saved
    _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, mask_BTS), q_BTKGH, k_BKSH, v_BKSH)
    return (*vjp(grad), None)


decode_attention.defvjp(_forward, _backward)


# ---- matmuls of few rows over weight panels ----------------------------------------------------

def panels(sources_LKN, layer: int, interleave: bool = False):
    """[P, K, 32] weight panels of `layer` of the stacks `sources_LKN` ([L, K, N_i] each), their
    columns concatenated: each 32-column block contiguous (decode_matmul.cc). interleave: two
    sources (SwiGLU's gate and up), each panel 16 columns of the first then the same 16 of the
    second. On XLA:CPU one pass of the kernel (XLA's transposes ran at ~2 GB/s, 6% of a
    sampling call); elsewhere `_panels_reference`."""
    N = sum(w.shape[2] for w in sources_LKN)
    out = jax.ShapeDtypeStruct((N // PANEL, sources_LKN[0].shape[1], PANEL), jnp.float32)

    def kernel(*sources):
        return jax.ffi.ffi_call(LAYOUT, out)(*sources, layer=np.int64(layer), interleave=np.int64(interleave))

    return jax.lax.platform_dependent(*sources_LKN, cpu=kernel,
                                      default=lambda *w: _panels_reference(w, layer, interleave))


def _panels_reference(sources_LKN, layer, interleave):
    ws = [w[layer] for w in sources_LKN]
    K = ws[0].shape[0]
    if interleave:
        half = PANEL // 2
        w_KN = jnp.stack([w.reshape(K, -1, half) for w in ws], 2).reshape(K, -1)
    else:
        w_KN = jnp.concatenate(ws, -1)
    return w_KN.reshape(K, -1, PANEL).swapaxes(0, 1)


def decode_panels(params, cfg: ModelConfig):
    """{"panels": ...}: the projection, SwiGLU and LM head weights of `params` (stacked, as
    trained) laid out as panels, once per sampling call, for `Decoder.apply`'s variables; the
    modules take them through `module_panels`. {} where the kernels do not apply: another
    backend, no kernels, a dtype other than float32."""
    if not (jax.default_backend() == "cpu" and cfg.dtype == cfg.param_dtype == "float32" and available()):
        return {}
    stacked, L, D = params["layers"], cfg.n_layers, cfg.d_model
    qkv_LDN = [stacked["attn"][n]["kernel"].reshape(L, D, -1) for n in ("q", "k", "v")]
    o_LND = stacked["attn"]["o"]["kernel"].reshape(L, -1, D)
    mlp = stacked.get("mlp")

    def fits(*ws, width=PANEL):  # the sources' columns fill whole panels
        return sum(w.shape[-1] for w in ws) % width == 0

    layers = []
    for i in range(L):
        layer = {}
        if fits(*qkv_LDN) and fits(o_LND):
            layer["attn"] = {"qkv": panels(qkv_LDN, i), "o": panels([o_LND], i)}
        if mlp is not None and fits(mlp["gate"]["kernel"], width=PANEL // 2) and fits(mlp["down"]["kernel"]):
            layer["mlp"] = {"gate_up": panels([mlp["gate"]["kernel"], mlp["up"]["kernel"]], i, interleave=True),
                             "down": panels([mlp["down"]["kernel"]], i)}
        layers.append(layer)
    out = {"layers": tuple(layers)}
    head_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    if fits(head_DV):
        out["lm_head"] = panels([head_DV[None]], 0)
    return {"panels": out}


def module_panels(module, name: str, x_MK):
    """The `name` panels a module was given (decode_panels) if x_MK @ them runs as the kernel
    (float32, at most MAX_PANEL_ROWS rows); None otherwise, and the module runs XLA's matmul."""
    if module.has_variable("panels", name) and _rows_fit(x_MK):
        return module.get_variable("panels", name)
    return None


def _rows_fit(x_MK) -> bool:
    return x_MK.ndim == 2 and x_MK.shape[0] <= MAX_PANEL_ROWS and x_MK.dtype == jnp.float32


def matmul(x_MK, panels_PKC, reference):
    """x_MK @ w (`reference(x_MK)`, XLA's) with w as `panels`; the kernel on XLA:CPU."""
    return _on_cpu(MATMUL, panels_PKC.shape[0] * PANEL, x_MK, panels_PKC, reference)


def swiglu(x_MK, panels_PKC, reference):
    """silu(x_MK @ gate) * (x_MK @ up) with the weights as `panels((gate, up), interleave=True)`."""
    return _on_cpu(SWIGLU, panels_PKC.shape[0] * PANEL // 2, x_MK, panels_PKC, reference)


def _on_cpu(target, N, x_MK, panels_PKC, reference):
    # Not differentiable: only decoding (sampler.sample) lays out panels, and it never is.
    def kernel(x_MK, panels_PKC):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x_MK.shape[0], N), jnp.float32))(x_MK, panels_PKC)

    return jax.lax.platform_dependent(x_MK, panels_PKC, cpu=kernel, default=lambda x, _: reference(x))


# ---- building ----------------------------------------------------------------------------------

@functools.cache
def available() -> bool:
    """Build (once per source, compiler and CPU) and register the kernels; False, with one warning
    saying why, where they cannot be built or RL_SCALING_CPU_KERNELS=0."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(_build())
        for symbol, target in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        logging.warning("rl_scaling: XLA's attention and matmuls run decode steps; the CPU kernels could not be "
                        "built: %s", e)
        return False
    return True


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def _build() -> str:
    """Path of the compiled kernels, compiling them first if this cache has none (written under a
    temporary name, then renamed, so concurrent processes never load a partial file)."""
    compiler = os.environ.get("CXX", "c++")
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}"]
    source = b""
    for path in (HEADER, *SOURCES):
        with open(path, "rb") as f:
            source += f.read()
    key = hashlib.sha256(source + repr((compiler, flags, jax.__version__, platform.machine(), _cpu_id())).encode())
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl_scaling")
    path = os.path.join(cache, f"cpu_kernels-{key.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        out = subprocess.run([compiler, *flags, *SOURCES, "-o", partial], capture_output=True, text=True)
    except OSError as e:
        os.remove(partial)
        raise RuntimeError(f"{compiler}: {e}") from e
    if out.returncode:
        os.remove(partial)
        raise RuntimeError(f"{compiler} exited with {out.returncode}: {out.stderr.strip()[-400:]}")
    os.replace(partial, path)
    return path
