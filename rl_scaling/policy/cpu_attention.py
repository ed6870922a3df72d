"""A decode step's attention on XLA:CPU as one custom call (decode_attention.cc).

XLA:CPU runs a decode step's attention as B*K tiny batched matmuls and a few softmax fusions;
the kernel does each (row, kv head) in one pass, rows split over XLA's threads. At the RL
step's generation shapes (256 rows, 64 new tokens) it takes a third off the tiny preset's
generation time and a fifth off the small preset's (launch/bench.py presets).

The source is compiled on first use with the host's C++ compiler ($CXX, else c++) for this CPU
(-march=native) into $XDG_CACHE_HOME/rl_scaling (default ~/.cache/rl_scaling), keyed by the
source, the compiler flags, jaxlib and the CPU. Where it cannot be built (no compiler, a CPU
without AVX-512, another architecture) one warning says why and `model._attend` keeps XLA's
attention, as it does for other dtypes, head dims that are not a multiple of 16, and TPU and
GPU lowerings. RL_SCALING_CPU_KERNELS=0 turns the kernel off.

Its output matches XLA's to float32 rounding (tests/test_cpu_attention.py). Differentiating
through it (a one-token training call) runs the backward pass of XLA's attention.
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

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_attention.cc")
TARGET = "rl_scaling_decode_attention"
ENV_SWITCH = "RL_SCALING_CPU_KERNELS"


def applies(q_BTKGH, k_BKSH, v_BKSH, dtype) -> bool:
    """Whether a call's attention can run as the kernel: one float32 query per row on a CPU
    backend, head_dim a multiple of 16, and the kernel built."""
    return (q_BTKGH.shape[1] == 1 and q_BTKGH.shape[-1] % 16 == 0 and jnp.dtype(dtype) == jnp.float32
            and all(x.dtype == jnp.float32 for x in (q_BTKGH, k_BKSH, v_BKSH))
            and jax.default_backend() == "cpu" and available())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def decode_attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference):
    """`reference(q_BTKGH, k_BKSH, v_BKSH, mask_BTS)` (model._attend's XLA path, T = 1) computed
    by the kernel; the backward pass is the reference's."""
    B, _, K, G, H = q_BTKGH.shape
    out_BKGH = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, K, G, H), jnp.float32), vmap_method="sequential")(
        q_BTKGH[:, 0], k_BKSH, v_BKSH, mask_BTS[:, 0], scale=np.float32(H ** -0.5))
    return out_BKGH[:, None]


def _forward(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference):
    return decode_attention(q_BTKGH, k_BKSH, v_BKSH, mask_BTS, reference), (q_BTKGH, k_BKSH, v_BKSH, mask_BTS)


def _backward(reference, saved, grad):
    q_BTKGH, k_BKSH, v_BKSH, mask_BTS = saved
    _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, mask_BTS), q_BTKGH, k_BKSH, v_BKSH)
    return (*vjp(grad), None)


decode_attention.defvjp(_forward, _backward)


@functools.cache
def available() -> bool:
    """Build (once per source, compiler and CPU) and register the kernel; False, with one warning
    saying why, where it cannot be built or RL_SCALING_CPU_KERNELS=0."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(_build())
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.RlScalingDecodeAttention), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        logging.warning("rl_scaling: XLA's attention runs decode steps; the CPU kernel could not be built: %s", e)
        return False
    return True


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def _build() -> str:
    """Path of the compiled kernel, compiling it first if this cache has none (written under a
    temporary name, then renamed, so concurrent processes never load a partial file)."""
    compiler = os.environ.get("CXX", "c++")
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}"]
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + repr((compiler, flags, jax.__version__, platform.machine(), _cpu_id())).encode())
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rl_scaling")
    path = os.path.join(cache, f"decode_attention-{key.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        out = subprocess.run([compiler, *flags, SOURCE, "-o", partial], capture_output=True, text=True)
    except OSError as e:
        os.remove(partial)
        raise RuntimeError(f"{compiler}: {e}") from e
    if out.returncode:
        os.remove(partial)
        raise RuntimeError(f"{compiler} exited with {out.returncode}: {out.stderr.strip()[-400:]}")
    os.replace(partial, path)
    return path
