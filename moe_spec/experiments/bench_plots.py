"""Figures of a bench report (PNG, matplotlib's Agg backend): where a person would rather look than read."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_bench_plots(report: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [_speedup_by_class(report, folder), _accept_vs_cost(report, folder), _tree_sizes(report, folder)]


def _speedup_by_class(report: dict, folder: Path) -> Path:
    classes = list(report["per_class"])
    methods = [m for m in report["methods"] if not m.startswith("static:")]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(classes), 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [report["per_class"][c].get(method, {}).get("speedup_vs_ar") or 0.0 for c in classes]
        ax.bar([x + i * width for x in range(len(classes))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(classes))], classes)
    ax.set_ylabel("speedup over ar (tokens/s ratio)")
    ax.legend(fontsize=7)
    path = folder / "speedup_by_class.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _accept_vs_cost(report: dict, folder: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 4))
    for method, figures in report["methods"].items():
        if figures["verify_ms"] is None:  # no step statistics (transformers' reference loops)
            continue
        ax.scatter(figures["verify_ms"] + figures["draft_ms"], figures["mean_accept_len"], label=method)
        ax.annotate(method, (figures["verify_ms"] + figures["draft_ms"], figures["mean_accept_len"]), fontsize=7)
    ax.set_xlabel("draft + verify ms per step")
    ax.set_ylabel("mean accepted length (incl. bonus)")
    path = folder / "accept_vs_cost.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tree_sizes(report: dict, folder: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 4))
    for method in report["methods"]:
        sizes = [s for prompt in report["per_prompt"] for s in prompt["methods"].get(method, {}).get("tree_sizes", [])]
        if sizes and method in ("moe-aware", "moe-aware-noexperts", "truncate"):
            ax.hist(sizes, bins=range(0, max(sizes) + 2), alpha=0.5, label=method)
    ax.set_xlabel("drafted nodes verified per step")
    ax.set_ylabel("steps")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    path = folder / "tree_sizes.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
