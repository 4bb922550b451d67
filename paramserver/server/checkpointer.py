"""Writes the server's checkpoints: every N optimizer steps or N seconds, and at the end."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from paramserver import checkpoint
from paramserver.config import parse_every
from paramserver.server.coordinator import Coordinator

log = logging.getLogger(__name__)


class Checkpointer:
    """A thread that saves ``coordinator``'s state to ``directory`` as often as asked.

    Args:
        every: ``--checkpoint-every``: ``N`` optimizer steps or ``Ns`` seconds.
    """

    def __init__(self, coordinator: Coordinator, directory: str | Path, every: str):
        self.coordinator = coordinator
        self.directory = Path(directory)
        self.steps, self.seconds = parse_every(every)
        self._lock = threading.Lock()  # one writer at a time
        self._stop = threading.Event()
        self._last_version = coordinator.store.version
        self._thread = threading.Thread(target=self._loop, name="ps-checkpoint", daemon=True)

    def start(self) -> Checkpointer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def _due(self, c: Coordinator) -> bool:
        return self._stop.is_set() or (
            self.steps is not None and c.store.version >= self._last_version + self.steps
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.steps is not None:
                self.coordinator.wait_for(self._due, timeout=1.0)
            else:
                self._stop.wait(self.seconds)
            if self._stop.is_set():
                return
            if self.coordinator.store.version != self._last_version:
                try:
                    self.save()
                except OSError as exc:
                    log.error("checkpoint to %s failed: %s", self.directory, exc)

    def save(self) -> int:
        """Write a checkpoint now; returns its version."""
        with self._lock:
            started = time.perf_counter()
            state = self.coordinator.checkpoint_state()
            cfg = self.coordinator.config
            path = checkpoint.save_server(
                self.directory,
                self.coordinator.manifest,
                state,
                checkpoint.server_file(cfg.shard, cfg.shards),
            )
            self._last_version = state["version"]
            self.coordinator.saved(state["version"], time.time())
            log.info(
                "checkpoint of version %d written to %s in %.2fs",
                state["version"],
                path,
                time.perf_counter() - started,
            )
            return int(state["version"])

    def stop(self) -> None:
        """Stop the thread and write a last checkpoint."""
        self._stop.set()
        self.coordinator.notify()
        self._thread.join(timeout=60)
        self.save()
