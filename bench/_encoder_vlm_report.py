"""The VLM quality benchmark's output (`bench._encoder_vlm`): one table per family on stdout
and one chart of every family.

Both only read the result dicts `measure_checkpoint` returns (what encoder_vlm.json holds):
nothing here encodes or runs a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench._encoder_vlm import CONFIGS

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ("RANDOM_NOTE", "plot_vlm", "print_family_table")

RANDOM_NOTE = (
    "tiny random-weight checkpoint: agreement numbers show the machinery, not model quality"
)


def print_family_table(res: dict[str, Any]) -> None:
    """One family's table on stdout: a row per config, then the optimized-vs-reference ratios."""
    note = f"  ({RANDOM_NOTE})" if res["random_weights"] else ""
    print(
        f"\n{res['family']}: {res['checkpoint']} on {res['device']}, "
        f"{len(res['photos'])} photos{note}"
    )
    head = (
        f"{'config':<11}{'pruning':>9}{'tokens':>7}{'top-1':>7}{'cos mean':>10}"
        f"{'cos min':>9}{'greedy' + str(res['greedy_steps']):>8}{'prefix':>8}"
        f"{'kept/total':>13}{'enc ms':>9}{'median':>8}{'img/s':>8}{'bytes/img':>11}"
    )
    print(head)
    for name, r in res["configs"].items():
        print(
            f"{name:<11}{r['pruning']:>9}{r['visual_tokens']:>7}{r['top1_agreement']:>7.2f}"
            f"{r['logit_cosine_mean']:>10.4f}{r['logit_cosine_min']:>9.4f}"
            f"{r['greedy_agreement']:>8.2f}{r['greedy_prefix_mean']:>8.2f}"
            f"{r['tokens_kept_mean']:>6.1f}/{r['tokens_total_mean']:<6.1f}"
            f"{r['encode_ms_mean']:>9.1f}{r['encode_ms_median']:>8.1f}{r['images_per_s']:>8.1f}"
            f"{r['payload_bytes_mean']:>11.0f}"
        )
    if res["wrong_image"] is not None:
        w = res["wrong_image"]
        print(
            f"{'wrong image':<11}{'(other photo)':>16}{w['top1_agreement']:>7.2f}"
            f"{w['logit_cosine_mean']:>10.4f}"
        )
    s = res["summary"]
    print(
        f"optimized vs reference: encode speed-up {s['encode_speedup_vs_reference']:.2f}x (mean), "
        f"{s['encode_speedup_median_vs_reference']:.2f}x (median), "
        f"{s['images_per_s_ratio_vs_reference']:.2f}x images/s, "
        f"{s['payload_bytes_ratio_vs_reference']:.3f}x bytes, "
        f"{s['tokens_kept_ratio']:.0%} of visual tokens kept, "
        f"top-1 agreement {s['top1_agreement']:.2f}, cosine {s['logit_cosine_mean']:.4f}"
    )


def plot_vlm(results: list[dict[str, Any]], path: Path) -> None:
    """Quality, speed and size per family and config, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.6))
    families = [r["family"] for r in results]
    x = np.arange(len(families))
    width = 0.8 / len(CONFIGS)
    panels = (
        ("top1_agreement", "next-token top-1 agreement", 1.0),
        ("logit_cosine_mean", "logit cosine vs reference (mean)", 1.0),
        ("encode_ms_mean", "encode ms per image", 1.0),
        ("payload_bytes_mean", "KiB stored per image", 1 / 1024),
    )
    for ax, (key, title, scale) in zip(axes, panels, strict=False):
        for i, c in enumerate(CONFIGS):
            vals = [r["configs"][c][key] * scale for r in results]
            ax.bar(x + (i - (len(CONFIGS) - 1) / 2) * width, vals, width, label=c)
        floor = [
            (j, r["wrong_image"][key])
            for j, r in enumerate(results)
            if r.get("wrong_image") and key in r["wrong_image"]
        ]
        for k, (j, value) in enumerate(floor):
            ax.hlines(
                value,
                j - 0.45,
                j + 0.45,
                colors="black",
                linestyles="dashed",
                label="wrong image" if k == 0 else None,
            )
        ax.set_xticks(x, families)
        ax.set_title(title, fontsize=10)
    axes[0].set_ylim(0, 1.05)
    shown = [r["configs"][c]["logit_cosine_mean"] for r in results for c in CONFIGS]
    shown += [r["wrong_image"]["logit_cosine_mean"] for r in results if r.get("wrong_image")]
    axes[1].set_ylim(max(-1.0, min(min(shown), 0.99) - 0.02), 1.005)  # zoomed: 0.99 vs 0.999
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=9)
    label = (
        "tiny random-weight checkpoints (machinery, not model quality)"
        if all(r["random_weights"] for r in results)
        else "VLM checkpoints"
    )
    fig.suptitle(
        f"visiongate encoder: patch dropping + INT4 vs exact, {label}, on {results[0]['device']}"
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
