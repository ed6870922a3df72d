"""Figures: one run's fit with its band, asymptotes across recipes, recipes x compute budgets.

Built on matplotlib.figure.Figure (no pyplot, no global backend switch), so they render headless
(Agg) in the CLI and inline in a notebook. Each function returns the figure and saves it when given a path.
"""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from rl_scaling.scaling import compare, law

AXIS_LABELS = {"flops": "compute (FLOPs)", "accel_hours": "compute (accelerator-hours)", "steps": "training steps",
               "gpu_hours": "compute (GPU-hours)"}


def _save(fig, path):
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def _label(result):
    return AXIS_LABELS.get(result.runs[0].axis if result.runs else "", "compute")


def plot_fit(result, path=None, extend=2.0, log_x=False):
    """Points (window filled, outside hollow), the fitted law over the window, its extrapolation to
    `extend` x the window's end, the 95% band, the asymptote, and the fit-early-predict-late curve."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    s = result.summary()
    for r in result.runs:
        inside = (r.compute >= result.c.min()) & (r.compute <= result.c.max())
        lbl = f"seed {r.seed}" if r.seed is not None else r.name
        pts = ax.scatter(r.compute[inside], r.pass_rate[inside], s=14, label=f"{lbl} (fitted)", zorder=3)
        ax.scatter(r.compute[~inside], r.pass_rate[~inside], s=14, facecolors="none",
                   edgecolors=pts.get_facecolor(), label=f"{lbl} (not fitted)", zorder=3)
    c_top = max(result.c.max() * extend, max(r.compute.max() for r in result.runs))
    cc = np.geomspace(result.c.min() / 10, c_top, 300) if log_x else np.linspace(0, c_top, 300)
    pred, (blo, bhi), _ = result.predict(cc)
    ax.fill_between(cc, blo, bhi, color="C0", alpha=0.2, lw=0, label=f"{s['level']:.0%} band")
    fitted = cc <= result.c.max()
    ax.plot(cc[fitted], pred[fitted], "C0-", lw=2, label="fit")
    ax.plot(cc[~fitted], pred[~fitted], "C0--", lw=2, label="extrapolation")
    ex = s.get("extrapolation", {})
    if ex.get("status") == "ok":
        early = law.sigmoid(cc, ex["A_early"], ex["B_early"], ex["C_mid_early"], result.fit.R0)
        ax.plot(cc, early, "C3:", lw=1.5, label=f"fit up to {ex['fit_until']:.3g}")
        ax.axvline(ex["fit_until"], color="C3", lw=0.8, alpha=0.5)
    if result.identifiable:
        ax.axhline(result.fit.A, color="k", lw=0.8, ls="-.", label=f"A = {result.fit.A:.3f}")
        title = (f"{result.name}: A={result.fit.A:.3f} [{s['ci']['A'][0]:.3f}, {s['ci']['A'][1]:.3f}]  "
                 f"B={result.fit.B:.2f}  C_mid={result.fit.C_mid:.3g}")
    else:
        ax.axhline(s["A_lower_bound"], color="k", lw=0.8, ls="-.", label=f"A >= {s['A_lower_bound']:.3f}")
        title = f"{result.name}: A >= {s['A_lower_bound']:.3f} (not identifiable)  B={result.fit.B:.2f}"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(_label(result))
    ax.set_ylabel("held-out pass rate")
    if log_x:
        ax.set_xscale("log")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def plot_asymptotes(results, path=None, c_top=None):
    """Every recipe's fitted curve to c_top with its asymptote (dashed: a lower bound only)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    c_top = c_top or 2 * max(r.c.max() for r in results)
    cc = np.linspace(0, c_top, 300)
    for i, r in enumerate(results):
        col = f"C{i % 10}"
        s = r.summary()
        a = r.fit.A if r.identifiable else s["A_lower_bound"]
        lbl = f"{r.name}: A={a:.3f}" if r.identifiable else f"{r.name}: A>={a:.3f}"
        ax.plot(cc, r.fit.predict(cc), color=col, lw=2, label=f"{lbl}, B={r.fit.B:.2f}")
        ax.axhline(a, color=col, lw=0.8, ls="--" if not r.identifiable else ":")
        ax.scatter(r.c, r.y, s=6, color=col, alpha=0.4)
    ax.set_xlabel(_label(results[0]))
    ax.set_ylabel("held-out pass rate")
    ax.set_title("asymptotes across recipes", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def plot_heatmap(results, budgets, path=None):
    """Predicted pass rate, recipes x compute budgets, with the 95% band in each cell; '*' marks budgets
    beyond a recipe's data. Cells beyond the data of a recipe whose A is not measured are hidden
    (grey, 'A?'): there the prediction only extrapolates an unknown ceiling."""
    budgets = np.asarray(budgets, dtype=float)
    table, lo, hi, shown = compare.budget_bands(results, budgets)
    masked = np.ma.masked_array(table, mask=~shown)
    fig = Figure(figsize=(1.2 + 1.2 * budgets.size, 0.8 + 0.6 * len(results)))
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    im = ax.imshow(masked, cmap=cmap, aspect="auto")
    mid = masked.mean() if shown.any() else 0.0
    for i, r in enumerate(results):
        for j, b in enumerate(budgets):
            if not shown[i, j]:
                ax.text(j, i, "A?", ha="center", va="center", fontsize=8, color="0.3")
                continue
            mark = "*" if b > r.c.max() else ""
            ax.text(j, i, f"{table[i, j]:.2f}{mark}\n[{lo[i, j]:.2f}, {hi[i, j]:.2f}]", ha="center", va="center",
                    fontsize=7, color="white" if table[i, j] < mid else "black")
    ax.set_xticks(range(budgets.size), [f"{b:.3g}" for b in budgets], fontsize=8)
    ax.set_yticks(range(len(results)), [r.name for r in results], fontsize=8)
    ax.set_xlabel(_label(results[0]) + "   (* extrapolated; [95% band]; A?: hidden, A not measured)")
    fig.colorbar(im, ax=ax, label="predicted pass rate")
    return _save(fig, path)
