"""Figures of a simulation report, each titled as a SIMULATION; bounds and oracles dashed."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moe_spec.experiments.replay import BOUNDS  # noqa: E402


def plot_speedup_vs_scale(report: dict, folder: Path) -> list[Path]:
    """One figure per base cost model: simulated speedup over `ar` against the per-expert cost scale."""
    folder.mkdir(parents=True, exist_ok=True)
    by_model: dict[str, list[dict]] = {}
    for result in report["results"]:
        base = result["cost_model"]["source"].split(", per-expert x")[0]
        by_model.setdefault(base, []).append(result)
    written = []
    for number, (base, results) in enumerate(by_model.items()):
        results = sorted(results, key=lambda r: r["per_expert_scale"])
        scales = [r["per_expert_scale"] for r in results]
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in results[0]["policies"]:
            ax.plot(scales, [r["policies"][policy]["speedup_vs_ar"] for r in results], marker="o", label=policy,
                    linestyle="--" if policy in BOUNDS else "-")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-expert cost scale S")
        ax.set_ylabel("simulated speedup over ar")
        ax.set_title(f"SIMULATION: {base}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"simulated_speedup_{number}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
