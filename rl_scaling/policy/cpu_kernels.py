"""The CPU decode backend: a decode step's attention and matmuls on XLA:CPU as custom calls (the
AVX-512 kernels in decode_attention.cc and decode_matmul.cc, sharing cpu_kernels.h).

The one entry point is `decoding(cfg, params)`, a context manager that the sampler enters while it
traces a sampling call (rollout/sampler.py imports this module optionally: without it every
backend decodes with the model's own XLA code, the same tokens). Inside it, on a CPU backend,
`flax.linen.intercept_methods` replaces the model's named methods with the kernels:

- `Attention.attend` of a decode step (one float32 query per row, head_dim a multiple of 16):
  XLA:CPU runs it as B*K tiny batched matmuls and a few softmax fusions; the kernel does each
  (row, kv head) in one pass, rows split over XLA's threads.
- `Attention.project_qkv`, `Attention.project_out`, `SwiGLU.__call__` and `Decoder.head` of calls
  of up to MAX_PANEL_ROWS rows, float32 weights: the kernel reads the weights as contiguous
  32-column panels, laid out once per sampling call from `params` (one kernel pass over the
  stacked weights); SwiGLU's silu(gate) * up is computed in the same pass.
- jax's unrolled threefry lowering on CPU (`_unrolled_threefry_on_cpu`), from the first decode on.

The model's modules know nothing of this module; training never enters it. Speed history:
docs/benchmarks.md.

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

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from rl_scaling.policy import mlp, model as model_lib

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, name) for name in ("decode_attention.cc", "decode_matmul.cc"))
HEADER = os.path.join(_HERE, "cpu_kernels.h")
TARGETS = {"RlScalingDecodeAttention": "rl_scaling_decode_attention",
           "RlScalingPanelMatmul": "rl_scaling_panel_matmul", "RlScalingPanelSwiglu": "rl_scaling_panel_swiglu",
           "RlScalingPanelLayout": "rl_scaling_panel_layout"}
ATTENTION, MATMUL, SWIGLU, LAYOUT = TARGETS.values()
ENV_SWITCH = "RL_SCALING_CPU_KERNELS"
PANEL = 32  # columns per weight panel (decode_matmul.cc)
# Rows up to which the panel kernel runs: XLA's own (YNN) blocking is no faster at 256 and 1024 rows
# (a prefill of 64 prompts of 16 tokens); beyond, unmeasured, XLA's matmul.
MAX_PANEL_ROWS = 1024


def attention_applies(q_BTKGH, k_BKSH, v_BKSH, dtype) -> bool:
    """Whether a call's attention can run as the kernel: one float32 query per row on a CPU
    backend, head_dim a multiple of 16, and the kernels built."""
    return (q_BTKGH.shape[1] == 1 and q_BTKGH.shape[-1] % 16 == 0 and jnp.dtype(dtype) == jnp.float32
            and all(x.dtype == jnp.float32 for x in (q_BTKGH, k_BKSH, v_BKSH))
            and jax.default_backend() == "cpu" and available())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def decode_attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference):
    """`reference(q_BTKGH, k_BKSH, v_BKSH, mask_BTS)` (model._attend_cached, T = 1) computed
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
    second. On XLA:CPU one pass of the kernel (faster than XLA's transposes: docs/benchmarks.md);
    elsewhere `_panels_reference`."""
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


def decode_panels(params, cfg: model_lib.ModelConfig):
    """The projection, SwiGLU and LM head weights of `params` (stacked, as trained) laid out as
    panels, once per sampling call: {"layers": ({"attn": {"qkv", "o"}, "mlp": {"gate_up", "down"}},
    ...), "lm_head": ...}, each entry only where its columns fill whole panels. None where the
    panel kernels do not apply: another backend, no kernels, a dtype other than float32."""
    if not (jax.default_backend() == "cpu" and cfg.dtype == cfg.param_dtype == "float32" and available()):
        return None
    stacked, L, D = params["layers"], cfg.n_layers, cfg.d_model
    qkv_LDN = [stacked["attn"][n]["kernel"].reshape(L, D, -1) for n in ("q", "k", "v")]
    o_LND = stacked["attn"]["o"]["kernel"].reshape(L, -1, D)
    dense = stacked.get("mlp")

    def fits(*ws, width=PANEL):  # the sources' columns fill whole panels
        return sum(w.shape[-1] for w in ws) % width == 0

    layers = []
    for i in range(L):
        layer = {}
        if fits(*qkv_LDN) and fits(o_LND):
            layer["attn"] = {"qkv": panels(qkv_LDN, i), "o": panels([o_LND], i)}
        if dense is not None and fits(dense["gate"]["kernel"], width=PANEL // 2) and fits(dense["down"]["kernel"]):
            layer["mlp"] = {"gate_up": panels([dense["gate"]["kernel"], dense["up"]["kernel"]], i, interleave=True),
                            "down": panels([dense["down"]["kernel"]], i)}
        layers.append(layer)
    out = {"layers": tuple(layers)}
    head_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    if fits(head_DV):
        out["lm_head"] = panels([head_DV[None]], 0)
    return out


@contextlib.contextmanager
def decoding(cfg: model_lib.ModelConfig, params=None):
    """While tracing a sampling call: the decode steps' attention, and with `params` (stacked, as
    trained; their panels are laid out here, once) the matmuls, run as the kernels on XLA:CPU.
    Enter it inside the jitted function, around the prefill and the decode loop. Elsewhere (another
    backend, RL_SCALING_CPU_KERNELS=0, no compiler) it changes nothing but the threefry lowering."""
    if jax.default_backend() != "cpu":
        yield
        return
    _unrolled_threefry_on_cpu()
    if not available():
        yield
        return
    with nn.intercept_methods(_Interceptor(cfg, None if params is None else decode_panels(params, cfg))):
        yield


class _Interceptor:
    """Replaces the model's named methods (model.Attention.project_qkv, attend, project_out,
    mlp.SwiGLU.__call__, model.Decoder.head) with the kernels where they apply, else calls them.
    Decoding runs the layers one by one as `Block`s with a Python layer index; the interceptor
    notes it to pick that layer's panels."""

    def __init__(self, cfg, decode_panels_):
        self.cfg, self.panels, self.layer = cfg, decode_panels_, None

    def __call__(self, next_fun, args, kwargs, context):
        module, name = context.module, context.method_name
        if isinstance(module, model_lib.Block) and name == "__call__":
            layer_idx = args[1] if len(args) > 1 else kwargs.get("layer_idx")
            outer, self.layer = self.layer, layer_idx if isinstance(layer_idx, int) else None
            try:
                return next_fun(*args, **kwargs)
            finally:
                self.layer = outer
        handler = self._HANDLERS.get((type(module), name))
        out = handler(self, module, *args, **kwargs) if handler is not None and not kwargs else None
        return next_fun(*args, **kwargs) if out is None else out

    def _layer_panels(self, part, module):
        if self.panels is None or self.layer is None:
            return None
        return self.panels["layers"][self.layer].get(part)

    def _attend(self, module, q_BTKGH, k_BKSH, v_BKSH, mask_BTS):
        dtype = mlp.DTYPES[self.cfg.dtype]
        if module.query_offset is not None or not attention_applies(q_BTKGH, k_BKSH, v_BKSH, dtype):
            return None
        reference = functools.partial(model_lib._attend_cached, dtype=dtype)
        return jax.lax.platform_dependent(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, default=reference,
                                          cpu=lambda *args: decode_attention(*args, reference))

    def _project_qkv(self, module, x_BTD):
        p = self._layer_panels("attn", module)
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        if p is None or not _rows_fit(x_MD):
            return None
        w = module.variables["params"]
        kernels_DN = [w[name]["kernel"].reshape(D, -1) for name in ("q", "k", "v")]
        qkv_MN = matmul(x_MD, p["qkv"], lambda x: jnp.concatenate([x @ k for k in kernels_DN], -1))
        n_q, n_k = kernels_DN[0].shape[1], kernels_DN[1].shape[1]
        return tuple(y.reshape(B, T, -1, self.cfg.head_dim) for y in jnp.split(qkv_MN, [n_q, n_q + n_k], -1))

    def _project_out(self, module, out_BTNH):
        p = self._layer_panels("attn", module)
        B, T = out_BTNH.shape[:2]
        out_MN = out_BTNH.reshape(B * T, -1)
        if p is None or not _rows_fit(out_MN):
            return None
        kernel_ND = module.variables["params"]["o"]["kernel"].reshape(out_MN.shape[1], self.cfg.d_model)
        return matmul(out_MN, p["o"], lambda x: x @ kernel_ND).reshape(B, T, self.cfg.d_model)

    def _swiglu(self, module, x_BTD):
        # Only the layer's own MLP ("mlp" in Block), not an MoE layer's shared expert.
        p = self._layer_panels("mlp", module) if module.name == "mlp" else None
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        if p is None or not _rows_fit(x_ND):
            return None
        w = {name: module.variables["params"][name]["kernel"] for name in ("gate", "up", "down")}
        h_NF = swiglu(x_ND, p["gate_up"], lambda x: nn.silu(x @ w["gate"]) * (x @ w["up"]))
        out_ND = matmul(h_NF, p["down"], lambda h: h @ w["down"])
        return out_ND.reshape(x_BTD.shape[:-1] + (self.cfg.d_model,))

    def _head(self, module, x_BTD, kernel_DV):
        head = None if self.panels is None else self.panels.get("lm_head")
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        if head is None or not _rows_fit(x_MD):
            return None
        logits_MV = matmul(x_MD, head, lambda x: model_lib.lm_head(x, kernel_DV, self.cfg))
        return logits_MV.reshape(B, T, -1)

    _HANDLERS = {(model_lib.Attention, "attend"): _attend, (model_lib.Attention, "project_qkv"): _project_qkv,
                 (model_lib.Attention, "project_out"): _project_out, (mlp.SwiGLU, "__call__"): _swiglu,
                 (model_lib.Decoder, "head"): _head}


