"""PNG figures of the threshold sweep (matplotlib, Agg backend; files written atomically).

* ``tradeoff_curve``: task metric against the fraction of block applications skipped,
  one point per α_thresh (paper Figs 5–7, below), and both against α_thresh.
* ``halting_heatmap``: for one example, positions × steps shaded by the remaining stick
  ``1 − Σ_{l'<l} α_{l'}`` before step l (paper Fig. 5, above): yellow = still running,
  dark blue = halted. Encoder (source tokens) and decoder (target tokens) panels.
"""
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..data.atomic import atomic_path


def _pyplot():
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq may set DEBUG
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def savefig_atomic(fig, path: str, dpi: int = 120) -> None:
    """Save ``fig`` as PNG to a temporary file beside ``path``, then rename it."""
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")


def remaining_stick(weights: Sequence[Sequence[float]], max_steps: Optional[int] = None) -> np.ndarray:
    """(positions × L) halting weights -> (L × positions) remaining stick before each step:
    row l-1 holds ``1 − Σ_{l' < l} α_{l'}`` (row 0 is 1). The weights put the remainder on
    the last executed step, so the stick is 0 on every step after a position halted."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"weights must be positions × steps; got shape {w.shape}")
    L = max_steps or w.shape[1]
    before = np.concatenate([np.zeros((w.shape[0], 1)), np.cumsum(w, axis=1)[:, : L - 1]], axis=1)
    return np.clip(1.0 - before, 0.0, 1.0).T


def halting_heatmap(panels: List[Dict], path: str, title: str = "") -> List[np.ndarray]:
    """panels: ``{"name": "encoder", "tokens": [...], "weights": positions × L, "steps":
    [executed steps per position] (optional)}`` each.
    Writes one PNG with a panel per entry and a shared colour bar; returns the plotted
    (L × positions) matrices."""
    plt = _pyplot()
    mats = [remaining_stick(p["weights"]) for p in panels]
    widest = max(m.shape[1] for m in mats)
    width = min(40.0, max(6.0, 0.32 * widest + 2.5))
    heights = [max(1.6, 0.32 * m.shape[0] + 1.2) for m in mats]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, sum(heights) + 0.9),
                             gridspec_kw={"height_ratios": heights}, squeeze=False,
                             layout="constrained")
    image = None
    for ax, panel, mat in zip(axes[:, 0], panels, mats):
        L, n = mat.shape
        image = ax.imshow(mat, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                          interpolation="nearest", extent=(-0.5, n - 0.5, 0.5, L + 0.5))
        ax.set_xticks(range(n))
        long_labels = max((len(str(t)) for t in panel["tokens"]), default=0) > 4
        ax.set_xticklabels(panel["tokens"], rotation=90 if long_labels else 0, fontsize=8)
        ax.set_yticks(range(1, L + 1))
        ax.set_ylabel("step l")
        side = panel["name"]
        ax.set_xlabel(f"{side} positions ({'source' if side == 'encoder' else 'target'} tokens)")
        heading = side
        if panel.get("steps") is not None:
            heading += f": {int(sum(panel['steps']))} of {L * n} block applications executed"
        ax.set_title(heading, fontsize=9)
    cbar = fig.colorbar(image, ax=list(axes[:, 0]), fraction=0.03, pad=0.02)
    cbar.set_label(r"remaining stick $1 - \Sigma_{l' < l}\, \alpha_{l'}$  (yellow: running, dark: halted)")
    if title:
        fig.suptitle(title, fontsize=10)
    savefig_atomic(fig, path)
    plt.close(fig)
    return mats


def tradeoff_curve(rows: List[Dict], metric: str, path: str, title: str = "") -> None:
    """rows: ``{"threshold", "skipped", "skipped_encoder", "skipped_decoder", "metric"}``
    (fractions in [0, 1]; metric in its own unit). Left: metric vs % of block applications
    skipped, each point labelled with its α_thresh. Right: both against α_thresh."""
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["threshold"])
    thr = [r["threshold"] for r in rows]
    skipped = [100 * r["skipped"] for r in rows]
    values = [r["metric"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    left.plot(skipped, values, "o-", color="tab:blue")
    for i, (x, y, t) in enumerate(zip(skipped, values, thr)):
        # alternate above/below so that close points (0.99, 0.999) stay readable
        left.annotate(f"{t:g}", (x, y), textcoords="offset points",
                      xytext=(4, 5 if i % 2 else -11), fontsize=8)
    left.set_xlabel("block applications skipped (%, teacher-forced, encoder + decoder)")
    left.set_ylabel(metric)
    left.set_title(r"efficiency vs performance (labels: $\alpha_{thresh}$)", fontsize=10)
    left.grid(alpha=0.3)

    positions = np.arange(len(thr))
    right.plot(positions, [100 * r["skipped_encoder"] for r in rows], "s--", color="tab:green", label="skipped, encoder")
    right.plot(positions, [100 * r["skipped_decoder"] for r in rows], "^--", color="tab:orange", label="skipped, decoder")
    right.plot(positions, skipped, "o-", color="tab:gray", label="skipped, both")
    right.set_xticks(positions)
    right.set_xticklabels([f"{t:g}" for t in thr], rotation=45, fontsize=8)
    right.set_xlabel(r"$\alpha_{thresh}$")
    right.set_ylabel("block applications skipped (%)")
    right.grid(alpha=0.3)
    twin = right.twinx()
    twin.plot(positions, values, "o-", color="tab:blue", label=metric)
    twin.set_ylabel(metric, color="tab:blue")
    lines = right.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="center right",
                 framealpha=0.9)
    right.set_title(r"against $\alpha_{thresh}$", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    savefig_atomic(fig, path)
    plt.close(fig)
