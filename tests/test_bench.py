"""launch/bench.py's backend-neutral cases: the 1b preset at smoke size on CPU prints every field of
every case, and its figures agree with an independent count of the bytes and FLOPs."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "launch", "bench.py")
COMMON = ("tool", "case", "preset", "smoke", "backend", "device", "dtype", "params_matmul", "threads", "reps", "warmup",
          "elapsed_s", "loadavg")
FIELDS = {
    "train": ("train_s_median", "first_call_s", "model_gflop_s", "peak_gflop_s", "peak_dtype", "mfu", "frac_of_peak",
              "computed_frac_of_peak", "model_flops_causal", "model_flops_computed", "shared_prompts", "rows",
              "seq_len", "microbatches"),
    "sampler": ("tok_s_median", "tok_s_min", "tok_s_max", "batch", "prompt_len", "new_tokens", "call_s_median",
                "step_ms", "first_call_s", "weight_bytes", "kv_bytes_read", "copy_gb_s", "roofline_s",
                "roofline_frac"),
    "rl": ("samples_s_median", "samples_s_min", "samples_s_max", "step_s_median", "gen_s", "host_s", "update_s",
           "gen_frac", "update_frac", "gen_tok_s", "first_call_s", "prompts", "group", "prompt_len", "new_tokens",
           "microbatches"),
    "hf": ("batch", "prompt_len", "new_tokens", "ours_tok_s", "settings", "fastest", "hf_tok_s", "ours_vs_hf",
           "ours_vs_hf_by_setting", "attn_implementation", "torch", "transformers", "hf_logprobs"),
}


def _run(*flags, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, BENCH, *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    print("\n".join(json.dumps(ln) for ln in lines))  # every field, in the test log
    return {ln["case"]: ln for ln in lines}


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_fields_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(lines, cases, dims, bytes_per_param):
    assert set(lines) == set(cases)
    for case, line in lines.items():
        missing = [f for f in COMMON + FIELDS[case] if f not in line]
        assert not missing, (case, missing)
        assert all(line[f] is not None for f in FIELDS[case]), case
    L, D, N, K, F, V = dims
    H = D // N
    s = lines["sampler"]
    # Independent counts: every matmul weight of the body and the LM head in the params' dtype, the
    # RMSNorm scales (2 a layer and the final one) in float32.
    assert s["weight_bytes"] == bytes_per_param * (L * (D * H * (2 * N + 2 * K) + 3 * D * F) + D * V) + 4 * (2 * L + 1) * D
    slots = sum(s["prompt_len"] + t + 1 for t in range(s["new_tokens"]))
    assert s["kv_bytes_read"] == s["batch"] * slots * L * 2 * K * H * bytes_per_param
    roofline = (s["new_tokens"] * s["weight_bytes"] + s["kv_bytes_read"]) / (s["copy_gb_s"] * 1e9)
    assert roofline == pytest.approx(s["roofline_s"], rel=1e-2)
    assert s["roofline_frac"] == pytest.approx(roofline / s["call_s_median"], rel=2e-2)
    assert s["tok_s_median"] == pytest.approx(s["batch"] * s["new_tokens"] / s["call_s_median"], rel=2e-2)
    t = lines["train"]
    tokens = t["rows"] * (t["seq_len"] - 1)
    assert 6 * t["params_matmul"] * tokens <= t["model_flops_causal"] <= 9 * t["params_matmul"] * tokens
    assert t["mfu"] == pytest.approx(t["model_flops_causal"] / t["train_s_median"] / (t["peak_gflop_s"] * 1e9), rel=2e-2)
    assert 0 < t["mfu"] < 2 and t["peak_gflop_s"] > 0
    r = lines["rl"]
    assert r["step_s_median"] == pytest.approx(r["gen_s"] + r["host_s"] + r["update_s"], rel=2e-2, abs=1e-3)  # 1 rep
    assert r["samples_s_median"] == pytest.approx(r["prompts"] * r["group"] / r["step_s_median"], rel=2e-2)
    h = lines["hf"]
    assert h["ours_tok_s"] == s["tok_s_median"]
    assert {"dynamic", "static"} <= set(h["settings"]) and h["fastest"] in h["settings"]
    assert h["hf_tok_s"] == max(v["tok_s_median"] for v in h["settings"].values() if "tok_s_median" in v)
    assert h["ours_vs_hf"] == pytest.approx(h["ours_tok_s"] / h["hf_tok_s"], rel=1e-3)


def test_1b_preset_smoke_prints_every_field():
    """`bench.py --preset=1b --smoke --cases=train,sampler,rl,hf` on CPU: the 1b preset's code
    (bfloat16 body and params, float32 head, scanned layers) at smoke size, one JSON line per case."""
    bench = _bench_module()
    lines = _run("--preset=1b", "--smoke", "--cases=train,sampler,rl,hf", "--reps=1", "--warmup=1")
    _check(lines, ("train", "sampler", "rl", "hf"), bench.SMOKE_DIMS, 2)
    assert all(ln["dtype"] == "bfloat16" and ln["backend"] == "cpu" and ln["smoke"] for ln in lines.values())
    assert lines["train"]["peak_dtype"] == "bfloat16"


@pytest.mark.slow
def test_tiny_preset_every_case():
    """The CPU peers' tiny preset (float32, unrolled layers, shared prompts) with every case,
    XLA's cost analysis of the train step included."""
    bench = _bench_module()
    lines = _run("--presets=tiny", "--cases=sampler,rl,train,hf", "--reps=1", "--warmup=1")
    _check(lines, ("train", "sampler", "rl", "hf"), bench.PRESETS["tiny"], 4)
    assert lines["train"]["shared_prompts"] and lines["train"]["xla_flops"] > 0


def test_accelerator_presets_leave_the_backend_to_jax():
    bench = _bench_module()
    assert bench._accelerator_run(["--preset=1b", "--smoke"]) and bench._accelerator_run(["--presets", "tiny,1b"])
    assert not bench._accelerator_run(["--presets=tiny,small"]) and not bench._accelerator_run(["--vs_tunix"])


def test_tunix_peer_runs_at_the_shapes_our_line_reports():
    """launch/bench_tunix.py gives the peer the shapes of our process's JSON line, as flags the peer's
    parser defines (read from its source in ../shared/peers when that folder is there)."""
    import ast

    spec = importlib.util.spec_from_file_location("bench_tunix_under_test", os.path.join(ROOT, "launch", "bench_tunix.py"))
    tunix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tunix)
    sampler = tunix.tunix_command("tiny", "sampler", {"batch": 48, "prompt_len": 12, "new_tokens": 40}, 5, 2)
    rl = tunix.tunix_command("small", "rl", {"prompts": 16, "group": 4, "prompt_len": 12, "new_tokens": 40}, 5, 2)
    assert sampler[1].endswith("tunix_sampler.py") and rl[1].endswith("tunix_grpo.py")
    for flag in ("--batch=48", "--prompt_len=12", "--new_tokens=40", "--preset=tiny", "--threads=2", "--reps=5"):
        assert flag in sampler
    for flag in ("--prompts=16", "--group=4", "--prompt_len=12", "--new_tokens=40", "--beta=0", "--steps=3"):
        assert flag in rl
    for cmd in (sampler, rl):
        if not os.path.exists(cmd[1]):
            continue
        tree = ast.parse(open(cmd[1]).read())
        defined = {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
                   "add_argument" for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        # tunix_*.py add the model dims in a loop (f"--{k}"): those are not used here
        assert {f.split("=")[0] for f in cmd[2:]} <= defined, (cmd[1], sorted(defined))
