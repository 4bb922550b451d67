"""Writes the server's checkpoints: every N optimizer steps or N seconds, and at the end.

A shard of a sharded run also writes consistent cuts (``server/bookkeeping/cuts.py`` says when; the
coordinator takes the state under its lock, so every shard cuts at the same point), and
keeps those that a restart of any shard may need (``Cuts.deletable``). A restarted server
is built from its newest saved state (``saved_state``: its newest cut, for a shard that
cuts), and ``rewind`` reloads an older cut when another shard restarted from it.

A write that fails (a full disk, a file-size limit, a folder it may not write) is logged
with the path and the reason, counted (``status``, metrics, the health service's
``CHECKPOINT_HEALTH``) and retried with backoff; a cut leaves memory only once it is on
disk. Nothing the loop meets ends the thread.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path

from paramserver.codec.layout import Manifest
from paramserver.config import parse_every
from paramserver.errors import ConfigError, OutOfOrder
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.disk import checkpoint
from paramserver.server.disk.row_writer import RowLog
from paramserver.server.engine.coordinator import Coordinator

log = logging.getLogger(__name__)
# Seconds between retries of a failed write: doubling from the first, up to the cap.
RETRY_FIRST, RETRY_CAP = 0.5, 30.0


def retry_delay(failures: int) -> float:
    """The wait after ``failures`` (>= 1) failed writes in a row."""
    return min(RETRY_CAP, RETRY_FIRST * 2 ** min(failures - 1, 16))


def room(directory: Path) -> str:
    """What limits writes in ``directory`` (torch.save's errors do not say): free space,
    and this process's file-size limit when it has one."""
    parts = []
    try:
        st = os.statvfs(directory)
        parts.append(f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free there")
    except OSError as exc:
        parts.append(f"cannot stat the folder: {exc.strerror or exc}")
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        parts.append(f"file-size limit {limit} bytes")
    return f" ({'; '.join(parts)})"


def checkpoint_folder(directory: str | Path) -> Path:
    """``--checkpoint-dir``, made if it is not there: a server checks it at start-up, before
    it builds the model or serves, so that a folder it can never write is refused in one
    line. (A write that fails later, as on a full disk, is logged, counted and retried.)

    Raises:
        ConfigError: the folder cannot be made, is not a folder, or may not be written in;
            the message names the path and the reason.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--checkpoint-dir {path} is not a folder.") from None
    except OSError as exc:
        above = next((p for p in path.parents if p.exists()), None)  # what stopped it
        where = f" ({above} is not a folder)" if above and not above.is_dir() else ""
        raise ConfigError(
            f"Cannot make --checkpoint-dir {path}: {exc.strerror or exc}{where}."
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        why = "its file system is mounted read-only" if read_only else "permission denied"
        raise ConfigError(f"Cannot write in --checkpoint-dir {path}: {why}.")
    return path


def saved_state(
    directory: str | Path,
    manifest: Manifest,
    shard: int,
    shards: int,
    cuts: bool,
    model: str | None = None,
) -> CoordinatorSnapshot | None:
    """The newest state saved in ``directory`` for a server of ``manifest``: the newest
    cut for a shard that ``cuts``, else the checkpoint file; None when there is none.

    Raises:
        ConfigError: the file is not a server checkpoint of this model.
    """
    name = checkpoint.server_file(shard, shards)
    if cuts:
        found = checkpoint.list_cuts(directory, shard, shards)
        if not found:
            return None
        name = found[max(found)].name
    saved = checkpoint.load_server(directory, manifest, name, model)
    return CoordinatorSnapshot.from_dict(*saved) if saved is not None else None


class Checkpointer:
    """A thread that saves ``coordinator``'s state to ``directory`` as often as asked; a
    coordinator built from the newest cut (``saved_state``) finds that cut on disk.

    Args:
        every: ``--checkpoint-every``: ``N`` optimizer steps or ``Ns`` seconds.
        cuts: write consistent cuts every N iterations (a shard of a sharded run;
            ``every`` must then be a number).
        on_health: told False when writes begin failing, True when one succeeds again.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        directory: str | Path,
        every: str,
        cuts: bool,
        on_health: Callable[[bool], None] = lambda ok: None,
    ):
        self.coordinator = coordinator
        self.directory = Path(directory)
        self.steps, self.seconds = parse_every(every)
        cfg = coordinator.config
        self.shard, self.shards = cfg.shard, cfg.shards
        self.cuts = cuts
        if cuts:
            coordinator.saving.schedule(self.steps)
            if coordinator.cuts.last in checkpoint.list_cuts(
                self.directory, self.shard, self.shards
            ):
                coordinator.saving.cut_on_disk(coordinator.cuts.last)  # resumed from it
        self.on_health = on_health
        # the tables' row folders (``row_writer.py``): each write's changed rows
        self.rows = (
            RowLog(
                self.directory,
                self.shard,
                self.shards,
                coordinator.saving.rows,
                cfg.checkpoint_delta_every,
            )
            if coordinator.tables is not None
            else None
        )
        self._unsaved: CoordinatorSnapshot | None = None  # taken, its write failed
        self._lock = threading.RLock()  # one writer at a time
        self._stop = threading.Event()
        self._last_version = coordinator.store.version
        self._failures = 0  # in a row
        self._writing = self.directory  # the file being written (for messages)
        self._thread = threading.Thread(target=self._loop, name="ps-checkpoint", daemon=True)

    def start(self) -> Checkpointer:
        """Make the folder and start the thread.

        Raises:
            ConfigError: the folder cannot be made or written in (``checkpoint_folder``),
                or (a shard) the cut a fresh run starts from cannot be written there.
        """
        checkpoint_folder(self.directory)
        if self.cuts:
            clock = self.coordinator.cuts.last
            if clock not in checkpoint.list_cuts(self.directory, self.shard, self.shards):
                try:  # where a fresh run starts: no shard may rewind past it
                    self._write_cut(self.coordinator.checkpoint_state())
                except OSError as exc:
                    raise ConfigError(
                        f"Cannot write the first cut of shard {self.shard}/{self.shards} in "
                        f"--checkpoint-dir {self.directory}: {exc.strerror or exc}."
                    ) from None
        self._thread.start()
        return self

    def _due(self, c: Coordinator) -> bool:
        return (
            self._stop.is_set()
            or c.saving.cuts_pending
            or (
                not self.cuts
                and self.steps is not None
                and c.store.version >= self._last_version + self.steps
            )
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._failures:
                    self._stop.wait(retry_delay(self._failures))
                elif self.steps is not None:
                    self.coordinator.wait_for(self._due, timeout=1.0)
                else:
                    self._stop.wait(self.seconds)
                if self._stop.is_set():
                    return
                self.write_due()
            except Exception:  # noqa: BLE001 - the thread must outlive any bug: say it, go on
                log.exception("the checkpoint loop failed; it goes on in 1s")
                self._stop.wait(1.0)

    def checkpoint_due(self) -> bool:
        """Whether a checkpoint is due (not in a shard that cuts): ``--checkpoint-every N``
        steps, N optimizer steps past the last one written; ``Ns``, any newer version (the
        loop wakes every N seconds). The loop wakes at least once a second whatever N is,
        and wrote a checkpoint on every wake whose version had changed."""
        version = self.coordinator.store.version
        if self.cuts or version == self._last_version:
            return False
        return self.steps is None or version >= self._last_version + self.steps

    def write_due(self) -> bool:
        """Write what is due: the cuts taken, or a checkpoint (``checkpoint_due``). Returns
        False when a write failed (logged, counted, retried by the loop); never raises."""
        with self._lock:
            try:
                self.write_cuts()
                if self.checkpoint_due():
                    self.save()
            except Exception as exc:  # noqa: BLE001 - any failure is logged, counted, retried
                self._failed(exc, f"retrying in {retry_delay(self._failures + 1):.1f}s")
                return False
            if self._failures:
                log.warning(
                    "checkpoint writes to %s succeed again after %d failures",
                    self.directory,
                    self._failures,
                )
                self._failures = 0
                self._health(True)
            return True

    def _health(self, ok: bool) -> None:
        try:
            self.on_health(ok)
        except Exception:  # noqa: BLE001 - reporting must not stop the writes
            log.exception("could not report the checkpoints' health")

    def _failed(self, exc: Exception, then: str) -> None:
        self._failures += 1
        why = f"writing {self._writing}: {type(exc).__name__}: {exc}{room(self.directory)}"
        self.coordinator.saving.save_failed(why, time.time())
        if self._failures == 1:
            self._health(False)
        log.error("checkpoint write failed (%d in a row; %s): %s", self._failures, then, why)

    def write_cuts(self) -> None:
        """Write the cuts taken, oldest first; each leaves memory once it is on disk. When
        this returns, every cut taken before the call is on disk.

        Raises:
            Exception: a write failed; that cut and those after it stay taken.
        """
        with self._lock:
            while (state := self.coordinator.saving.oldest_cut()) is not None:
                self._write_cut(state)

    def _write(self, state: CoordinatorSnapshot, name: str, what: str) -> Path:
        with self._lock:
            started = time.perf_counter()
            path = self._writing = self.directory / name
            saved = {**state.as_dict(), "model": self.coordinator.config.model}
            if self.rows is not None and state.tables is not None:
                self._writing = self.directory / "rows"
                chain, sums = self.rows.write(state.tables, state.table_layouts or {})
                saved.update(tables=None, row_chain=chain, row_sums=sums)
                self._writing = path
            checkpoint.save_server(self.directory, self.coordinator.manifest, saved, name)
            self._last_version = max(self._last_version, state.version)
            self.coordinator.saving.saved(state.version, time.time())
            log.info(
                "%s of version %d written to %s in %.2fs",
                what,
                state.version,
                path,
                time.perf_counter() - started,
            )
            return path

    def _write_cut(self, state: CoordinatorSnapshot) -> None:
        clock = state.cut
        self._write(state, checkpoint.cut_file(self.shard, self.shards, clock), "cut")
        self.coordinator.saving.cut_on_disk(clock)
        cuts = checkpoint.list_cuts(self.directory, self.shard, self.shards)
        for old in self.coordinator.cuts.deletable(cuts):
            cuts[old].unlink(missing_ok=True)
        if self.rows is not None:
            self.rows.collect()

    def save(self) -> int:
        """Write a checkpoint now; returns its version. A state taken whose write failed
        is written first: the rows it changed are in no later state."""
        name = checkpoint.server_file(self.shard, self.shards)
        if self._unsaved is not None:
            self._write(self._unsaved, name, "checkpoint")
            self._unsaved = None
        state = self._unsaved = self.coordinator.checkpoint_state()
        self._write(state, name, "checkpoint")
        self._unsaved = None
        if self.rows is not None:
            self.rows.collect()
        return state.version

    def rewind(self, round_: int, incarnation: str, cause: str = "") -> bool:
        """Go back to this shard's cut at sync round ``round_`` (another shard, of origin
        ``cause``, restarted from it), as a new incarnation, read from disk (a cut taken and
        not yet written is written first, with those before it: its rows are a delta of
        theirs). Nothing is done (False) when this shard's origin is ``cause`` already: it
        was rewound for that restart before (and went on since), or it is that shard.

        Raises:
            WrongIncarnation: ``incarnation`` is not the current one: a rewind (or a restart)
                happened since the caller joined.
            OutOfOrder: this shard keeps no cut at that round.
        """
        with self._lock:
            if cause and self.coordinator.origin == cause:
                log.info(
                    "a rewind to round %d for the restart of %s: this shard is at that cut's "
                    "origin already; nothing to do",
                    round_,
                    cause,
                )
                return False
            self.coordinator.check_incarnation(incarnation)
            if self.coordinator.saving.pending_cut(round_) is not None:
                self.write_cuts()  # its rows are on disk only with the cuts before it
            cuts = checkpoint.list_cuts(self.directory, self.shard, self.shards)
            saved = None
            if round_ in cuts:
                loaded = checkpoint.load_server(
                    self.directory,
                    self.coordinator.manifest,
                    cuts[round_].name,
                    self.coordinator.config.model,
                )
                saved = CoordinatorSnapshot.from_dict(*loaded) if loaded is not None else None
            else:
                raise OutOfOrder(
                    f"Shard {self.shard} of {self.shards} keeps cuts at rounds "
                    f"{sorted(cuts) or 'none'}, not at round {round_}: the run cannot resume "
                    "as one model. Restart every shard from the same round's cuts."
                )
            assert saved is not None
            # another optimizer's cut (from before --switch-optimizer) is refused before
            # anything of this shard changes: no cut deleted, no clock rewound
            self.coordinator.store.resumes(saved.optimizer_state, f"The cut at round {round_}")
            was = self.coordinator.membership.min_clock()
            for later in [r for r in cuts if r > round_]:  # the abandoned rounds' cuts
                cuts.pop(later).unlink(missing_ok=True)
            self.coordinator.rewind(saved, on_disk=cuts, cause=cause)
            if self.rows is not None:
                self.rows.follow(saved.row_chain or [], saved.row_sums or {})
                self.rows.collect()
            log.warning(
                "rewound from round %s to the cut at round %d (incarnation %s)",
                was,
                round_,
                self.coordinator.incarnation,
            )
            return True

    def abandon(self) -> None:
        """Stop the thread without writing anything more, as a killed process would."""
        self._stop.set()
        self.coordinator.notify()

    def stop(self) -> None:
        """Stop the thread and write the cuts taken and a last checkpoint (a failure is
        logged and counted, not raised)."""
        self._stop.set()
        self.coordinator.notify()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=60)
        try:
            self.write_cuts()
            self.save()
        except Exception as exc:  # noqa: BLE001 - logged and counted; stopping goes on
            self._failed(exc, "the last checkpoint")
