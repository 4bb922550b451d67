"""Settings declared once: each config field carries its command-line flag, its
``PARAMSERVER_*`` variable and its help (``setting``). A command takes its settings in
``Part``s (some or all of one config's, in ``--help`` order); its click options
(``options``), the configs it builds from them (``build``) and the argv that starts it as a
child with a given config (``command_args``: launch's servers and workers, ``worker
--procs``, the benchmarks) all derive from these declarations, so a setting is written in
one place and a child's argv parses back into the config it came from. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import click

F = Callable[..., Any]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # no command-line default of its own: the field's
REQUIRED: Any = dataclasses.MISSING  # a field without a default (the option is required)


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line (and in a config file).

    Args:
        flag: the option, e.g. ``--epochs``; a switch with an "off" form is
            ``--progress/--no-progress``.
        help: its ``--help`` text.
        env: the variable's name after ``PARAMSERVER_`` (default: the flag's, upper-cased).
        dest: the click parameter's name (default: the field's).
        choices: the values it takes, if a fixed list.
        type: a click type (default: the default value's type).
        cli_default: where the command line's default differs from the API's.
        secret: never put in a child's argv (children get it through the environment).
        is_flag: a switch without a value.
        required: the command line must give it.
        parse: the option's value as field values (default: this field's value).
        show: the option's value that gives a config's field values (default: the field's).
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
    required: bool = False
    parse: Callable[[Any], dict[str, Any]] | None = None
    show: Callable[[Any], Any] | None = None

    @property
    def name(self) -> str:
        """The option's name: ``--progress`` of ``--progress/--no-progress``."""
        return self.flag.split("/")[0]

    @property
    def key(self) -> str:
        """Its key in a config file: the name without dashes in front."""
        return self.name.lstrip("-")

    @property
    def envvar(self) -> str:
        return "PARAMSERVER_" + (self.env or self.key.upper().replace("-", "_"))


