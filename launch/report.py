"""Every number of README's "The law on the tiny task", generated from the shipped results.

    python launch/report.py [--results=notebooks/results] [--write-readme]

Reads only what `make results` shipped (fit*/fit.json, noise.json, sweep*.json, extension*.json,
the runs' metrics.jsonl) and refits nothing, so it is fast and its output is fixed by the data.
`--write-readme` replaces the block between the README's `<!-- law-report -->` markers with it;
tests/test_report.py checks the README holds exactly this text, so the prose and the data cannot drift.

One function per part of the block, in the order `report()` joins them: recipe_section, gain_section and
noise_section (the recipe sweep); extension_section (the frozen 4x extension); then the size axis:
sizes_section (s, m, l at lr 3e-4), size_long_section (each continuation to 3,072k, LONG_CHECKS),
size_lr_section (l at lr 1e-4), size_confirmation (a fresh-seed ceiling check, CEILING_CHECKS),
size_one_lr_section and size_fresh_s_section (the sizes' plateaus at lr 1e-4); last ablation_section.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os

import numpy as np

from rl_scaling.scaling import diagnostics, law

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BEGIN, END = "<!-- law-report -->", "<!-- /law-report -->"
RECIPES = ("scalerl", "minimax", "dapo", "grpo", "magistral")


def _why_unidentified(rec):
    """The fit's reasons for not reporting A (fit.json's messages after the headline), in short."""
    reasons = [m for m in rec["messages"][1:] if not m.startswith("lack_of_fit")]
    return ", ".join(r.split(":")[0] for r in reasons) or "see fit.json"


def _load(results, name):
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _ci(v):
    return f"[{v[0]:.3f}, {v[1]:.3f}]"


def _a(s):
    if s["A"] is not None:
        return f"{s['A']:.3f} {_ci(s['ci']['A'])}"
    why = ", ".join(f["code"] for f in s["flags"] if f["code"] in ("not_identifiable", "still_rising", "not_sigmoidal"))
    return f">= {s['A_lower_bound']:.3f} ({why})"


def _flags(s):
    return ", ".join(sorted({f["code"] for f in s["flags"]})) or "-"


def _samples_compute(metrics_path, samples):
    """Compute (FLOPs) a run had spent when it reached `samples` generated samples."""
    s, c = [], []
    with open(metrics_path) as f:
        for line in f:
            r = json.loads(line)
            if "samples" in r and "compute_flops" in r:
                s.append(r["samples"])
                c.append(r["compute_flops"])
    return float(np.interp(samples, s, c))


def recipe_section(results, fit):
    lines = ["Recipes, 3 seeds each at 768k samples (`comparison.md`; seeds fitted together, 95% bootstrap "
             "intervals, each recipe's bootstrap on its own random stream; `lack_of_fit` against the measured "
             "eval noise):", "",
             "| recipe | sigmoid A | B | C_mid (FLOPs) | power-law A | AIC prefers | held-out half prefers | flags |",
             "|---|---|---|---|---|---|---|---|"]
    recs = fit["recipes"]
    for name in RECIPES:
        s = recs[name]
        sh = s["shape"]
        pw = sh["power_law"]
        lines.append(f"| {name} | {_a(s)} | {s['B']:.2f} [{s['ci']['B'][0]:.2f}, {s['ci']['B'][1]:.2f}] | "
                     f"{s['C_mid']:.3g} | {pw['A']:.3f} {_ci(pw['ci_A'])} | {sh['preferred_by_aic']} | "
                     f"{sh['preferred_by_heldout']} | {_flags(s)} |")
    n_pw = sum(recs[n]["shape"]["preferred_by_aic"] == "power_law" for n in RECIPES)
    n_dep = sum(recs[n]["shape"]["A_depends_on_shape"] for n in RECIPES)
    ratios = [recs[n]["diagnostics"]["noise"]["ratio"] for n in RECIPES]
    lines += ["", f"- Shape: AIC prefers the power law for {n_pw} of {len(RECIPES)} recipes, and for {n_dep} of "
                  f"{len(RECIPES)} the two shapes' ceilings differ by more than the sigmoid's own half-interval. "
                  "On these windows the curve's shape is not identified, so a ceiling is a statement about the "
                  "sigmoid, not about the data (the extension below tests both)."]
    lines.append(f"- Residuals around each seed's own fit are {min(ratios):.1f}-{max(ratios):.1f}x the measured "
                 f"eval noise (sd {fit['noise']['eval_sd_measured']:.4f}): every recipe has `lack_of_fit`. "
                 "The curves wiggle from step to step by more than eval sampling explains.")
    for n in RECIPES:
        tail = recs[n]["diagnostics"].get("tail", {})
        if any(f["code"] == "still_rising" for f in recs[n]["flags"]):
            lines.append(f"- {n} is still rising: over the last quarter of its compute the residuals climb "
                         f"{tail['climb']:.3f} ({tail['z']:.1f} standard errors above the fit's flattening), so its "
                         f"A is reported as a lower bound.")
    pairs = fit["comparison"]["pairs"]
    decided = [p for p in pairs if p["winner"] != "undecided"]
    lines.append(f"- Pairs decided: {len(decided)} of {len(pairs)}"
                 + ("" if not decided else ": " + "; ".join(
                     f"{p['winner']} over {p['b'] if p['winner'] == p['a'] else p['a']} (P = "
                     f"{max(p['p_A_greater'], 1 - p['p_A_greater']):.2f}, "
                     f"{'holds' if p['holds_under_both_shapes'] else 'does not hold'} as power laws)" for p in decided))
                 + ". " + (fit["comparison"].get("ranking_note", "") or ""))
    return lines


def gain_section(results, fit):
    out = []
    for name in RECIPES:
        s = fit["recipes"][name]
        comps = [_samples_compute(os.path.join(results, name, f"seed{k}", "metrics.jsonl"), 256000) for k in range(3)]
        frac = law.gain_fraction(np.mean(comps), s["B"], s["C_mid"])
        out.append(f"{name} {float(frac):.0%}")
    return [f"- At 256k samples (the old default budget) the fitted curves had reached {', '.join(out)} of their "
            "gain A - R0 (point estimates): too little for A to be measured, hence 768k."]


def noise_section(fit):
    nz = fit["noise"]
    return [f"- Noise: one checkpoint evaluated 8 times on the fixed prompt set varies by sd "
            f"{nz['eval_sd_measured']:.4f} (binomial prediction {nz['eval_sd_binomial']:.4f}; `noise.json`). The "
            f"seeds' plateaus vary by sd {nz['seed_sd']:.4f} ({nz['seed_df']} df), a margin on A of "
            f"{nz['margin_from_seeds']:.3f} with 3 seeds; the comparisons use {nz['margin_used']:.2f} "
            f"({nz['margin_source']})."]


def extension_section(results):
    ext = _load(results, "extension.json")
    if ext is None:
        return ["Out of sample: `preregistered.json` is committed; the extension runs have not finished, so "
                "there is no `extension.json` yet."]
    lines = [f"Out of sample (`preregistered.json`, frozen before the extension runs; `extension.md`): ScaleRL, "
             f"DAPO and MiniMax x 3 seeds rerun from the shipped warm start to {ext['samples']:,} samples, each "
             "seed's eval at 2x, 3x and 4x its recipe's shipped compute against the frozen 95% intervals:", "",
             "| shape | one-seed intervals covering | seed-mean intervals covering | mean abs error of the seed mean |",
             "|---|---|---|---|"]
    for shape, t in ext["coverage"].items():
        lines.append(f"| {shape} | {t['seed_covered']}/{t['seed_scored']} | {t['mean_covered']}/{t['mean_scored']} | "
                     f"{t['mean_abs_error']:.3f} |")
    sig, pw = ext["coverage"]["sigmoid"], ext["coverage"]["power_law"]
    better = "power law" if pw["mean_abs_error"] < sig["mean_abs_error"] else "sigmoid"
    lines += ["", f"- The {better} predicted the seed means better (mean abs error {pw['mean_abs_error']:.3f} power law, "
                  f"{sig['mean_abs_error']:.3f} sigmoid); a well calibrated 95% interval covers about 26 of 27 seeds "
                  "and 9 of 9 means. Per recipe and multiple: `extension.md`.",
              "- The extension runs are reruns of the shipped configurations and seeds from the same warm start, "
              "not continuations (no checkpoints were shipped, and the CPU kernels changed since, so their first "
              "768k samples are not bit-identical to the shipped runs): they test the predictions on fresh "
              "trajectories of the same recipes."]
    return lines


SIZE_LABELS = {"scalerl": "s", "scalerl+size=m": "m", "scalerl+size=l": "l"}
SIZE_RUNS = {"s": "scalerl", "m": "sizes/m/scalerl+size=m", "l": "sizes/l/scalerl+size=l"}  # seed<k> below


def _seed_metrics(results, run_dir):
    """The metrics.jsonl path of each shipped seed of a run directory."""
    return sorted(glob.glob(os.path.join(results, run_dir, "seed*", "metrics.jsonl")))


def _samples(results, size, runs=SIZE_RUNS):
    """Generated samples at the last eval of each seed of `size` (its budget), from the shipped metrics."""
    seen = set()
    for path in _seed_metrics(results, runs[size]):
        with open(path) as f:
            last = [json.loads(ln) for ln in f if '"eval/pass_rate"' in ln][-1]
        seen.add(int(last["samples"]))
    return max(seen) if seen else 0


def _k(n):
    return f"{n / 1000:,.0f}k"


def _crossover(small, large, c_lo, c_hi):
    """Smallest compute in [c_lo, c_hi] (log grid) from which the larger policy's fitted curve stays above
    the smaller's, or None."""
    c = np.geomspace(c_lo, c_hi, 2000)
    ahead = (law.sigmoid(c, large["A_fit"], large["B"], large["C_mid"], large["R0"])
             > law.sigmoid(c, small["A_fit"], small["B"], small["C_mid"], small["R0"]))
    if not ahead[-1]:
        return None
    behind = np.flatnonzero(~ahead)
    return float(c[behind[-1] + 1]) if behind.size else float(c[0])


