"""Eval-to-eval noise: one checkpoint evaluated again and again on the run's fixed held-out prompts.

    python launch/eval_noise.py RUN [RUN ...] [--repeats=8] [--out=noise.json]

For each run workdir (local or gs://), the newest checkpoint's policy is evaluated --repeats
times exactly as the trainer evaluates it (same prompts, samples per prompt, temperature), each
time with a fresh sampling key. What differs between repeats is only the sampling, so their
spread is the noise of one eval point of a fitted curve. Reported per run, and pooled:
  sd_measured   standard deviation of the repeats' pass rates (ddof 1)
  sd_binomial   the prediction from the per-prompt pass rates p_i of the pooled repeats:
                sqrt(sum_i p_i (1 - p_i) / s) / n (n prompts, s samples each)
  stderr_logged the `eval/pass_rate_stderr` the trainer logs: over the prompt population, so it
                also counts which prompts were drawn, and is larger than the fixed-set noise
launch/fit.py reads noise.json (--noise) next to the seed-to-seed spread it measures itself.
"""

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="training workdirs (each with config.json and checkpoints/)")
    ap.add_argument("--repeats", type=int, default=8, help="evaluations of each checkpoint")
    ap.add_argument("--out", default="", help="write the result as JSON here (local or gs://)")
    args = ap.parse_args(argv)
    if args.repeats < 2:
        ap.error("--repeats must be >= 2 (a spread needs two evaluations)")
    return args


def noise_stats(rewards_RNS):
    """The noise figures from R repeated evaluations' [R, n, s] rewards (pure numpy)."""
    R, n, s = rewards_RNS.shape
    rates = rewards_RNS.mean(axis=(1, 2))
    p_i = rewards_RNS.mean(axis=(0, 2))  # each prompt's pass rate over every repeat's samples
    return {"repeats": int(R), "n_prompts": int(n), "samples_per_prompt": int(s),
            "pass_rates": [float(v) for v in rates], "mean": float(rates.mean()),
            "sd_measured": float(rates.std(ddof=1)),
            "sd_binomial": float(np.sqrt(np.sum(p_i * (1 - p_i) / s)) / n)}


def measure(workdir, repeats):
    import jax
    import ml_collections

    from rl_scaling import checkpoint, evaluate, paths

    config = ml_collections.ConfigDict(json.loads(paths.read_text(paths.join(workdir, "config.json"))))
    mesh, task, gen_cfg, problems, abstract = evaluate.from_workdir_config(config)
    found = checkpoint.Checkpoints(paths.join(workdir, "checkpoints")).restore_latest(abstract)
    if found is None:
        raise SystemExit(f"{workdir}: no checkpoint to evaluate")
    step, state, _ = found
    base = jax.random.key(10_000 + config.seed)  # keys the trainer's evals (seed + 1) never use
    kw = dict(samples_per_prompt=config.eval.samples_per_prompt, batch_size=config.eval.batch_size,
              max_prompt_len=config.task.max_prompt_len, max_new_tokens=config.rollout.max_new_tokens,
              temperature=config.rollout.temperature)  # exactly the trainer's evals
    rewards = np.stack([evaluate.prompt_rewards(state["params"], gen_cfg, task, problems,
                                                rng=jax.random.fold_in(base, r), **kw) for r in range(repeats)])
    out = {"workdir": workdir, "step": int(step), **noise_stats(rewards)}
    logged = [json.loads(line) for line in paths.read_text(paths.join(workdir, "metrics.jsonl")).splitlines()
              if line.strip() and "eval/pass_rate_stderr" in line]
    out["stderr_logged"] = float(logged[-1]["eval/pass_rate_stderr"]) if logged else None
    return out


def main(argv=None):
    args = parse_args(argv)
    from rl_scaling import paths

    runs = [measure(paths.resolve(w), args.repeats) for w in args.runs]
    sd2 = [r["sd_measured"] ** 2 for r in runs]
    result = {"runs": runs, "sd_measured_pooled": float(np.sqrt(np.mean(sd2))),
              "sd_binomial_pooled": float(np.sqrt(np.mean([r["sd_binomial"] ** 2 for r in runs])))}
    for r in runs:
        print(f"{r['workdir']} step {r['step']}: pass rate {r['mean']:.4f} over {r['repeats']} evals of "
              f"{r['n_prompts']} x {r['samples_per_prompt']}: sd {r['sd_measured']:.4f} (binomial "
              f"{r['sd_binomial']:.4f}; the logged prompt-population stderr {r['stderr_logged'] or float('nan'):.4f})")
    print(f"pooled eval-to-eval sd {result['sd_measured_pooled']:.4f} (binomial {result['sd_binomial_pooled']:.4f})")
    if args.out:
        paths.write_text(paths.resolve(args.out), json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
