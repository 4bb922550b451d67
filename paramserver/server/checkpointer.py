"""Writes the server's checkpoints: every N optimizer steps or N seconds, and at the end.

A shard of a sharded run also writes consistent cuts (``server/cuts.py`` says when; the
coordinator takes the state under its lock, so every shard cuts at the same point), the
newest few kept. It resumes from its newest cut, and ``rewind`` reloads an older one when
another shard restarted from it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from paramserver import checkpoint
from paramserver.config import parse_every
from paramserver.errors import OutOfOrder
from paramserver.server.coordinator import Coordinator

log = logging.getLogger(__name__)
# Cuts kept per shard: a live shard is at most a round ahead of one that died, so the
# newest cut of a restarted shard is always among the others' newest few.
KEEP_CUTS = 3


class Checkpointer:
    """A thread that saves ``coordinator``'s state to ``directory`` as often as asked.

    Args:
        every: ``--checkpoint-every``: ``N`` optimizer steps or ``Ns`` seconds.
        cuts: write consistent cuts every N iterations (a shard of a sharded run;
            ``every`` must then be a number).
    """

    def __init__(self, coordinator: Coordinator, directory: str | Path, every: str, cuts: bool):
        self.coordinator = coordinator
        self.directory = Path(directory)
        self.steps, self.seconds = parse_every(every)
        cfg = coordinator.config
        self.shard, self.shards = cfg.shard, cfg.shards
        self.cuts = cuts
        if cuts:
            coordinator.cuts.every = self.steps
        self._lock = threading.RLock()  # one writer at a time
        self._stop = threading.Event()
        self._last_version = coordinator.store.version
        self._thread = threading.Thread(target=self._loop, name="ps-checkpoint", daemon=True)

    def resume(self) -> None:
        """Take over the newest saved state, if any: the newest cut for a cutting shard,
        else the checkpoint file."""
        manifest = self.coordinator.manifest
        name = checkpoint.server_file(self.shard, self.shards)
        if self.cuts:
            cuts = checkpoint.list_cuts(self.directory, self.shard, self.shards)
            if not cuts:
                return
            name = cuts[max(cuts)].name
        saved = checkpoint.load_server(self.directory, manifest, name)
        if saved is not None:
            self.coordinator.restore(*saved)
            self._last_version = self.coordinator.store.version

    def start(self) -> Checkpointer:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.cuts:
            clock = self.coordinator.cuts.last
            if clock not in checkpoint.list_cuts(self.directory, self.shard, self.shards):
                self._write_cut(self.coordinator.checkpoint_state())  # where a fresh run starts
        self._thread.start()
        return self

    def _due(self, c: Coordinator) -> bool:
        return (
            self._stop.is_set()
            or c.cuts_pending
            or (
                not self.cuts
                and self.steps is not None
                and c.store.version >= self._last_version + self.steps
            )
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.steps is not None:
                self.coordinator.wait_for(self._due, timeout=1.0)
            else:
                self._stop.wait(self.seconds)
            if self._stop.is_set():
                return
            try:
                self.write_cuts()
                if not self.cuts and self.coordinator.store.version != self._last_version:
                    self.save()
            except OSError as exc:
                log.error("checkpoint to %s failed: %s", self.directory, exc)

    def write_cuts(self) -> None:
        """Write the cuts the coordinator took since the last call; when this returns,
        every cut taken before the call is on disk."""
        with self._lock:
            for state in self.coordinator.take_cuts():
                self._write_cut(state)

    def _write(self, state: dict[str, Any], name: str, what: str) -> Path:
        with self._lock:
            started = time.perf_counter()
            path = checkpoint.save_server(self.directory, self.coordinator.manifest, state, name)
            self._last_version = max(self._last_version, int(state["version"]))
            self.coordinator.saved(int(state["version"]), time.time())
            log.info("%s of version %d written to %s in %.2fs", what, state["version"], path,
                     time.perf_counter() - started)  # fmt: skip
            return path

    def _write_cut(self, state: dict[str, Any]) -> None:
        clock = int(state["cut"])
        self._write(state, checkpoint.cut_file(self.shard, self.shards, clock), "cut")
        cuts = checkpoint.list_cuts(self.directory, self.shard, self.shards)
        for old in sorted(cuts)[:-KEEP_CUTS]:
            cuts[old].unlink(missing_ok=True)

    def save(self) -> int:
        """Write a checkpoint now; returns its version."""
        state = self.coordinator.checkpoint_state()
        self._write(state, checkpoint.server_file(self.shard, self.shards), "checkpoint")
        return int(state["version"])

    def rewind(self, round_: int, incarnation: str) -> None:
        """Go back to this shard's cut at sync round ``round_`` (another shard restarted
        from it), as a new incarnation.

        Raises:
            WrongIncarnation: ``incarnation`` is not the current one: a rewind (or a restart)
                happened since the caller joined.
            OutOfOrder: this shard keeps no cut at that round.
        """
        with self._lock:
            self.coordinator.check_incarnation(incarnation)
            cuts = checkpoint.list_cuts(self.directory, self.shard, self.shards)
            if round_ not in cuts:
                raise OutOfOrder(
                    f"Shard {self.shard} of {self.shards} keeps cuts at rounds "
                    f"{sorted(cuts) or 'none'}, not at round {round_}: the run cannot resume "
                    "as one model. Restart every shard from the same round's cuts."
                )
            saved = checkpoint.load_server(self.directory, self.coordinator.manifest,
                                           cuts[round_].name)  # fmt: skip
            assert saved is not None
            was = self.coordinator.membership.min_clock()
            self.coordinator.rewind(*saved)
            for later in [r for r in cuts if r > round_]:  # the abandoned rounds' cuts
                cuts[later].unlink(missing_ok=True)
            log.warning("rewound from round %s to the cut at round %d (incarnation %s)", was,
                        round_, self.coordinator.incarnation)  # fmt: skip

    def abandon(self) -> None:
        """Stop the thread without writing anything more, as a killed process would."""
        self._stop.set()
        self.coordinator.notify()

    def stop(self) -> None:
        """Stop the thread and write a last checkpoint."""
        self._stop.set()
        self.coordinator.notify()
        self._thread.join(timeout=60)
        self.write_cuts()
        self.save()
