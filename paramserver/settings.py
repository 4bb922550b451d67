"""Settings declared once: each config field carries its command-line flag, its
``PARAMSERVER_*`` variable and its help (``setting``). The click options of every command
(``options``), the config a command builds from them (``values``) and the argv of every child
process (``argv``: launch's servers and workers, ``worker --procs``, the benchmarks) all
derive from these declarations, so a setting is written in one place. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import click

F = Callable[..., Any]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # no command-line default of its own: the field's


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line.

    Args:
        flag: the option, e.g. ``--epochs``.
        help: its ``--help`` text.
        env: the variable's name after ``PARAMSERVER_`` (default: the flag's, upper-cased).
        dest: the click parameter's name (default: the field's).
        choices: the values it takes, if a fixed list.
        type: a click type (default: the default value's type).
        cli_default: where the command line's default differs from the API's.
        secret: never put in a child's argv (children get it through the environment).
        is_flag: a switch without a value.
    """

    flag: str
    help: str
    env: str = ""
    dest: str = ""
    choices: tuple[str, ...] = ()
    type: Any = None
    cli_default: Any = UNSET
    secret: bool = False
    is_flag: bool = False

    @property
    def envvar(self) -> str:
        return "PARAMSERVER_" + (self.env or self.flag.lstrip("-").upper().replace("-", "_"))


def setting(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A dataclass field with ``default`` that the command line sets through ``flag``."""
    return dataclasses.field(default=default, metadata={"flag": Flag(flag, help, **kw)})


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of ``cls`` that have a flag, in declaration order."""
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            yield f, f.metadata["flag"]


def _dest(f: dataclasses.Field[Any], flag: Flag) -> str:
    return flag.dest or f.name


def options(
    cls: type,
    *,
    exclude: tuple[str, ...] = (),
    defaults: Mapping[str, Any] | None = None,
    rename: Mapping[str, str] | None = None,
) -> Callable[[F], F]:
    """A decorator adding a click option for every flagged field of ``cls`` but
    ``exclude``; ``defaults`` and ``rename`` (by field name) adapt them to one command."""
    made = []
    for f, flag in declared(cls):
        if f.name in exclude:
            continue
        default = (defaults or {}).get(f.name, flag.cli_default)
        if default is UNSET:
            default = f.default
        kwargs: dict[str, Any] = {"default": default, "help": flag.help}
        if flag.is_flag:
            kwargs["is_flag"] = True
        elif flag.choices:
            kwargs["type"] = click.Choice(flag.choices)
        elif flag.type is not None:
            kwargs["type"] = flag.type
        elif default is not None:
            kwargs["type"] = type(default)
        name = (rename or {}).get(f.name, flag.flag)
        made.append(
            click.option(
                name,
                _dest(f, flag),
                envvar=flag.envvar,
                show_envvar=True,
                show_default=True,
                **kwargs,
            )  # fmt: skip
        )

    def decorate(func: F) -> F:
        for option in reversed(made):
            func = option(func)
        return func

    return decorate


def values(cls: type, kw: dict[str, Any], *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The field values of ``cls`` that a command's options gave, taken out of ``kw``."""
    return {
        f.name: kw.pop(_dest(f, flag))
        for f, flag in declared(cls)
        if f.name not in exclude and _dest(f, flag) in kw
    }


def argv(
    cfg: Any, *, exclude: tuple[str, ...] = (), rename: Mapping[str, str] | None = None
) -> list[str]:
    """The command-line arguments that give ``cfg``'s flagged fields (and those of the
    configs nested in it) their values; secrets and unset values are left out."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in exclude:
            continue
        if "flag" not in f.metadata:
            if dataclasses.is_dataclass(value):
                out += argv(value)
            continue
        flag: Flag = f.metadata["flag"]
        if flag.secret or value is None or value is False:
            continue
        name = (rename or {}).get(f.name, flag.flag)
        if value is True and flag.is_flag:
            out.append(name)
        else:
            out += [name, repr(value) if isinstance(value, float) else str(value)]
    return out


def secrets(cfg: Any) -> dict[str, str]:
    """``{variable: value}`` of ``cfg``'s secret settings: what a child gets by environment."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "flag" not in f.metadata:
            if dataclasses.is_dataclass(value):
                out.update(secrets(value))
        elif f.metadata["flag"].secret and value:
            out[f.metadata["flag"].envvar] = str(value)
    return out
