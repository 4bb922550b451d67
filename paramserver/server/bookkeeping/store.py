"""The global model: one flat buffer (parameters, then buffers; float32, or float64 for a
float64 model), its version and the server-side optimizer over the parameters' section.

A shard on a GPU (``--server-device``) keeps that buffer and the optimizer's state on the
device, where its fused optimizer steps, and a copy on the host (``weights``) that pulls,
snapshots and checkpoints read, brought up to date after every change; checkpoints hold the
optimizer's state on the host, so one written on a GPU resumes on a CPU and the other way
round (``load_state_dict`` moves the state to the parameters' device).

A resumed store goes on from the checkpoint's optimizer state with its own settings, and
refuses another optimizer's state unless told to start afresh (``optimizer_resume``)."""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from paramserver.codec.idle import Idle
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, lazy_dynamo
from paramserver.config.lazy_dynamo import bare_step, hooked
from paramserver.server.optim import optimizer_resume, step_rules
from paramserver.server.optim.outer import DelayedNesterov
from paramserver.server.optim.user_optimizer import GroupedOptimizer, Grouping
from paramserver.server.optim.user_schedule import UserSchedule

lazy_dynamo.install()  # a shard's optimizer without torch._dynamo (2 s of CPU at its start)

log = logging.getLogger(__name__)

# Retired snapshots kept for reuse: a pull of one version may still be streaming while the
# next is published; a fresh 64 MiB buffer costs about 7 ms of page faults.
KEEP_SNAPSHOTS = 2


