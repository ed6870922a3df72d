"""launch/sweep.py's report: each run's eval curve and health averages, the raw
curves figure and the comparison table in markdown."""

from __future__ import annotations

import json
import math
import os

_AXIS_KEY = {"flops": ("compute_flops", 1.0), "accel_hours": ("accel_seconds", 1 / 3600), "steps": ("step", 1.0)}


def run_summary(workdir):
    """Eval curve and training-health averages of one run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    evals = [r for r in rows if "eval/pass_rate" in r]
    train = [r for r in rows if "loss" in r]

    def mean(key):
        vals = [r[key] for r in train if key in r and isinstance(r[key], (int, float))]
        return sum(vals) / len(vals) if vals else math.nan

    return {"evals": evals, "final_pass_rate": evals[-1]["eval/pass_rate"] if evals else math.nan,
            "initial_pass_rate": evals[0]["eval/pass_rate"] if evals else math.nan,
            "steps": train[-1]["step"] if train else 0, "samples": train[-1].get("samples", 0) if train else 0,
            "truncation_rate": mean("truncation_rate"), "interruption_rate": mean("interruption_rate"),
            "rho_abs_dev_first_mb": mean("rho_abs_dev_first_mb"), "keep_frac": mean("keep_frac"),
            "npr_removed": train[-1].get("npr/removed", 0.0) if train else 0.0}


def write_curves(runs_info, axis, path):
    """Held-out pass rate against compute: every seed thin, the recipe's seed mean thick."""
    if not runs_info:
        return
    from matplotlib.figure import Figure

    key, scale = _AXIS_KEY[axis]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    colors = {}
    for r in runs_info:
        c = colors.setdefault(r["label"], f"C{len(colors) % 10}")
        ev = r["metrics"]["evals"]
        ax.plot([e.get(key, 0) * scale for e in ev], [e["eval/pass_rate"] for e in ev], color=c, lw=0.7, alpha=0.5)
    for label, c in colors.items():
        curves = [r["metrics"]["evals"] for r in runs_info if r["label"] == label]
        n = min(len(e) for e in curves)
        xs = [sum(e[i].get(key, 0) for e in curves) / len(curves) * scale for i in range(n)]
        ys = [sum(e[i]["eval/pass_rate"] for e in curves) / len(curves) for i in range(n)]
        ax.plot(xs, ys, color=c, lw=2, label=f"{label} ({len(curves)} seeds)")
    ax.set_xlabel({"flops": "training compute (FLOPs)", "accel_hours": "accelerator-hours", "steps": "steps"}[axis])
    ax.set_ylabel("held-out pass rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _fmt(v, spec=".3f"):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _interval(ci, key, spec):
    if not ci or key not in ci or ci[key] is None:
        return ""
    lo, hi = ci[key]
    return f" [{_fmt(lo, spec)}, {_fmt(hi, spec)}]"


def comparison_markdown(fit, runs_info, failed, record, args, files):
    """The comparison table; files: the basenames of the sweep's "fit", "curves.png" and "sweep.json"."""
    labels = list(dict.fromkeys(r["label"] for r in runs_info))
    lines = ["# Recipe comparison", "",
             f"Config `{args.config}`, recipes `{args.recipes}`, {args.seeds} seed(s), extra `{args.extra or '-'}`; "
             f"fit on the `{args.axis}` axis with `launch/fit.py` (seeds of a recipe fitted together; 95% intervals "
             f"from the bootstrap). The runs took {record['run_wall_s'] / 60:.1f} min in all (this sweep invocation "
             f"{record['wall_s'] / 60:.1f} min, warm start and fit included) on {os.cpu_count()} CPU core(s).", ""]
    recipes = (fit or {}).get("recipes", {})
    lines += ["| recipe | A (ceiling) | B (efficiency) | C_mid | R0 | fit points | half-budget fit: last eval vs 95% PI | note |",
              "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        s = recipes.get(label)
        if s is None or s.get("status", "ok") != "ok":
            msg = (s or {}).get("message", "no fit") if s else "no fit"
            lines.append(f"| {label} | - | - | - | - | - | - | fit failed: {msg} |")
            continue
        ci = s.get("ci", {})
        a = (f"{_fmt(s['A'])}{_interval(ci, 'A', '.3f')}" if s.get("identifiable")
             else f">= {_fmt(s.get('A_lower_bound'))} (fit {_fmt(s.get('A_fit'))}, not identifiable)")
        note = "; ".join(m for m in s.get("messages", [])[:2])
        ex = s.get("extrapolation", {})
        lp = ex.get("last_point") if ex.get("status") == "ok" else None
        held = (f"{lp['observed']:.3f} {'in' if lp['covered'] else 'OUTSIDE'} [{lp['pi'][0]:.3f}, {lp['pi'][1]:.3f}] "
                f"(predicted {lp['predicted']:.3f})" if lp else "-")
        lines.append(f"| {label} | {a} | {_fmt(s['B'], '.2f')}{_interval(ci, 'B', '.2f')} | "
                     f"{_fmt(s['C_mid'], '.3g')}{_interval(ci, 'C_mid', '.3g')} | {_fmt(s.get('R0'))} | "
                     f"{s['window']['n_points']} | {held} | {note} |")
    lines += ["", "The same window read as a power law R = A - D / C^B (its own bootstrap), next to the sigmoid:", "",
              "| recipe | sigmoid A | power-law A | AIC prefers | held-out half prefers | A depends on the shape |",
              "|---|---|---|---|---|---|"]
    for label in labels:
        sh = (recipes.get(label) or {}).get("shape", {})
        if sh.get("status") != "ok":
            continue
        sg, pw = sh["sigmoid"], sh["power_law"]
        lines.append(f"| {label} | {_fmt(sg['A'])} [{_fmt(sg['ci_A'][0])}, {_fmt(sg['ci_A'][1])}] | "
                     f"{_fmt(pw['A'])} [{_fmt(pw['ci_A'][0])}, {_fmt(pw['ci_A'][1])}]{' (at bound)' if pw['A_at_bound'] else ''} | "
                     f"{sh['preferred_by_aic']} | {sh['preferred_by_heldout'] or '-'} | "
                     f"{'yes' if sh['A_depends_on_shape'] else 'no'} ({sh['A_gap']:+.3f}) |")
    lines += ["", "Per run (means over seeds; rates averaged over the training steps):", "",
              "| recipe | seeds | steps | samples | pass rate start -> end | truncation | interruption | "
              "mean abs(rho-1) first mb | kept prompts | NPR removed | wall min/run |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        rs = [r for r in runs_info if r["label"] == label]
        m = [r["metrics"] for r in rs]

        def avg(k, rs=rs, m=m):
            vals = [x[k] for x in m if isinstance(x[k], (int, float)) and math.isfinite(x[k])]
            return sum(vals) / len(vals) if vals else math.nan

        ends = ", ".join(_fmt(x["final_pass_rate"]) for x in m)
        walls = [r.get("wall_s", math.nan) for r in rs if not r.get("skipped")] or [r.get("wall_s", math.nan) for r in rs]
        lines.append(f"| {label} | {len(rs)} | {int(avg('steps'))} | {int(avg('samples'))} | "
                     f"{_fmt(avg('initial_pass_rate'))} -> {_fmt(avg('final_pass_rate'))} ({ends}) | "
                     f"{_fmt(avg('truncation_rate'))} | {_fmt(avg('interruption_rate'))} | "
                     f"{_fmt(avg('rho_abs_dev_first_mb'), '.2e')} | {_fmt(avg('keep_frac'), '.2f')} | "
                     f"{_fmt(avg('npr_removed'), '.0f')} | {_fmt(sum(walls) / len(walls) / 60, '.1f')} |")
    nz = (fit or {}).get("noise")
    if nz:
        parts = []
        if nz.get("seed_sd") is not None:
            parts.append(f"seed-to-seed sd of the plateaus (mean pass rate over the last {nz['plateau_tail']:.0%} of "
                         f"compute) {nz['seed_sd']:.4f} ({nz['seed_df']} df), a margin on A of "
                         f"{nz['margin_from_seeds']:.4f}")
        if nz.get("eval_sd_measured") is not None:
            parts.append(f"eval-to-eval sd of one checkpoint on the fixed prompt set {nz['eval_sd_measured']:.4f} "
                         f"(binomial {nz['eval_sd_binomial']:.4f}; `noise.json`, launch/eval_noise.py)")
        lines += ["", "Noise: " + "; ".join(parts + [f"the comparisons use a margin of {nz['margin_used']:.4f} "
                                                     f"({nz['margin_source']}; the paper's {nz['margin_paper']})"]) + "."]
    cmp_ = (fit or {}).get("comparison")
    if cmp_:
        rank = ("Ranking (the paper's rule: A within the 0.02 margin -> refit with the mean A and compare B): "
                + ", ".join(f"{r['rank']}. {r['name']} ({r['wins']} wins)" for r in cmp_["ranking"])
                if cmp_["ranking"] else "")
        note = f"{cmp_['ranking_note'][0].upper()}{cmp_['ranking_note'][1:]}." if cmp_.get("ranking_note") else ""
        lines += ["", " ".join(filter(None, (rank, note))), ""]
        for p in cmp_["pairs"]:
            warn = f" ({p['warning']})" if p.get("warning") else ""
            pw = p.get("power_law")
            shape = ("" if not pw else f"; as power laws: {pw['winner']} (P = {pw['p_A_greater']:.2f})"
                     + ("" if p.get("holds_under_both_shapes") is None else
                        ", the conclusion holds under both shapes" if p["holds_under_both_shapes"] else
                        ", the conclusion does NOT hold under the power law"))
            lines.append(f"- {p['a']} vs {p['b']}: {p['winner']} ({p['rule']}; P(A_{p['a']} > A_{p['b']}) = "
                         f"{p['p_A_greater']:.2f}{shape}){warn}")
    for label, p in record.get("pruned", {}).items():
        lines += ["", f"Pruned {label} (--prune): {p['reason']}; its unfinished runs stopped, its queued seeds not started."]
    if record.get("compute_saved"):
        cs = record["compute_saved"]
        lines += ["", f"Pruning left {cs['saved_frac']:.0%} of the planned compute unspent "
                      f"({cs['saved_flops']:.3g} of {cs['planned_flops']:.3g} FLOPs)."]
    if failed:
        lines += ["", f"Failed runs (see their run.log): {', '.join(failed)}"]
    fit_dir, curves, sweep_json = files["fit"], files["curves.png"], files["sweep.json"]
    lines += ["", f"Figures: `{curves}` (raw curves), `{fit_dir}/fit_<recipe>.png` (fit, band, extrapolation), "
              f"`{fit_dir}/asymptotes.png`, `{fit_dir}/heatmap.png`; numbers: `{fit_dir}/fit.json`, `{sweep_json}`.", ""]
    return "\n".join(lines)
