"""A run folder: config.json, metrics.jsonl, curve.png, checkpoint.pt, logs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class RunDir:
    """Files of one ``paramserver launch`` run."""

    def __init__(self, root: str | Path, label: str, path: str | Path | None = None):
        if path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = Path(root) / f"{stamp}-{label}"
            n = 1
            while path.exists():
                n += 1
                path = Path(root) / f"{stamp}-{label}-{n}"
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, obj: Any) -> None:
        self.file(name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.file("metrics.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        path = self.file("metrics.jsonl")
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def plot(self, title: str) -> Path:
        """Draw test accuracy and training loss per epoch to curve.png."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.read_metrics()
        epochs = [r["epoch"] for r in rows]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(epochs, [100 * r["test_accuracy"] for r in rows], "o-")
        ax1.set_xlabel("epoch")
        ax1.set_ylabel("test accuracy (%)")
        ax1.grid(alpha=0.3)
        ax2.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
        ax2.plot(epochs, [r["train_loss"] for r in rows], "s--", label="train (moving avg)")
        ax2.set_xlabel("epoch")
        ax2.set_ylabel("cross-entropy")
        ax2.legend()
        ax2.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        out = self.file("curve.png")
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