class SettingOption(click.Option):
    """A click option made from a declared setting; ``setting`` is its Flag."""

    def __init__(self, *args: Any, setting: Flag, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.setting = setting


def setting(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A dataclass field with ``default`` (or ``REQUIRED``) that the command line sets
    through ``flag``."""
    return dataclasses.field(default=default, metadata={"flag": Flag(flag, help, **kw)})


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of ``cls`` that have a flag, in declaration order."""
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            yield f, f.metadata["flag"]


def _dest(f: dataclasses.Field[Any], flag: Flag) -> str:
    return flag.dest or f.name


@dataclass(frozen=True)
class Part:
    """The settings of ``cls`` that a command takes: ``only`` these fields (in this order)
    or all but ``exclude``; ``defaults`` gives a field another default on this command (by
    field name). A setting has one flag on every command that takes it."""

    cls: type
    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def settings(self) -> Iterator[tuple[dataclasses.Field[Any], Flag, str]]:
        """Each setting taken: its field, its flag and its option on this command."""
        fields = {f.name: (f, flag) for f, flag in declared(self.cls)}
        for name in self.only or tuple(fields):
            f, flag = fields[name]
            if name not in self.exclude:
                yield f, flag, flag.flag

    def default(self, f: dataclasses.Field[Any], flag: Flag) -> Any:
        """The setting's default on this command."""
        default = self.defaults.get(f.name, flag.cli_default)
        if default is UNSET:
            default = None if f.default is dataclasses.MISSING else f.default
        return default


class FiniteFloat(click.types.FloatParamType):
    """A float option that refuses ``inf`` and ``nan`` (click's FLOAT takes both): a
    learning rate or a timeout of ``inf`` is a mistake the run finds much later."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


FINITE_FLOAT = FiniteFloat()


def option(
    f: dataclasses.Field[Any], flag: Flag, name: str, default: Any, **extra: Any
) -> Callable[[F], F]:
    """The click option of one setting, ``name`` on the command line."""
    kwargs: dict[str, Any] = {"default": default, "help": flag.help}
    if flag.is_flag:
        kwargs["is_flag"] = True
    elif flag.choices:
        kwargs["type"] = click.Choice(flag.choices)
    elif flag.type is not None:
        kwargs["type"] = FINITE_FLOAT if flag.type is float else flag.type
    elif default is not None and "/" not in name:
        kwargs["type"] = FINITE_FLOAT if isinstance(default, float) else type(default)
    if flag.required:
        kwargs["required"] = True
    return click.option(
        name,
        _dest(f, flag),
        cls=SettingOption,
        setting=flag,
        envvar=flag.envvar,
        show_envvar=True,
        show_default=True,
        **kwargs,
        **extra,
    )


def options(*parts: Part | type) -> Callable[[F], F]:
    """A decorator adding a click option for every setting of ``parts`` (a class: all of
    its settings), in their order."""
    made = []
    for part in parts:
        part = part if isinstance(part, Part) else Part(part)
        for f, flag, name in part.settings():
            made.append(option(f, flag, name, part.default(f, flag)))

    def decorate(func: F) -> F:
        for one in reversed(made):
            func = one(func)
        return func

    return decorate


def values(cls: type, kw: dict[str, Any], *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The field values of ``cls`` that a command's options gave, taken out of ``kw``."""
    out: dict[str, Any] = {}
    for f, flag in declared(cls):
        if f.name in exclude or _dest(f, flag) not in kw:
            continue
        value = kw.pop(_dest(f, flag))
        out.update(flag.parse(value) if flag.parse else {f.name: value})
    return out


def build(cls: type, kw: dict[str, Any], **fixed: Any) -> Any:
    """A ``cls`` made of the settings in ``kw`` (by parameter name; taken out of it), each
    config nested in it built the same way, and ``fixed`` (by field name) as they are."""
    nested = {}
    for f in dataclasses.fields(cls):
        factory: Any = f.default_factory
        nests = isinstance(factory, type) and dataclasses.is_dataclass(factory)
        if f.name not in fixed and "flag" not in f.metadata and nests:
            nested[f.name] = build(factory, kw)
    return cls(**values(cls, kw, exclude=tuple(fixed)), **nested, **fixed)


def _args(flag: Flag, name: str, value: Any) -> list[str]:
    """The arguments that give the option ``name`` of ``flag`` the value ``value``."""
    if flag.secret or value is None:
        return []
    if "/" in name:
        on, off = name.split("/")
        return [on if value else off]
    if isinstance(value, bool):
        return [name] if value else []
    return [name, repr(value) if isinstance(value, float) else str(value)]


def _shown(cfg: Any, f: dataclasses.Field[Any], flag: Flag) -> Any:
    return flag.show(cfg) if flag.show else getattr(cfg, f.name)


def argv(cfg: Any, *, exclude: tuple[str, ...] = ()) -> list[str]:
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
        out += _args(flag, flag.flag, _shown(cfg, f, flag))
    return out


def _configs(cfg: Any) -> Iterator[Any]:
    """``cfg`` and the configs nested in it, at any depth."""
    yield cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _configs(value)


def command_args(parts: tuple[Part, ...], cfg: Any) -> list[str]:
    """The arguments that give a command made of ``parts`` the values of ``cfg`` and of the
    configs nested in it: each setting the command takes, under its name there. Parts of
    a class that no config here is (the command's own settings) keep their defaults;
    secrets and unset values are left out."""
    found = {type(c): c for c in _configs(cfg)}
    out: list[str] = []
    for part in parts:
        if part.cls in found:
            one = found[part.cls]
            for f, flag, name in part.settings():
                out += _args(flag, name, _shown(one, f, flag))
    return out


def shared(cfg: Any, cls: type) -> dict[str, Any]:
    """The values of ``cfg``'s settings that ``cls`` declares with the very same flag
    (a launch's worker settings are the worker daemon's own): by field name."""
    mine = dict((f.name, flag) for f, flag in declared(type(cfg)))
    return {f.name: getattr(cfg, f.name) for f, flag in declared(cls) if mine.get(f.name) is flag}


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
