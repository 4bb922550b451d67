"""torch's optimizers without torch._dynamo until something in the process compiles.

``torch.optim.Optimizer``'s ``add_param_group`` (which every optimizer's constructor runs),
``zero_grad``, ``state_dict`` and ``load_state_dict`` are wrapped in
``torch._disable_dynamo``, which imports torch._dynamo (sympy, fx's symbolic shapes) on the
first call: 2.2-2.4 s of CPU on the 2-core machine, as much again as ``import torch``, in
every server (its optimizer), every worker with an inner optimizer and every DDP rank of
the benchmarks. Turning dynamo off around a call matters only while dynamo traces, and
nothing traces before torch._dynamo is imported (``torch.compile`` imports it). So
``install`` leaves each wrapped method to run as it is until torch._dynamo is in
``sys.modules``, and from then on as torch wraps it (``torch._dynamo.disable``).

It relies on ``torch._compile._disable_dynamo``'s cache (the ``__dynamo_disable``
attribute of the wrapped function); a torch whose wrapper looks different is left as it is
(slower to start, the same results). ``tests/unit/test_lazy_dynamo.py`` checks both sides:
no torch._dynamo at start, and a compiled function calling the methods as in eager mode.

Each step's own wrapper imports torch._dynamo as well, for the graph breaks it marks for a
compiled step: ``bare_step`` runs the step beneath it, for the loops that call a step we
built and never compile (a server shard's, the worker daemon's inner optimizer's:
``stepper``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_CACHE = "__dynamo_disable"  # torch._compile's attribute on the function it wraps


def install() -> None:
    """Defer torch._dynamo in ``METHODS`` of ``torch.optim.Optimizer`` (once a process)."""
    for name in METHODS:
        wrapper = torch.optim.Optimizer.__dict__.get(name)
        fn: Callable[..., Any] | None = getattr(wrapper, "__wrapped__", None)
        if wrapper is None or fn is None or getattr(fn, _CACHE, None) is not None:
            continue  # not torch's lazy wrapper, or resolved already (by torch or by us)
        wrapped = fn
        cells = dict(
            zip(
                wrapper.__code__.co_freevars,
                (c.cell_contents for c in wrapper.__closure__ or ()),
                strict=True,
            )
        )
        if cells.get("fn") is fn:
            setattr(fn, _CACHE, _until_dynamo(wrapped, bool(cells.get("recursive", True))))


def _until_dynamo(fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    """``fn`` as it is while torch._dynamo is not imported, then ``fn`` with dynamo off
    (what torch's wrapper would have made on the first call), which from then on replaces
    this in the wrapper's cache."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)
        setattr(fn, _CACHE, disabled)
        return disabled(*args, **kwargs)

    return call


def bare_step(opt: torch.optim.Optimizer) -> Callable[[], Any] | None:
    """``opt.step`` without torch's wrappers around it: the profiler range and the step
    hooks (which a server registers none of; the MLP's Adam step through a shard's apply
    0.29 ms instead of 0.33-0.35, ``docs/measure_store_step.py``), and the grad-mode
    wrapper, which imports torch._dynamo on the first step for the graph breaks it marks
    for ``torch.compile`` (2 s of CPU): the step runs under the grad mode that wrapper
    sets. None where torch did not wrap it as expected."""
    step = type(opt).step
    inner = getattr(step, "__wrapped__", None)
    if not getattr(step, "hooked", False) or inner is None:
        return None
    raw = getattr(inner, "__wrapped__", None)
    code = getattr(inner, "__code__", None)
    if code is None or code.co_name != "_use_grad" or raw is None:
        return functools.partial(inner, opt)
    differentiable = bool(opt.defaults.get("differentiable", False))

    def stepped() -> Any:
        with torch.set_grad_enabled(differentiable):
            return raw(opt)

    return stepped


def hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether a step hook is registered, for every optimizer or for ``opt``."""
    return bool(
        getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
        or getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
        or getattr(opt, "_optimizer_step_pre_hooks", None)
        or getattr(opt, "_optimizer_step_post_hooks", None)
    )


def stepper(opt: torch.optim.Optimizer) -> Callable[[], Any]:
    """``opt``'s step: the bare one (``bare_step``) unless a hook is registered when it
    is called, else ``opt.step()``, which runs the hooks."""
    bare = bare_step(opt)
    install()

    def step() -> Any:
        return bare() if bare is not None and not hooked(opt) else opt.step()

    return step
