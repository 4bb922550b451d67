"""A run folder: config.json, metrics.jsonl, curve.png, checkpoint.pt, logs.

Its writes survive a process killed in the middle of one: config.json, summary.json and
curve.png are written whole or not at all (a temporary file, then a rename), and a line of
metrics.jsonl cut short is dropped before the next one is appended, so each line is one
record and a later read never fails on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError

log = logging.getLogger(__name__)


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
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
        _whole(self.file(name), lambda tmp: tmp.write_text(text))

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one line; a last line cut short (a process killed while it wrote) is
        dropped first, said in the log: appended to, it would spoil this line too."""
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with open(self.file("metrics.jsonl"), "a+b") as f:
            f.seek(0)
            held = f.read()
            if held and not held.endswith(b"\n"):
                keep = held.rfind(b"\n") + 1
                log.warning("%s: its last line is cut short (dropped): %.60r", f.name, held[keep:])
                f.truncate(keep)
            f.write(line)  # one write: a kill leaves the line whole, or cut and dropped later

    def check_writable(self) -> None:
        """Raises OSError where metrics.jsonl, which each epoch appends to, cannot be opened
        for it. (A folder that takes no file at all, read-only or on a full disk, already
        refused config.json, which is written first and whole.)"""
        metrics = self.file("metrics.jsonl")
        if metrics.exists():
            open(metrics, "ab").close()  # appended to after each epoch

    def read_metrics(self) -> list[dict[str, Any]]:
        """The lines of metrics.jsonl; a last line cut short (a process killed while it
        wrote) is left out, said in the log.

        Raises:
            ConfigError: a line before the last is not JSON: not a run folder's file.
        """
        path = self.file("metrics.jsonl")
        if not path.exists():
            return []
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                if i < len(lines) - 1:
                    raise ConfigError(f"{path}, line {i + 1}, is not JSON: {exc}") from None
                log.warning("%s: its last line is cut short (left out): %.60s", path, line)
        return out

    def check_unused(self, resuming: bool) -> None:
        """A folder named by ``--run-dir`` takes a new run only if it holds no earlier
        run's metrics, or if the run goes on from its checkpoints (``resuming``): its
        epochs then follow the ones there.

        Raises:
            ConfigError: it holds another run's metrics.jsonl.
        """
        metrics = self.read_metrics()
        if not metrics or resuming:
            return
        epochs = [m["epoch"] for m in metrics if "epoch" in m] or [0]
        raise ConfigError(
            f"--run-dir {self.path} holds another run's metrics (metrics.jsonl, epochs "
            f"{min(epochs)}-{max(epochs)}): a new run would mix its epochs with them. Give a "
            "new --run-dir, or leave it out (launch makes a fresh folder); a run resumed "
            "from its --checkpoint-dir goes on in the folder it used."
        )

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        """An existing run folder.

        Raises:
            ConfigError: it has no metrics.jsonl to draw.
        """
        run = cls("", "", path)
        if not run.read_metrics():
            raise ConfigError(f"{path} holds no metrics.jsonl with a line in it: not a run folder.")
        return run

    def plot(self, title: str | None = None, out: str | Path | None = None) -> Path:
        """Draw test accuracy, losses and throughput per epoch to a PNG (curve.png)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        rows = self.read_metrics()
        if title is None:
            title = self._title()
        epochs = [r["epoch"] for r in rows]
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
        # None: the outputs are not classes (a user's --loss on another kind of target)
        tested = [(r["epoch"], r["test_accuracy"]) for r in rows if r["test_accuracy"] is not None]
        if tested:
            ax1.plot(*zip(*[(e, 100 * a) for e, a in tested], strict=True), "o-")
        ax1.set_ylabel("test accuracy (%)")
        ax1.set_xlabel("epoch")
        ax1.grid(alpha=0.3)
        ax2.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
        train = [(r["epoch"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        if train:
            ax2.plot(*zip(*train, strict=True), "s--", label="train (moving avg)")
        ax2.set_xlabel("epoch")
        ax2.set_ylabel("cross-entropy")
        ax2.legend()
        ax2.grid(alpha=0.3)
        ax3.plot(epochs, throughput(rows), "o-")
        ax3.set_xlabel("epoch")
        ax3.set_ylabel("samples/s (wall clock, with evaluation)")
        ax3.set_ylim(bottom=0)
        ax3.grid(alpha=0.3)
        for ax in (ax1, ax2, ax3):  # epochs are whole: no 1.5 on the axis
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle(title)
        fig.tight_layout()
        path = Path(out) if out else self.file("curve.png")
        try:
            kind = path.suffix.lstrip(".") or "png"  # as savefig reads it from a name
            _whole(path, lambda tmp: fig.savefig(tmp, dpi=100, format=kind))
        finally:
            plt.close(fig)
        return path

    def _title(self) -> str:
        try:
            cfg = json.loads(self.file("config.json").read_text())["server"]
            return f"{cfg['model']}, {cfg['policy']}, {cfg['workers']} workers"
        except (OSError, KeyError, ValueError):
            return self.path.name


def _whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` the file at ``path`` whole or not at all: to a temporary file beside it,
    then renamed over it. A failed write (a full disk, a file-size limit) leaves the old
    file, if any, and no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never made (a read-only folder): nothing to undo
            tmp.unlink()
        raise


def throughput(rows: list[dict[str, Any]]) -> list[float]:
    """Samples per second within each epoch, from the cumulative samples and wall times."""
    out, samples, wall = [], 0, 0.0
    for r in rows:
        dt = r["wall_s"] - wall
        out.append((r["samples"] - samples) / dt if dt > 0 else 0.0)
        samples, wall = r["samples"], r["wall_s"]
    return out
