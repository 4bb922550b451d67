"""The server-side optimizer's settings (``OptimizerConfig``): a built-in optimizer and its
options, the learning-rate schedule, or a user's factory (``--optimizer module:function``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paramserver.config.base import (
    DECAY_ON,
    LR_SCHEDULE_BY,
    LR_SCHEDULES,
    MAX_INT64,
    OPTIMIZERS,
    _non_negative,
    _positive,
    check_count,
)
from paramserver.errors import ConfigError
from paramserver.settings import setting


@dataclass(frozen=True)
class OptimizerConfig:
    """The server-side optimizer."""

    name: str = setting(
        "adam",
        "--optimizer",
        "Server-side optimizer: sgd, momentum, nesterov (SGD with Nesterov momentum, DiLoCo's outer optimizer over the workers' local steps, e.g. --lr 0.7), delayed-nesterov (its form for async and ssp:K, each push at --lr/N and the momentum moved once every N pushes, Liu et al. 2024), adam, adamw; or module:function, your factory: it takes the model's named parameters and returns a torch.optim.Optimizer with its parameter groups (their rates, decay, betas), which every shard builds over its slices; a schedule scales each group's rate by the schedule's rate over --lr (docs/porting.md).",
        dest="optimizer",
    )
    lr: float = setting(1e-3, "--lr", "Learning rate.")
    momentum: float = setting(
        0.9, "--momentum", "Momentum (optimizers momentum, nesterov and delayed-nesterov)."
    )
    weight_decay: float = setting(0.0, "--weight-decay", "Weight decay.")
    schedule: str = setting(
        "constant",
        "--lr-schedule",
        "constant, or cosine or linear decay to --lr-floor over --lr-total-steps optimizer steps (after --lr-warmup's, which they include), or module:function: your factory of a torch.optim.lr_scheduler over the optimizer it is given (at --lr), stepped once a server step. The default is constant on server, cosine over the whole run on launch: launch starts the workers, so it can count the run's optimizer steps, which a server cannot (it does not know its workers' --push-every).",
        dest="lr_schedule",
    )
    total_steps: int | None = setting(
        None,
        "--lr-total-steps",
        "Optimizer steps the cosine or linear schedule spans, its warmup included [launch: the whole run].",
        type=int,
        dest="lr_total_steps",
    )
    warmup: int = setting(
        0,
        "--lr-warmup",
        "Optimizer steps of linear warmup before the schedule: step i (from 0) at --lr x (i+1)/N, then the schedule from --lr.",
        dest="lr_warmup",
    )
    floor: float = setting(
        0.0,
        "--lr-floor",
        "The fraction of --lr that cosine and linear decay end at (0.1: 10%), from 0 to 1.",
        dest="lr_floor",
    )
    by: str = setting(
        "steps",
        "--lr-schedule-by",
        "What moves the schedule: steps, the optimizer steps taken; batches, the share of the run's batches done (a server that hands out batches; else steps), at --lr-total-steps for the whole run, so that a run that takes more optimizer steps than planned (rounds short of a worker after a fault) decays over all its batches instead of ending at rate 0. The default is steps on server, batches on launch.",
        choices=LR_SCHEDULE_BY,
        dest="lr_schedule_by",
    )
    period: int = setting(
        0,
        "--nesterov-period",
        "delayed-nesterov: N, the pushes the momentum moves once for [0: the server's --workers; 1 under sync, whose rounds already average the workers].",
        type=int,
        dest="nesterov_period",
    )
    decay_on: str = setting(
        "all",
        "--weight-decay-on",
        "all: --weight-decay on every parameter; matrices: only on those of two or more dimensions that are not an embedding's (none on biases, normalisation layers and embeddings: a transformer's two parameter groups).",
        choices=DECAY_ON,
        dest="weight_decay_on",
    )
    betas: str = setting(
        "0.9,0.999", "--adam-betas", "adam, adamw: beta1,beta2.", dest="adam_betas"
    )
    eps: float = setting(
        1e-8, "--adam-eps", "adam and adamw: the term added to the denominator.", dest="adam_eps"
    )
    clip: float = setting(
        0.0,
        "--clip-grad-norm",
        "Scale the gradient of each optimizer step down to this L2 norm over the whole model when it is larger, as torch.nn.utils.clip_grad_norm_ (0: off), over every shard and every sparse table's rows: under sync the workers relay each round's norm between the shards; under ssp:K and async each push says its own (taken before a lossy --compress).",
        dest="clip_grad_norm",
    )

    # ``ps.serve(optimizer=callable)``: the factory itself, ``name`` its module:qualname
    factory: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    @property
    def user(self) -> bool:
        """Whether the optimizer is a user's factory (``module:function``)."""
        return ":" in self.name

    def __post_init__(self) -> None:
        module, _, function = self.name.partition(":")
        if self.name not in OPTIMIZERS and not (module and function):
            raise ConfigError(
                f"Unknown optimizer (--optimizer) {self.name!r}: choose one of {', '.join(OPTIMIZERS)}, or module:function (your factory of a torch.optim.Optimizer)."
            )
        if self.user:
            self._check_factory()
        _positive("The learning rate (--lr)", self.lr)
        _non_negative("--momentum", self.momentum)
        _non_negative("--weight-decay", self.weight_decay)
        _non_negative("--clip-grad-norm", self.clip)
        _positive("--adam-eps", self.eps)
        self.parsed_betas  # noqa: B018 - refused here if it does not parse
        if self.decay_on not in DECAY_ON:
            raise ConfigError(
                f"--weight-decay-on must be one of {', '.join(DECAY_ON)}; got {self.decay_on!r}."
            )
        if self.decay_on != "all" and self.name == "delayed-nesterov":
            raise ConfigError("--weight-decay-on matrices is not for --optimizer delayed-nesterov.")
        check_count("--nesterov-period", self.period, 0)
        if self.period and self.name != "delayed-nesterov":
            raise ConfigError(
                f"--nesterov-period is for --optimizer delayed-nesterov, not {self.name}."
            )
        if self.schedule not in LR_SCHEDULES and ":" not in self.schedule:
            raise ConfigError(
                f"Unknown learning-rate schedule (--lr-schedule) {self.schedule!r}: choose one "
                f"of {', '.join(LR_SCHEDULES)}, or module:function (an lr_scheduler factory)."
            )
        if ":" in self.schedule and (self.warmup or self.floor):
            raise ConfigError("--lr-warmup and --lr-floor shape the built-in schedules only.")
        if self.by not in LR_SCHEDULE_BY:
            raise ConfigError(
                f"--lr-schedule-by must be one of {', '.join(LR_SCHEDULE_BY)}; got {self.by!r}."
            )
        decays = self.schedule in ("cosine", "linear")
        if decays and (self.total_steps is None or self.total_steps < 1):
            raise ConfigError(
                f"--lr-schedule {self.schedule} needs --lr-total-steps, the number of "
                f"optimizer steps it decays over (at least 1); got {self.total_steps!r}."
            )
        if self.total_steps is not None:  # optimizer steps: int64 versions on the wire
            check_count("--lr-total-steps", self.total_steps, 1, MAX_INT64)
        check_count("--lr-warmup", self.warmup, 0, MAX_INT64)
        if decays and self.total_steps is not None and self.warmup >= self.total_steps:
            raise ConfigError(
                f"--lr-warmup {self.warmup} leaves nothing of --lr-total-steps "
                f"{self.total_steps} to decay over: the warmup is part of the total."
            )
        if not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"--lr-floor is a fraction of --lr, from 0 to 1; got {self.floor}.")

    def _check_factory(self) -> None:
        """A user's optimizer carries its own decay, betas and eps, group by group: the
        options that would set them are refused rather than ignored."""
        given = [
            flag
            for flag, value, default in (
                ("--weight-decay", self.weight_decay, 0.0),
                ("--weight-decay-on", self.decay_on, "all"),
                ("--adam-betas", self.betas, "0.9,0.999"),
                ("--adam-eps", self.eps, 1e-8),
                ("--nesterov-period", self.period, 0),
            )
            if value != default
        ]
        if given:
            raise ConfigError(
                f"--optimizer {self.name} is your own optimizer, whose parameter groups set "
                f"what {', '.join(given)} would: set it in the factory instead."
            )

    @property
    def parsed_betas(self) -> tuple[float, float]:
        """``--adam-betas`` as two floats, each from 0 up to (not including) 1."""
        try:
            b1, b2 = (float(b) for b in self.betas.split(","))
        except ValueError:
            raise ConfigError(
                f"--adam-betas must be two numbers, beta1,beta2 (0.9,0.999); got {self.betas!r}."
            ) from None
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"--adam-betas must each be from 0 to below 1; got {self.betas!r}.")
        return b1, b2

    def rate(
        self, step: int, done: tuple[int, int] | None, at: Callable[[int], float] | None = None
    ) -> float:
        """The learning rate (``at`` a step, default ``lr_at``) of optimizer step ``step``; by
        batches, at most that of the step the plan reached (``done``: batches done, the run's;
        None: no plan), so a run of more, smaller steps than planned ends at the plan's last."""
        total, at = self.total_steps, at or self.lr_at  # ``at``: a factory's (server side)
        if self.by != "batches" or done is None or total is None or done[1] < 1:
            return at(step)
        reached = min(done[0] * total // done[1], total - 1)
        return at(min(step, reached))

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): ``--lr-warmup``'s linear
        rise, then constant, or cosine or linear decay from ``--lr`` to ``--lr-floor`` of it
        at ``--lr-total-steps`` (the warmup counted in), and the floor after."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule not in ("cosine", "linear") or self.total_steps is None:
            return self.lr  # constant (a factory's rates are the server's: ``UserSchedule``)
        span = self.total_steps - self.warmup
        p = min(step - self.warmup, span) / span
        low = self.lr * self.floor
        shape = 0.5 * (1.0 + math.cos(math.pi * p)) if self.schedule == "cosine" else 1 - p
        return low + (self.lr - low) * shape