def _rows_fit(x_MK) -> bool:
    return x_MK.ndim == 2 and x_MK.shape[0] <= MAX_PANEL_ROWS and x_MK.dtype == jnp.float32


def matmul(x_MK, panels_PKC, reference):
    """x_MK @ w (`reference(x_MK)`, XLA's) with w as `panels`; the kernel on XLA:CPU."""
    return _on_cpu(MATMUL, panels_PKC.shape[0] * PANEL, x_MK, panels_PKC, reference)


def swiglu(x_MK, panels_PKC, reference):
    """silu(x_MK @ gate) * (x_MK @ up) with the weights as `panels((gate, up), interleave=True)`."""
    return _on_cpu(SWIGLU, panels_PKC.shape[0] * PANEL // 2, x_MK, panels_PKC, reference)


def _on_cpu(target, N, x_MK, panels_PKC, reference):
    # Not differentiable: only decoding (`decoding`, sampler.sample) lays out panels, and it never is.
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
    cpu = _cpu_id()
    if "flags" in cpu and "avx512f" not in cpu.split():  # x86 Linux: the kernels are AVX-512 intrinsics
        raise RuntimeError("this CPU has no AVX-512 (avx512f), the kernels' instruction set")
    source = b""
    for path in (HEADER, *SOURCES):
        with open(path, "rb") as f:
            source += f.read()
    key = hashlib.sha256(source + repr((compiler, flags, jax.__version__, platform.machine(), cpu)).encode())
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


# ---- the sampler's random draw -------------------------------------------------------------------

@functools.cache
def _unrolled_threefry_on_cpu():
    """XLA:CPU gets jax's threefry hash as a rolled 5-iteration loop (smaller code); each decode
    step's Gumbel noise then pays that loop's per-iteration overhead (docs/benchmarks.md). The unrolled lowering (jax's own, used on other platforms) computes the same
    bits, so sampled tokens do not change. It is a private jax rule (jax._src), so it lives here,
    with the rest of the CPU decode path, and is registered the first time `decoding` runs on a
    CPU backend (for every later CPU lowering in the process; other jax layouts keep theirs)."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32
    except ImportError:  # another jax layout: keep its default
        return
    rule = getattr(threefry2x32, "_threefry2x32_lowering_rule", None)
    if rule is not None:
        mlir.register_lowering(threefry2x32.threefry2x32_p, rule, platform="cpu")