def _size_table(results, recs, runs=SIZE_RUNS):
    from configs import tiny

    lines = ["| size | parameters | samples | sigmoid A | B | C_mid (FLOPs) | power-law A | window (FLOPs) | flags |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size in sorted(recs, key="sml".index):
        s = recs[size]
        lines.append(f"| {size} | {tiny.param_count(size):,} | {_k(_samples(results, size, runs))} | {_a(s)} | "
                     f"{s['B']:.2f} | {s['C_mid']:.3g} | {s['shape']['power_law']['A']:.3f} | "
                     f"{s['window']['c_min']:.3g}-{s['window']['c_max']:.3g} | {_flags(s)} |")
    return lines + [""]


def _size_pairs(recs):
    """Each size against each smaller one: ceilings, and where the larger curve passes."""
    lines = []
    for small, large in itertools.combinations(sorted(recs, key="sml".index), 2):
        a, b = recs[small], recs[large]
        top = max(a["window"]["c_max"], b["window"]["c_max"])
        cross = _crossover(a, b, 1e10, 100 * top)
        sep = b["ci"]["A"][0] > a["ci"]["A"][1] or a["ci"]["A"][0] > b["ci"]["A"][1]
        lines.append(f"- {large} against {small}: fitted ceilings {b['A_fit']:.3f} vs {a['A_fit']:.3f} "
                     f"({'intervals apart' if sep else 'intervals overlap'}); "
                     + (f"the {large} curve stays above the {small} curve from {cross:.3g} FLOPs on"
                        f"{' (beyond the data)' if cross > top else ''}." if cross is not None else
                        f"the {large} curve does not pass the {small} curve below {100 * top:.3g} FLOPs."))
    return lines


def _unmeasured(recs):
    """{size: why} for the sizes whose ceiling the fit did not measure: no A (the fit's reasons), or an A
    that a blocking flag (diagnostics.BLOCKING) makes unusable."""
    out = {}
    for z, r in recs.items():
        blocked = [f["code"] for f in r["flags"] if f["code"] in diagnostics.BLOCKING]
        if r["A"] is None:
            out[z] = _why_unidentified(r)
        elif blocked:
            out[z] = ", ".join(blocked)
    return out


def _reasons(unmeasured):
    return "; ".join(f"{z}: {w}" for z, w in unmeasured.items())


def _size_recs(fit, labels=SIZE_LABELS):
    return {labels[k]: v for k, v in fit["recipes"].items() if k in labels and v.get("status", "ok") == "ok"}


def sizes_section(results):
    fs = _load(results, "fit_sizes/fit.json")
    if fs is None:
        return ["Model size: the runs of `make results-sizes` have not been fitted yet (no `fit_sizes/fit.json`)."]
    recs = _size_recs(fs)
    lines = ["Model size (`fit_sizes/`, ScaleRL, 2 seeds per size, each size from its own warm start to the same "
             "0.15 pass rate; size s is the recipe table's ScaleRL seeds 0 and 1; each window drops the first 1.5/16 "
             "of its own compute):", ""] + _size_table(results, recs)
    unmeasured = _unmeasured(recs)
    if unmeasured:
        lines.append(f"- The ceilings of size(s) {', '.join(unmeasured)} are not identifiable with this window rule "
                     f"({_reasons(unmeasured)}). "
                     "`make results-sizes SIZE_SAMPLES=N` extends finished runs from their last checkpoints; the shipped "
                     "runs keep none, so it reruns them from their warm starts once their "
                     "`sizes/<size>/scalerl+size=<size>` runs are moved away.")
    lines += _size_pairs(recs)
    same = _load(results, "fit_sizes_start/fit.json")
    if same is None:
        return lines
    recs = _size_recs(same)
    starts = {r["window"].get("start_samples") for r in recs.values()}
    if len(starts) != 1 or None in starts:
        raise SystemExit(f"fit_sizes_start/fit.json: the sizes' windows start at {starts} samples, not at one count")
    start = int(starts.pop())
    lines += ["", f"The same sizes with one window start (`fit_sizes_start/`, `--start-samples={start}`): every "
              f"run's window from its first eval after {_k(start)} samples, s's default start, instead of "
              "1.5/16 of each size's own compute, as the paper starts every run's window after the same 1.5k "
              "GPU-hours however long the run. This rule was chosen after the one above left a ceiling unidentified: "
              "read it as a sensitivity check, not a pre-registered result.", ""] + _size_table(results, recs)
    unmeasured = _unmeasured(recs)
    if unmeasured:
        lines.append(f"- Still not identifiable: {', '.join(unmeasured)} ({_reasons(unmeasured)}).")
    return lines + _size_pairs(recs) + size_confirmation(results, *CEILING_CHECKS[0])


CEILING_CHECKS = (  # fresh seeds of size l fitted from s's window start: (pre-registration, scored file, make target,
    # what running it costs)
    ("preregistered_sizes.json", "sizes_confirmation", "results-sizes-confirm", "2 seeds, ~2 h on 2 cores"),
    ("preregistered_l_lr_fresh.json", "sizes_lr_confirmation", "results-sizes-lr-confirm",
     "2 seeds to 3,072k samples, ~260 min on 2 cores, resumable"),
)


def size_confirmation(results, prereg, scored, target, cost):
    """A pre-registered check of the same-start fit on fresh seeds: frozen, and scored once run."""
    pre = _load(results, prereg)
    if pre is None:
        return []
    seeds = ", ".join(pre["fitted"]["seeds"])
    said = (f"- Pre-registered (`{prereg}`, frozen before the runs that test it): fresh seeds of "
            f"{pre['recipe']} (not {seeds}), fitted from {_k(pre['start_samples'])} samples, will show an identifiable "
            f"ceiling in [{pre['band'][0]:.3f}, {pre['band'][1]:.3f}] whose interval reaches down to "
            f"{pre['reference']['recipe']}'s upper end {pre['reference']['ci'][1]:.3f} or below.")
    done = _load(results, f"{scored}.json")
    if done is None:
        return [said + f" Not scored yet: `make {target}` ({cost})."]
    held = done["held"]
    a = f"A {done['A']:.3f}" if done["A"] is not None else f"A >= {done['A_lower_bound']:.3f}"
    return [said + f" Scored in `{scored}.md`: {sum(held.values())} of {len(held)} claims held "
            f"({a} [{done['ci'][0]:.3f}, {done['ci'][1]:.3f}]"
            + (f"; flags {', '.join(done['flags'])}" if done["flags"] else "") + "; "
            + ", ".join(f"{k} {'held' if v else 'failed'}" for k, v in held.items()) + ")."]


def _jitter(results, run_dir):
    """Per seed of a run directory: diagnostics.plateau_jitter (second-half spread, keep_frac)."""
    out = []
    for path in _seed_metrics(results, run_dir):
        with open(path) as f:
            out.append(diagnostics.plateau_jitter([json.loads(ln) for ln in f]))
    return out


LONG_CHECKS = (  # size l's runs continued out of sample: (pre-registration, scored extension, size-table fit,
    # the sweep directory of the continued runs, what they are, their make target)
    ("preregistered_l_long.json", "extension_l", "fit_sizes_long", "sizes/l_long", "Size l", "results-sizes-long"),
    ("preregistered_l_lr_long.json", "extension_l_lr", "fit_sizes_lr_long", "sizes/l_lr_long", "Size l at lr 1e-4",
     "results-sizes-lr-long"),
)


def size_long_section(results, prereg, extension, fit_dir, sweep_dir, what, target):
    """Size l's runs continued to 2x their budget: the predictions frozen from the shorter runs against
    what the continuation showed, and the default-window fit over the whole longer runs."""
    pre = _load(results, prereg)
    if pre is None:
        return []
    (name, rec), = pre["recipes"].items()
    long_dir = f"{sweep_dir}/{name}"
    source = os.path.relpath(pre["source"], os.path.relpath(results, ROOT))
    said = (f"{what} out of sample (`{prereg}`, frozen before the continuation; `{extension}.md`): `{name}`'s seeds "
            f"{', '.join(rec['seeds'])} as first run (`{source}`), fitted by both shapes to predict their pass rate at "
            f"{' and '.join(f'{m:g}x' for m in pre['multiples'])} that compute; the same runs then continued from their "
            f"last checkpoints (`{sweep_dir}`, one curve each, `make {target}`).")
    done = _load(results, f"{extension}.json")
    if done is None or not any(t["mean_scored"] for t in done["coverage"].values()):
        return ["", said + " Not run to the predicted compute yet."]
    lines = ["", said, "",
             "| shape | x | predicted | 95% PI of one seed | observed seeds | 95% PI of the seed mean | seed mean | covered |",
             "|---|---|---|---|---|---|---|---|"]
    for r in done["rows"]:
        obs = ", ".join(f"{o:.3f}" for o in r["observed"]) or "not reached"
        mean = "" if r["mean"] is None else f"{r['mean']:.3f}"
        cov = "" if r["mean"] is None else ("yes" if r["pi_mean"][0] <= r["mean"] <= r["pi_mean"][1] else "no")
        lines.append(f"| {r['shape']} | {r['multiple']:g} | {r['predicted']:.3f} | {_ci(r['pi_seed'])} | {obs} | "
                     f"{_ci(r['pi_mean'])} | {mean} | {cov} |")
    lines.append("")
    for shape, t in done["coverage"].items():
        err = ", ".join(f"{e:+.3f}" for e in t["errors"])
        lines.append(f"- {shape}: one-seed intervals cover {t['seed_covered']}/{t['seed_scored']}, seed-mean "
                     f"intervals {t['mean_covered']}/{t['mean_scored']}; seed mean minus prediction {err}.")
    fit = _load(results, f"{fit_dir}/fit.json")
    if fit is None:
        return lines
    recs = _size_recs(fit, {**SIZE_LABELS, name: "l"})
    lines += ["", f"The size table again with l's continued runs at {_k(done['samples'])} samples (`{fit_dir}/`, "
              "every window the default, the first 1.5/16 of each size's own compute dropped; s and m as above):", ""]
    lines += _size_table(results, recs, {**SIZE_RUNS, "l": long_dir})
    unmeasured = _unmeasured(recs)
    if unmeasured:
        lines.append(f"- Ceiling not measured: {', '.join(unmeasured)} ({_reasons(unmeasured)}).")
    noise = _load(results, "noise.json")
    spread = {z: _jitter(results, d) for z, d in (("s", "scalerl"), ("m", SIZE_RUNS["m"]), ("l seeds 0-1", SIZE_RUNS["l"]),
                                                    (f"{what.lower()} continued (seeds {'-'.join(rec['seeds'])})", long_dir))}
    lines.append("- Over each run's second half, per seed: the checkpoint-to-checkpoint spread of the held-out pass "
                 "rate (sd of successive evals' differences / sqrt 2) and the fraction of samples the zero-variance "
                 "filter kept for the update: "
                 + "; ".join(f"{z} " + ", ".join(f"{j:.4f} ({k:.3f})" for j, k in vs) for z, vs in spread.items())
                 + f". One checkpoint evaluated repeatedly varies by {noise['sd_measured_pooled']:.4f} (`noise.json`).")
    return lines + _size_pairs(recs)


def size_lr_section(results):
    """Size l at a smaller RL step: the claims frozen before the runs, scored, and the size table with l
    at that step (s and m as shipped)."""
    pre = _load(results, "preregistered_l_lr.json")
    if pre is None:
        return []
    lr_dir = f"sizes/l_lr/{pre['recipe']}"
    said = (f"Size l at a smaller RL step (`preregistered_l_lr.json`, frozen before the runs; `sizes_lr.md`, "
            f"`make results-sizes-lr`): `{pre['recipe']}`, l's seeds 0 and 1 again from l's warm start, the RL "
            "learning rate 1e-4 instead of the 3e-4 every size shares.")
    done = _load(results, "sizes_lr.json")
    if done is None:
        return ["", said + " Not run to its budget yet."]
    lines = ["", said, "", "| frozen claim | observed | held |", "|---|---|---|"]
    observed = {"steadier": "second-half spread " + ", ".join(f"{v:.4f}" for v in done["spread"].values())
                            + " (at 3e-4: " + ", ".join(f"{v:.4f}" for v in pre["baseline_spread"].values()) + ")",
                "identifiable": ", ".join(c for c in done["flags"] if c in diagnostics.BLOCKING) or "no blocking flag",
                "overlaps_s": (f"A {done['A']:.3f}" if done["A"] is not None else f"A >= {done['A_lower_bound']:.3f}")
                              + f" {_ci(done['ci'])} vs s {_ci(pre['reference']['ci'])}"}
    lines += [f"| {k}: {pre['claims'][k]} | {observed[k]} | {'yes' if done['held'][k] else 'no'} |" for k in pre["claims"]]
    lines += ["", f"{sum(done['held'].values())} of {len(done['held'])} claims held; zero-variance filter kept "
              + ", ".join(f"{v:.3f}" for v in done["keep_frac"].values()) + " of the samples over the second halves."]
    fit = _load(results, "fit_sizes_lr/fit.json")
    if fit is None:
        return lines
    recs = _size_recs(fit, {**SIZE_LABELS, pre["recipe"]: "l"})
    lines += ["", "The size table with l at lr 1e-4 (`fit_sizes_lr/`, every window the default; s and m as above, "
              "lr 3e-4):", ""]
    lines += _size_table(results, recs, {**SIZE_RUNS, "l": lr_dir})
    unmeasured = _unmeasured(recs)
    if unmeasured:
        lines.append(f"- Ceiling not measured: {', '.join(unmeasured)} ({_reasons(unmeasured)}).")
    return lines + _size_pairs(recs)


def size_one_lr_section(results):
    """Policy size at one learning rate: the frozen test of the sizes' plateaus at lr 1e-4, scored once
    s and m have run, and the three sizes fitted from one window start."""
    pre = _load(results, "preregistered_sizes_lr.json")
    if pre is None:
        return []
    ref = pre["reference"]
    said = (f"Policy size at one learning rate (`preregistered_sizes_lr.json`, frozen before s and m ran at it; "
            f"`sizes_one_lr.md`, `make results-sizes-one-lr`): s and m at l's rate 1e-4, 2 seeds each from their "
            f"warm starts to {_k(pre['samples'])} samples, against l's plateaus there ("
            + ", ".join(f"{v:.3f}" for v in ref["plateaus"].values()) + f", `{ref['runs']}`). Rule: {pre['rule']}.")
    done = _load(results, "sizes_one_lr.json")
    if done is None:
        return ["", said + " Not run yet (~100 min on 2 cores, resumable)."]
    lines = ["", said, "", "| size | plateau per seed | seed mean |", "|---|---|---|"]
    lines += [f"| {z} | " + ", ".join(f"{x:.3f}" for x in p.values()) + f" | {np.mean(list(p.values())):.3f} |"
              for z, p in sorted(done["plateaus"].items(), key=lambda kv: "sml".index(kv[0]))]
    lines += ["", f"Pooled within-size sd {done['sd']:.4f} ({done['df']} df); "
              + "; ".join(f"{k.replace('_above_', ' above ')}: {'held' if v else 'not shown'}" for k, v in done["held"].items())
              + f" ({sum(done['held'].values())} of {len(done['held'])} claims held)."]
    ref_dir = os.path.relpath(ref["runs"], os.path.relpath(results, ROOT))  # ref["runs"] is from the repository root
    runs = {z: f"sizes/sm_lr/{label}" for z, label in pre["sizes"].items()} | {ref["size"]: f"{ref_dir}/{ref['recipe']}"}
    spread = {z: _jitter(results, d) for z, d in runs.items()}
    if all(spread.values()):
        lines.append("- Second-half checkpoint-to-checkpoint spread per seed (as above), at lr 1e-4: "
                     + "; ".join(f"{z} " + ", ".join(f"{j:.4f}" for j, _ in vs) for z, vs in spread.items()) + ".")
    fit = _load(results, "fit_sizes_one_lr/fit.json")
    if fit is None:
        return lines
    labels = {label: z for z, label in pre["sizes"].items()} | {ref["recipe"]: ref["size"]}
    recs = _size_recs(fit, labels)
    lines += ["", "The three sizes at lr 1e-4 fitted from one window start (`fit_sizes_one_lr/`, "
              f"{_k(fit['recipes'][ref['recipe']]['window']['start_samples'])} samples; descriptive, not a frozen "
              "claim):", ""]
    lines += _size_table(results, recs, runs)
    unmeasured = _unmeasured(recs)
    if unmeasured:
        lines.append(f"- Ceiling not measured: {', '.join(unmeasured)} ({_reasons(unmeasured)}).")
    return lines + _size_pairs(recs)


def size_fresh_s_section(results):
    """l against s at lr 1e-4 on s seeds that had not run: the frozen plateaus of l's four seeds and, once
    scored, s's fresh plateaus and the t-test's verdict."""
    pre = _load(results, "preregistered_s_lr_fresh.json")
    if pre is None:
        return []
    ref = pre["reference"]
    said = ("l against s at lr 1e-4 on fresh s seeds (`preregistered_s_lr_fresh.json`, frozen before s's seeds 2 and 3 "
            "ran; `sizes_s_fresh.md`, `make results-sizes-s-fresh`): the test above pooled m's seeds into every pair's "
            f"sd; this one asks only whether l's plateau at 1e-4 (seeds {', '.join(ref['plateaus'])}: "
            + ", ".join(f"{v:.3f}" for v in ref["plateaus"].values()) + ") is above s's, on s seeds that had not "
            f"run, to {_k(pre['samples'])} samples, with the sd pooled over l's and s's seeds.")
    done = _load(results, "sizes_s_fresh.json")
    if done is None:
        return ["", said + " Not run yet (~30 min on 2 cores, resumable)."]
    s = done["plateaus"]["s"]
    return ["", said + " s's fresh plateaus: " + ", ".join(f"seed {k} {x:.3f}" for k, x in s.items())
            + f"; pooled sd {done['sd']:.4f} ({done['df']} df); l above s: {done['observed']['l_above_s']}, "
            + ("held." if done["held"]["l_above_s"] else "not shown.")]


ABLATIONS = (  # (comparison name, reference label, caption)
    ("loo", "scalerl", "Leave-one-out (`comparison_loo.md`, 2 seeds each; ScaleRL's seeds 0 and 1 are the reference)"),
    ("batch", "scalerl", "Batch size (`comparison_batch.md`, prompts per update at the same budget, 2 seeds each)"),
    ("fp32", "scalerl+model.dtype=bfloat16", "FP32 heads (`comparison_fp32.md`, bfloat16 body, 2 seeds each; the "
     "reference has FP32 LM heads in the trainer and the generator)"),
    ("prune", "scalerl", "Pruning on real runs (`comparison_prune.md`, `--prune`, 2 seeds each)"),
)


def _rho_first_mb(results, label):
    """Mean over a label's seeds of the logged mean abs(rho - 1) on the first minibatch."""
    vals = []
    for k in range(2):
        path = os.path.join(results, label, f"seed{k}", "metrics.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            v = [json.loads(line).get("rho_abs_dev_first_mb") for line in f]
        v = [x for x in v if x is not None]
        if v:
            vals.append(np.mean(v))
    return float(np.mean(vals)) if vals else None


def ablation_section(results, name, ref, caption):
    fit = _load(results, f"fit_{name}/fit.json")
    if fit is None:
        return []
    pairs = {frozenset((p["a"], p["b"])): p for p in fit.get("comparison", {}).get("pairs", [])}
    rho = name == "fp32"
    lines = [caption + ":", "", "| spec | A | B | power-law A | flags | P(A_ref > A) | pair |"
             + (" mean abs(rho-1), first minibatch |" if rho else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if rho else "")]
    for label, s in fit["recipes"].items():
        if s.get("status", "ok") != "ok":
            continue
        p = pairs.get(frozenset((ref, label)))
        prob = "-" if p is None else f"{p['p_A_greater'] if p['a'] == ref else 1 - p['p_A_greater']:.2f}"
        pw = s.get("shape", {}).get("power_law", {})
        row = (f"| `{label}` | {_a(s)} | {s['B']:.2f} | {pw.get('A', float('nan')):.3f} | {_flags(s)} | {prob} | "
               f"{'-' if p is None else p['winner']} |")
        if rho:
            r = _rho_first_mb(results, label)
            row += f" {'-' if r is None else f'{r:.1e}'} |"
        lines.append(row)
    note = fit.get("comparison", {}).get("ranking_note")
    if note:
        lines += ["", f"{note[0].upper()}{note[1:]}."]
    if name == "prune":
        sw = _load(results, "sweep_prune.json") or {}
        for label, why in sw.get("pruned", {}).items():
            lines.append(f"Pruned `{label}`: {why['reason']}.")
        cs = sw.get("compute_saved")
        if cs:
            lines.append(f"Pruning left {cs['saved_frac']:.0%} of the planned compute unspent "
                         f"({cs['saved_flops']:.3g} of {cs['planned_flops']:.3g} FLOPs).")
    return lines + [""]


def report(results):
    fit = _load(results, "fit/fit.json")
    lines = [BEGIN, ""]
    lines += recipe_section(results, fit)
    lines += gain_section(results, fit)
    lines += noise_section(fit)
    lines += ["", *extension_section(results), "", *sizes_section(results), *size_long_section(results, *LONG_CHECKS[0]),
              *size_lr_section(results), *size_long_section(results, *LONG_CHECKS[1]),
              "", *size_confirmation(results, *CEILING_CHECKS[1]),
              *size_one_lr_section(results), *size_fresh_s_section(results), ""]
    for name, ref, caption in ABLATIONS:
        lines += ablation_section(results, name, ref, caption)
    lines += [END]
    return "\n".join(lines) + "\n"


def write_readme(text, readme):
    with open(readme) as f:
        old = f.read()
    if BEGIN not in old or END not in old:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} block to replace")
    head, rest = old.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(readme, "w") as f:
        f.write(head + text.rstrip("\n") + tail)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(ROOT, "notebooks", "results"))
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args(argv)
    text = report(args.results)
    if args.write_readme:
        write_readme(text, os.path.join(ROOT, "README.md"))
    print(text, end="")


if __name__ == "__main__":
    main()
