"""The PNG plots of ``report.md``: throughput, tau by category, acceptance by draft position, and the
training curves.

Plots are drawn on ``matplotlib.figure.Figure`` objects saved through the Agg canvas: no pyplot, so
no global backend state and no display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from eagle3_ray.bench.report_format import kind_colors, kind_entry, number, result_kinds, train_tokens

TAU_PLOT = "tau_by_category.png"
ACCEPT_PLOT = "accept_by_position.png"
TRAINING_PLOT = "training_curves.png"
THROUGHPUT_PLOT = "throughput.png"
DPI = 120


def write_plots(results: dict[str, Any], out: Path, training: list[dict[str, Any]]) -> None:
    """The report's plots into ``out``; the training curves only with ``training`` rows."""
    _plot_throughput(results, out / THROUGHPUT_PLOT)
    if results.get("per_category"):  # the report shows it only then
        _plot_tau_by_category(results, out / TAU_PLOT)
    _plot_accept_by_position(results, out / ACCEPT_PLOT)
    if training:
        _plot_training(training, out / TRAINING_PLOT, results)


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def _plot_throughput(results: dict[str, Any], path: Path) -> None:
    kinds = ["baseline", *result_kinds(results)]
    tps = [kind_entry(results, k).get("tokens_per_s") or 0.0 for k in kinds]
    fig = Figure(figsize=(7, 3.8))
    ax = fig.add_subplot()
    colors = kind_colors(results)
    bars = ax.bar(kinds, tps, color=[colors[k] for k in kinds])
    for kind, bar in zip(kinds, bars):
        speedup = 1.0 if kind == "baseline" else kind_entry(results, kind).get("speedup")
        ax.annotate(number(speedup, "{:.2f}x"), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel("tokens/s (label: speedup)")
    ax.set_title(f"Decoding throughput on {results.get('device')}")
    ax.margins(y=0.15)
    _save(fig, path)


def _plot_tau_by_category(results: dict[str, Any], path: Path) -> None:
    per_cat = results.get("per_category") or {}
    cats = list(per_cat)
    kinds = [k for k in result_kinds(results) if any((per_cat[c].get(k) or {}).get("tau") is not None for c in cats)]
    fig = Figure(figsize=(max(6.0, 1.1 * len(cats) + 2), 4))
    ax = fig.add_subplot()
    width = 0.8 / max(len(kinds), 1)
    colors = kind_colors(results)
    for i, kind in enumerate(kinds):
        taus = [(per_cat[c].get(kind) or {}).get("tau") or 0.0 for c in cats]
        ax.bar([x + (i - (len(kinds) - 1) / 2) * width for x in range(len(cats))], taus, width, label=kind,
               color=colors[kind])
    ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title("Acceptance length by category")
    ax.margins(y=0.2)  # headroom for the legend row
    if kinds:
        ax.legend(fontsize="small", ncols=len(kinds), loc="upper center")
    _save(fig, path)


def _plot_accept_by_position(results: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(6, 3.8))
    ax = fig.add_subplot()
    colors = kind_colors(results)
    for kind in result_kinds(results):
        curve = kind_entry(results, kind).get("accept_by_position") or []
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=kind, color=colors[kind])
    ax.set_xlabel("draft position i")
    ax.set_ylabel("verify steps accepting ≥ i drafts")
    ax.set_ylim(-0.03, 1.05)  # a curve at 0 (nothing accepted) stays visible
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Acceptance by draft position")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    _save(fig, path)


def _plot_training(rows: list[dict[str, Any]], path: Path, results: dict[str, Any] | None = None) -> None:
    """Loss, simulated tau (train and held-out, with the bench's measured tau per mode as lines) and
    acc_0 against training tokens; against steps for metrics without the token count."""
    by_tokens = all(train_tokens(r) is not None for r in rows)
    xs = [train_tokens(r) if by_tokens else r["step"] for r in rows]
    xlabel = "training tokens" if by_tokens else "step"
    fig = Figure(figsize=(11, 3.4))
    for i, (keys, title) in enumerate(((("loss", "val_loss"), "loss"), (("tau", "val_tau"), "simulated tau"),
                                       (("acc_0", "val_acc_0"), "acc_0 (first draft)"))):
        ax = fig.add_subplot(1, 3, i + 1)
        for key, style, label in zip(keys, ("-", "o--"), ("train", "held-out")):
            points = [(x, r[key]) for x, r in zip(xs, rows) if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", label=label, markersize=4)
        if keys[0] == "tau":
            for j, (mode, tau) in enumerate((results or {}).get("tau", {}).items()):
                if tau is not None:
                    ax.axhline(tau, color=f"C{3 + j}", linewidth=0.9, linestyle=":", label=f"measured {mode}")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    _save(fig, path)
