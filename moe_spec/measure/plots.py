"""The profile's figures, as PNG files (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from moe_spec.profile.cost_model import CostModel, CostSample, predict_sample  # noqa: E402


def plot_unique_experts(sizes, real_mean, random_mean, num_experts: int, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(sizes, real_mean, "o-", label="real draft trees (best-first prefix)")
    ax.plot(sizes, random_mean, "s--", label="random tokens")
    ax.axhline(num_experts, color="grey", lw=0.8, ls=":", label=f"all {num_experts} experts")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verified tokens T")
    ax.set_ylabel("unique experts per layer (mean)")
    ax.legend(fontsize=8)
    ax.set_title("Unique experts vs tokens")
    _save(fig, path)


def plot_latency_heatmap(points: list[dict], path: Path, statistic: str = "min") -> None:
    tokens = sorted({p["T"] for p in points})
    experts = sorted({p["U"] for p in points})
    grid = np.full((len(experts), len(tokens)), np.nan)
    for p in points:
        grid[experts.index(p["U"]), tokens.index(p["T"])] = p["ms"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yticks(range(len(experts)), [str(u) for u in experts])
    for (row, col), value in np.ndenumerate(grid):
        if np.isfinite(value):
            ax.text(col, row, f"{value:.1f}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xlabel("verified tokens T")
    ax.set_ylabel("unique experts per layer U (forced)")
    fig.colorbar(image, ax=ax, label=f"verify ms ({statistic} of repeats)")
    ax.set_title("Verify latency")
    _save(fig, path)


def plot_residuals(
    model: CostModel, fitted: list[CostSample], held_out: list[CostSample], held_out_batched: list[CostSample], path: Path
) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    series = ((fitted, "fitted on", "o"), (held_out, "held-out natural trees", "x"), (held_out_batched, "held-out batched passes", "+"))
    for samples, label, marker in series:
        if samples:
            measured = np.array([s.ms for s in samples])
            predicted = np.array([predict_sample(model, s) for s in samples])
            ax.scatter(measured, (predicted - measured) / measured * 100, marker=marker, s=14, label=label)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("measured verify ms")
    ax.set_ylabel("prediction error (%)")
    ax.legend(fontsize=8)
    ax.set_title("Cost model residuals")
    _save(fig, path)


def plot_expert_load(load_share: np.ndarray, path: Path) -> None:
    """load_share: [L, E] share of each layer's routings per expert."""
    num_layers, num_experts = load_share.shape
    fig, ax = plt.subplots(figsize=(6, 0.4 * num_layers + 1.5))
    image = ax.imshow(load_share * num_experts, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=ax, label="load / mean load")
    ax.set_title("Per-layer expert load")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
