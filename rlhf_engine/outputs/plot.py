"""`<output_dir>/metrics.png`: score, KL, response length, the policy term, the actor's whole loss and the value loss
against the iteration, read back from metrics.jsonl. Uses matplotlib's object API with the Agg canvas, so the
process-wide backend is never changed and no display is needed."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .metrics import read_metrics

PLOT_KEYS = ("objective/score", "objective/kl", "rollout/response_length", "policy/loss", "actor/loss", "value/loss")


def plot_metrics(metrics_path: str, png_path: Optional[str] = None, keys: Sequence[str] = PLOT_KEYS,
                 title: str = "") -> Optional[str]:
    """Plot `keys` vs `iteration` from `metrics_path` (a metrics.jsonl or its folder) into `png_path` (default:
    metrics.png beside it). Returns the PNG path, or None when there is no record to plot. A key no record holds
    gets an empty panel saying so. The file is written to a temporary name first, then renamed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder = metrics_path if os.path.isdir(metrics_path) else os.path.dirname(metrics_path)
    if not os.path.exists(metrics_path if not os.path.isdir(metrics_path) else
                          os.path.join(metrics_path, "metrics.jsonl")):
        return None
    records = [r for r in read_metrics(metrics_path) if isinstance(r.get("iteration"), (int, float))]
    if not records:
        return None
    png_path = png_path or os.path.join(folder, "metrics.png")
    cols = 3
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        pts = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))
               and not isinstance(r.get(key), bool)]
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 50 else None, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[len(keys):]:
        ax.set_axis_off()
    fig.suptitle(title or os.path.basename(os.path.abspath(folder)), fontsize=11)
    # fixed margins, room for 10-character tick labels at this size: tight_layout measured every text (about 40% of
    # the plot's time, and a run's plot is drawn at its end on the critical path of short runs and the tests)
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.08 if rows > 1 else 0.15, top=0.88 if rows > 1 else 0.8,
                        wspace=0.3, hspace=0.5)
    tmp = png_path + ".tmp"
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)
    return png_path
