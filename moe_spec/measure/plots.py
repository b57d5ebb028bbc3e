"""The profile's figures, as PNG files (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from moe_spec.measure.sweep import LatencySweep  # noqa: E402
from moe_spec.profile.cost_model import CostModel, predict_sample  # noqa: E402
from moe_spec.profile.unique_curve import UniqueExpertsCurve  # noqa: E402


def plot_unique_experts(curve: UniqueExpertsCurve, num_experts: int, path: Path) -> None:
    """Mean over layers; a size no real tree reached is left out of the real line."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(curve.sizes, curve.real.mean(axis=1), "o-", label="real draft trees (best-first prefix)")
    ax.plot(curve.sizes, curve.random.mean(axis=1), "s--", label="random tokens")
    ax.axhline(num_experts, color="grey", lw=0.8, ls=":", label=f"all {num_experts} experts")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verified tokens T")
    ax.set_ylabel("unique experts per layer (mean)")
    ax.legend(fontsize=8)
    ax.set_title("Unique experts vs tokens")
    _save(fig, path)


def plot_latency_heatmap(sweep: LatencySweep, path: Path) -> None:
    """The grid passes: verify ms over T and the U forced in every layer."""
    points = [(p.num_tokens, p.unique_experts[0] if p.unique_experts else 0, p.ms(sweep.statistic)) for p in sweep.of_kind("grid")]
    tokens = sorted({t for t, _, _ in points})
    experts = sorted({u for _, u, _ in points})
    grid = np.full((len(experts), len(tokens)), np.nan)
    for t, u, ms in points:
        grid[experts.index(u), tokens.index(t)] = ms
    fig, ax = plt.subplots(figsize=(5, 3.5))
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yticks(range(len(experts)), [str(u) for u in experts])
    for (row, col), value in np.ndenumerate(grid):
        if np.isfinite(value):
            ax.text(col, row, f"{value:.1f}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xlabel("verified tokens T")
    ax.set_ylabel("unique experts per layer U (forced)")
    fig.colorbar(image, ax=ax, label=f"verify ms ({sweep.statistic} of repeats)")
    ax.set_title("Verify latency")
    _save(fig, path)


def plot_residuals(model: CostModel, sweep: LatencySweep, path: Path) -> None:
    """Relative error of `model` on the passes it was fitted on and on the held-out ones."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    series = (
        (sweep.fit_samples(), "fitted on", "o"),
        (sweep.samples("natural", "heldout"), "held-out natural trees", "x"),
        (sweep.samples("batched", "heldout"), "held-out batched passes", "+"),
    )
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