def build_optimizer(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer named by ``cfg`` over ``params``: torch's fused kernel, one pass
    over the flat buffer, where this torch has it for the device (measured on 64 MiB, one
    thread: momentum 7.4 ms a step against 13.6 for the default; Adam on the MLP's 235k
    parameters 0.27 ms against 0.6-2.3 ms; plain SGD the same either way)."""
    kind: type[torch.optim.Optimizer]
    # --weight-decay-on matrices: the store decays the matrices itself (``step_rules``)
    kw: dict[str, Any] = {
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay if cfg.decay_on == "all" else 0.0,
    }
    if cfg.name == "delayed-nesterov":  # no fused kernel: four passes over the buffer
        return DelayedNesterov(params, momentum=cfg.momentum, period=cfg.period or 1, **kw)
    if cfg.name in ("sgd", "momentum", "nesterov"):
        kind = torch.optim.SGD
        if cfg.name != "sgd":
            kw["momentum"] = cfg.momentum
            kw["nesterov"] = cfg.name == "nesterov"
    else:
        kind = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
        kw.update(betas=cfg.parsed_betas, eps=cfg.eps)
    try:
        return kind(params, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):  # a torch or device without it
        return kind(params, **kw)


class ParameterStore:
    """Flat parameters, updated in place by a torch optimizer, and the buffers after them.

    The optimizer sees the parameters' section as one flat tensor; elementwise optimizers
    (SGD, momentum, Adam, AdamW) give exactly the per-tensor result. The buffers' section
    (``manifest.section``: "buffer" and "count") is set by ``set_buffers``. Not
    thread-safe: the coordinator serialises calls. ``switch`` (``--switch-optimizer``): a
    checkpoint of another optimizer leaves its state behind instead of being refused.
    """

    def __init__(
        self,
        manifest: Manifest,
        initial: np.ndarray,
        optimizer: OptimizerConfig,
        device: str | torch.device = "cpu",
        mirrored: bool | None = None,
        copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto,
        switch: bool = False,
        decayed: step_rules.Ranges = (),
        grouped: Grouping | None = None,
    ):
        if initial.dtype != manifest.np_dtype or initial.size != manifest.numel:
            raise ValueError(
                f"Initial weights must be {manifest.numel} {manifest.dtype} values; got "
                f"{initial.size} {initial.dtype}."
            )
        self.manifest = manifest
        self.config = optimizer
        self.switch = switch
        # --lr-schedule module:function: its rates, step by step (``user_schedule``)
        self.schedule = (
            UserSchedule(optimizer.schedule, optimizer.lr) if ":" in optimizer.schedule else None
        )
        self.decayed = decayed  # with --weight-decay-on matrices: the elements that decay
        self._copy = copy  # a snapshot's copy (the server's: split over its threads)
        self.device = torch.device(device)
        # the master on the device and a copy on the host (on a CPU: one tensor; tests
        # force ``mirrored`` to run a GPU shard's bookkeeping on a CPU)
        self.mirrored = self.device.type != "cpu" if mirrored is None else mirrored
        self.host = torch.from_numpy(initial.copy())
        if self.mirrored and self.device.type == "cuda":
            self.host = _page_locked(self.host)  # a step's copy back at the bus's speed
        self._weights = self.host.numpy()  # the same memory: ``host`` is only written in place
        self.flat = self.host.to(self.device, copy=True) if self.mirrored else self.host
        self.n_params = manifest.section("param")[1]
        # A view: the optimizer's steps land in the flat buffer that pulls read.
        self.param = torch.nn.Parameter(self.flat[: self.n_params])
        # --optimizer module:function: the user's class and groups over this shard's pieces
        self.grouped = GroupedOptimizer(*grouped, self.param.data) if grouped else None
        if self.grouped is not None:
            self.optimizer = self.grouped.optimizer
        else:
            self.optimizer = build_optimizer([self.param], optimizer)
        self._bare_step = bare_step(self.optimizer) if self.grouped is None else None
        self.version = 0
        self.progress: Callable[[], tuple[int, int] | None] = lambda: None  # batches done
        self._snapshot: np.ndarray | None = None
        self._retired: list[np.ndarray] = []  # earlier versions' snapshots, for reuse

    def rate(self, version: int) -> float:
        """The learning rate of optimizer step ``version``: the schedule at that step, or
        at the run's batches done (``progress``, set by the coordinator)."""
        at = self.schedule.lr_at if self.schedule is not None else None
        return self.config.rate(version, self.progress(), at)

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.rate(self.version)

    @property
    def weights(self) -> np.ndarray:
        """A live numpy view of the weights and buffers (changes with every step)."""
        return self._weights

    def apply(self, grad: np.ndarray, idle: Idle = (), clip: float | None = None) -> None:
        """One optimizer step with ``grad``, the gradient of the parameters' section: the
        next version (``idle``, ``clip``: as ``step``)."""
        self.step(grad, self.rate(self.version), idle, clip)
        self.version += 1
        self.retire()

    def step(self, grad: np.ndarray, lr: float, idle: Idle = (), clip: float | None = None) -> None:
        """The optimizer's step with ``grad`` at rate ``lr``, in place; the version and the
        snapshots are the caller's to move on (``apply``, or a publish: ``server/applies``).
        ``idle``: ranges of parameters that had no gradient, left as they were, weights and
        optimizer state (``codec/idle.py``). ``clip``: the factor ``--clip-grad-norm`` scales
        the gradient by, where its norm spans more than ``grad`` (``norm_round.py``; None:
        clipped by ``grad``'s own norm)."""
        if idle == ((0, self.n_params),):  # no gradient at all: torch steps nothing
            return
        if self.grouped is not None:  # its own groups; torch skips a piece without a gradient
            self.grouped.step(self._gradient(grad, lr, clip), lr / self.config.lr, idle)
        else:
            state = self.optimizer.state.get(self.param, {})
            kept = step_rules.keep(self.param, state, idle)
            self._step(grad, lr, clip)
            step_rules.put_back(self.param, self.optimizer.state.get(self.param, {}), kept)
        self._mirror(0, self.n_params)

    def _gradient(self, grad: np.ndarray, lr: float, clip: float | None = None) -> torch.Tensor:
        """``grad`` on the device, clipped and decayed as the settings say."""
        g = torch.from_numpy(grad).to(self.device)
        cfg = self.config
        if clip is not None:  # a new tensor: the caller's gradient stays as it came
            g = g * clip
        elif cfg.clip:
            g = step_rules.clipped(g, cfg.clip)
        if cfg.decay_on != "all" and cfg.weight_decay:
            decoupled = cfg.name == "adamw"
            g = g if cfg.clip or clip is not None or decoupled else g.clone()
            step_rules.decay(self.param, g, self.decayed, lr, cfg.weight_decay, decoupled)
        return g

    def _step(self, grad: np.ndarray, lr: float, clip: float | None = None) -> None:
        self.param.grad = self._gradient(grad, lr, clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self._bare_step is not None and not hooked(self.optimizer):
            self._bare_step()
        else:
            self.optimizer.step()
        self.param.grad = None

    def second_moment(self) -> np.ndarray | None:
        """Adam's (AdamW's) mean of the squared gradient, bias-corrected as Adam's step
        reads it (``v / (1 - beta2 ** t)``: the raw running mean starts near 0), on the
        host, the parameters' (None: another optimizer, no step yet, or a GPU shard's)."""
        state = self.optimizer.state.get(self.param, {}) if self.grouped is None else {}
        v = state.get("exp_avg_sq")
        if v is None or v.device.type != "cpu":
            return None
        beta2 = self.optimizer.param_groups[0]["betas"][1]
        return v.detach().numpy() / (1.0 - beta2 ** float(state["step"]))

    def _mirror(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the device's master into the host's copy (pulls read it)."""
        if self.mirrored and hi > lo:
            self.host[lo:hi].copy_(self.flat[lo:hi])

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of the optimizer's ``state_dict()`` with its tensors on the host, and the
        settings that wrote it (``optimizer_resume.SETTINGS``): what a checkpoint holds,
        whatever the device."""
        if self.grouped is not None:  # the flat form, each piece's step beside it
            state = _host_copy(self.grouped.flat_state(self.n_params))
        else:
            state = _host_copy(self.optimizer.state_dict())
        state[optimizer_resume.SETTINGS] = optimizer_resume.recorded(self.config)
        return state

    def resumes(self, optimizer_state: dict, where: str = "The checkpoint") -> bool:
        """Whether this optimizer goes on from ``optimizer_state`` (read from ``where``):
        True for the same optimizer's; False for another's under ``switch``.

        Raises:
            ConfigError: another optimizer's state, without ``switch``.
        """
        return optimizer_resume.check(optimizer_state, self.config, self.switch, where)

    def restore(self, weights: np.ndarray, optimizer_state: dict, version: int) -> None:
        """Take over the weights, optimizer state and version of a checkpoint: the state
        with this store's settings (its momentum, period, weight decay: the command line
        wins over the checkpoint's, logged), or under ``switch`` another optimizer's left
        behind, this one's starting afresh.

        Raises:
            ConfigError: another optimizer's state, without ``switch``.
        """
        if weights.size != self.manifest.numel:
            raise ValueError(f"{weights.size} weights for a model of {self.manifest.numel}.")
        same = self.resumes(optimizer_state)
        with torch.no_grad():
            self.flat.copy_(torch.from_numpy(np.ascontiguousarray(weights, self.manifest.np_dtype)))
        self._mirror(0, self.manifest.numel)
        if same:
            self._go_on(optimizer_state)
        else:
            self.optimizer.state.clear()  # a rewind's store holds state of its own
            log.warning(
                "the checkpoint's server optimizer state is --optimizer %s's, not %s's: "
                "--switch-optimizer starts %s's afresh; the weights and the rest of the run "
                "go on",
                " or ".join(optimizer_resume.saved(optimizer_state)[0]),
                self.config.name,
                self.config.name,
            )
        self.version = version
        self.retire()

    def _go_on(self, optimizer_state: dict) -> None:
        """Load ``optimizer_state`` under this optimizer's own parameter groups: torch's
        ``load_state_dict`` would take the saved groups' hyperparameters too (a resumed
        ``--momentum 0.5`` stepped with the checkpoint's 0.9), and places the state by the
        groups it is given (a fused step's ``step`` on the device)."""
        if self.grouped is not None:
            self.grouped.load_flat(optimizer_state)
        else:
            mine = self.optimizer.state_dict()["param_groups"]
            groups = [
                {**group, "params": theirs["params"]}
                for group, theirs in zip(mine, optimizer_state["param_groups"], strict=True)
            ]
            self.optimizer.load_state_dict({**optimizer_state, "param_groups": groups})
        changed = optimizer_resume.changes(optimizer_state, self.config)
        if changed:
            log.info(
                "the server optimizer (%s) goes on from the checkpoint's state with this "
                "command line's settings, not the checkpoint's: %s",
                self.config.name,
                ", ".join(changed),
            )

    def set_buffers(self, values: np.ndarray) -> None:
        """Set the buffers' section (everything after the parameters) to ``values``."""
        self.flat[self.n_params :] = torch.from_numpy(values).to(self.device)
        self._mirror(self.n_params, self.manifest.numel)
        self.retire()

    def snapshot(self) -> np.ndarray:
        """An immutable copy of the current weights, shared by every pull of this version,
        in the buffer of an earlier version's snapshot that nothing holds any more (none is
        allocated while pulls keep up)."""
        if self._snapshot is None:
            snap = self._recycled()
            self._copy(snap, self.weights)
            snap.setflags(write=False)
            self._snapshot = snap
        return self._snapshot

    def retire(self) -> None:
        """The weights changed: the current snapshot is an earlier version's now."""
        if self._snapshot is not None:
            self._retired = [self._snapshot, *self._retired][:KEEP_SNAPSHOTS]
            self._snapshot = None

    def _recycled(self) -> np.ndarray:
        """A retired snapshot that no pull, stream or checkpoint still reads (only the list
        refers to it: every view of it, a memoryview's included, would count), writable
        again; or a new buffer."""
        for i in range(len(self._retired)):
            if sys.getrefcount(self._retired[i]) == 2:  # the list's and the argument's
                snap = self._retired.pop(i)
                snap.setflags(write=True)
                return snap
        return np.empty_like(self.weights)


def _host_copy(state: Any) -> Any:
    """``state`` (a ``state_dict()``) copied, every tensor in it on the host."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_copy(v) for v in state)
    return copy.deepcopy(state)


def _page_locked(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory, or ``t`` where the driver refuses (logged)."""
    try:
        return t.pin_memory()
    except RuntimeError as exc:
        log.warning("the host copy of the weights stays pageable: %s", exc)
        return t
