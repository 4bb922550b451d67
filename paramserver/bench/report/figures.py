"""Plots of the benchmark JSON lines: ``python -m paramserver.bench.report.figures docs/bench``.

Reads scaling.json, straggler.json and accuracy.json (each the ``--json`` line of its
benchmark) from the folder and writes a PNG of the same name next to each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def scaling(figures: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    counts = figures["workers"]
    for policy in ("sync", "delay1", "async"):
        ax.plot(counts, figures[f"{policy}_samples_per_s"], "o-", label=policy.replace("1", "-1"))
    ax.axhline(
        figures["local_samples_per_s"], color="grey", linestyle="--", label="one local process"
    )
    ax.set_xticks(counts)
    ax.set_xlabel("worker processes")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_title("paramserver bench scaling (mlp, batch 64, 2-core CPU)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def straggler(figures: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["DDP (gloo)", "paramserver async", "paramserver delay-1"]
    fast = [
        figures["ddp_samples_per_s"] / 2,
        *(figures[f"{k}_per_worker"][0] for k in ("async", "delay1")),
    ]
    slow = [
        figures["ddp_samples_per_s"] / 2,
        *(figures[f"{k}_per_worker"][-1] for k in ("async", "delay1")),
    ]
    ax.bar(names, fast, label="fast worker")
    ax.bar(names, slow, bottom=fast, label="slow worker (3x)")
    ax.set_ylabel("samples/s")
    ax.set_title("paramserver bench straggler (2 workers, one 3x slower)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def accuracy(figures: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = {
        "local": "one local process",
        "ddp": "DDP, 2 processes",
        "sync": "paramserver sync",
        "delay-1": "paramserver delay-1",
        "async": "paramserver async",
    }
    for key, label in names.items():
        curve = figures["curves"].get(key)
        if curve:
            ax.plot([s for s, _ in curve], [100 * a for _, a in curve], "o-", label=label)
    ax.axhline(100 * figures["target_accuracy"], color="grey", linestyle="--", label="target")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"paramserver bench accuracy ({figures['dataset']}, mlp, 2-core CPU)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(folder: str) -> None:
    root = Path(folder)
    for name, draw in (("scaling", scaling), ("straggler", straggler), ("accuracy", accuracy)):
        src = root / f"{name}.json"
        if src.exists():
            draw(json.loads(src.read_text().strip().splitlines()[-1]), root / f"{name}.png")
            print(root / f"{name}.png")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/bench")
