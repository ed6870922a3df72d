"""Side by side with google-tunix on CPU: alternating processes, medians and per-pair ratios.

    python launch/bench_tunix.py [--rounds=5] [--presets=tiny,small] [--cases=sampler,rl]

Per preset and case, `--rounds` times: one `launch/bench.py --presets=P --cases=C` process, then the
tunix peer's (`../shared/peers`: `tunix_sampler.py`, `tunix_grpo.py --beta 0`, run with
/tmp/peers/tunix-venv/bin/python; `bash ../shared/peers/setup.sh` builds it) at the shapes our JSON line
reports (sampler: batch, prompt length, new tokens; rl: prompts, group, prompt length, new tokens), both
on 2 threads. Prints one JSON line per case (medians, the ratio of medians, each pair's ratio, ours /
tunix) and a summary table. `make bench-peers` runs it (~20 min on a quiet 2-core machine).
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "..", "..", "shared", "peers")
TUNIX_PYTHON = "/tmp/peers/tunix-venv/bin/python"
OURS_KEY = {"sampler": "tok_s_median", "rl": "samples_s_median"}


def _last_json(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def tunix_command(preset, case, ours, reps, warmup):
    """The peer's command at the shapes our process reported in its JSON line `ours`."""
    shape = [f"--preset={preset}", f"--prompt_len={ours['prompt_len']}", f"--new_tokens={ours['new_tokens']}",
             "--threads=2"]
    if case == "sampler":
        return [TUNIX_PYTHON, os.path.join(PEERS, "tunix_sampler.py"), *shape, f"--batch={ours['batch']}",
                f"--reps={reps}", f"--warmup={warmup}"]
    steps = ["--steps=3"] if preset == "small" else []  # ~10 s a tunix step at small
    return [TUNIX_PYTHON, os.path.join(PEERS, "tunix_grpo.py"), *shape, f"--prompts={ours['prompts']}",
            f"--group={ours['group']}", "--beta=0", *steps]


def vs_tunix(presets, cases, rounds, reps, warmup):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    summary = []
    for name in presets:
        for case in cases:
            ours, theirs = [], []
            for r in range(rounds):
                mine = _last_json([sys.executable, os.path.join(HERE, "bench.py"), f"--presets={name}",
                                   f"--cases={case}", f"--reps={reps}", f"--warmup={warmup}"], env)
                ours.append(mine[OURS_KEY[case]])
                theirs.append(_last_json(tunix_command(name, case, mine, reps, warmup), env)[OURS_KEY[case]])
                print(f"round {r + 1} {case} {name}: ours {ours[-1]:.1f}, tunix {theirs[-1]:.1f}, "
                      f"ratio {ours[-1] / theirs[-1]:.2f}", file=sys.stderr, flush=True)
            pairs = [a / b for a, b in zip(ours, theirs)]
            res = {"tool": "rl_scaling_vs_tunix", "case": case, "preset": name, "rounds": rounds,
                   "unit": "tok/s" if case == "sampler" else "samples/s",
                   "ours_median": round(float(np.median(ours)), 1), "tunix_median": round(float(np.median(theirs)), 1),
                   "ratio_of_medians": round(float(np.median(ours) / np.median(theirs)), 3),
                   "pair_ratios": [round(p, 3) for p in pairs], "pair_ratio_median": round(float(np.median(pairs)), 3),
                   "ours": [round(x, 1) for x in ours], "tunix": [round(x, 1) for x in theirs]}
            print(json.dumps(res), flush=True)
            summary.append(res)
    print(f"\n{'case':<8} {'preset':<6} {'ours':>10} {'tunix':>10} {'ratio':>6}  per-pair ratios", file=sys.stderr)
    for s in summary:
        print(f"{s['case']:<8} {s['preset']:<6} {s['ours_median']:>10.1f} {s['tunix_median']:>10.1f} "
              f"{s['ratio_of_medians']:>5.2f}x  {s['pair_ratios']}", file=sys.stderr)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small", help="the peers' presets: tiny,small")
    parser.add_argument("--cases", default="sampler,rl", help="sampler,rl")
    parser.add_argument("--rounds", type=int, default=5, help="processes of each side per case")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per process (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (compile)")
    args = parser.parse_args(argv)
    presets, cases = args.presets.split(","), args.cases.split(",")
    bad = [p for p in presets if p not in ("tiny", "small")] + [c for c in cases if c not in OURS_KEY]
    if bad:
        sys.exit(f"--presets/--cases: no tunix peer for {bad}; presets tiny, small; cases sampler, rl")
    vs_tunix(presets, cases, args.rounds, args.reps, args.warmup)


if __name__ == "__main__":
    main()
