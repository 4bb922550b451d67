"""A command whose options all derive from the settings declarations (``command``), and the
two options every command adds to them: ``--config FILE``, its table of a TOML file, under
the command line and the ``PARAMSERVER_*`` variables and over the defaults; and
``--print-config``, the settings as resolved, each with where it came from. What a command
works out itself for what no source gave (a model's defaults, TF_CONFIG, ``--shard auto``,
launch's schedule length) goes through ``fill_defaults`` and ``derived``, which record it.
Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
from click.core import ParameterSource

from paramserver import settings
from paramserver.cli.configfile import Values, blame, group_setting, load, render
from paramserver.cli.flags import ConfigFile, Logging
from paramserver.errors import ConfigError

F = Callable[..., Any]
_META = "paramserver.resolution"  # the key of this invocation's Resolution in ctx.meta


@dataclass
class Resolution:
    """What became of one command's settings beyond click's own record of their sources."""

    file: Values | None = None  # what --config FILE gave
    printing: bool = False  # --print-config
    sources: dict[str, str] = field(default_factory=dict)  # by parameter: the command's own


def resolution(ctx: click.Context) -> Resolution:
    found: Resolution = ctx.meta.setdefault(_META, Resolution())
    return found


def _group(ctx: click.Context) -> click.Group:
    """The command group this command runs under (every command's table of a file is
    checked against it); a command run on its own stands alone."""
    root = ctx.find_root().command
    if isinstance(root, click.Group):
        return root
    return click.Group(commands=[root])


def _read_file(ctx: click.Context, _param: click.Parameter, path: str | None) -> None:
    """``--config FILE``: checks the whole file, then makes the command's table the
    defaults that the command line and the variables override (click's default map)."""
    if path is None:
        return
    values = load(path, ctx, _group(ctx))
    ctx.default_map = {**(ctx.default_map or {}), **values.defaults()}
    resolution(ctx).file = values


def _set_printing(ctx: click.Context, _param: click.Parameter, on: bool) -> None:
    resolution(ctx).printing = bool(on)


def _set_log_level(ctx: click.Context, param: click.Parameter, level: str | None) -> None:
    """``--log-level`` after the command: the group's setting, given on the command line
    there (``paramserver server --log-level debug`` as ``paramserver --log-level debug
    server``). Its variable is the group's, which the group has read already."""
    if (
        level is None
        or ctx.get_parameter_source(str(param.name)) is not ParameterSource.COMMANDLINE
    ):
        return
    logging.getLogger().setLevel(level.upper())
    parent = ctx.find_root()  # the paramserver group, above ``checkpoint`` too
    if parent is not ctx and "log_level" in parent.params:
        parent.params["log_level"] = level
        parent.set_parameter_source("log_level", ParameterSource.COMMANDLINE)


class SettingsCommand(click.Command):
    """A command made by ``command``: the file's ``log-level`` applies where the group's
    came from no other source, and a ConfigError that names an option whose value came from
    the file becomes a usage error naming the file, the key and the value. An option this
    command lacks but another owns (``elsewhere``: option -> sentence) is refused with that
    sentence, not click's guess at a near name."""

    elsewhere: dict[str, str] = {}  # noqa: RUF012 - set per command by ``command``

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            said = self.elsewhere.get(exc.option_name)
            if said is None:
                raise
            raise click.UsageError(said, ctx) from None

    def invoke(self, ctx: click.Context) -> Any:
        res = resolution(ctx)
        level = group_setting(ctx, res.file, "log_level")
        if level is not None and level[1].startswith("file "):  # the group set the rest
            logging.getLogger().setLevel(str(level[0]).upper())
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            blamed = blame(ctx, res.file, res.sources, str(exc))
            if blamed is None:
                raise
            raise click.UsageError(blamed, ctx) from None


def command(
    *parts: settings.Part | type, elsewhere: dict[str, str] | None = None, **attrs: Any
) -> Callable[[F], click.Command]:
    """A click command with an option for every setting of ``parts`` (in order), then
    ``--config`` and ``--print-config``; its arguments are the function's own.
    ``elsewhere``: options another command owns, and the sentence that says so."""
    own = {f.name: (f, flag) for f, flag in settings.declared(ConfigFile)}

    def decorate(func: F) -> click.Command:
        f, flag = own["print_config"]
        func = settings.option(
            f, flag, flag.flag, False, expose_value=False, callback=_set_printing
        )(func)
        f, flag = own["config"]
        func = settings.option(
            f, flag, flag.flag, None, expose_value=False, is_eager=True, callback=_read_file
        )(func)
        func = settings.options(*parts)(func)
        f, flag = next(settings.declared(Logging))
        func = settings.option(
            f, flag, flag.flag, None, expose_value=False, callback=_set_log_level
        )(func)
        made = click.command(cls=SettingsCommand, **attrs)(func)
        made.elsewhere = dict(elsewhere or {})  # type: ignore[attr-defined]
        return made

    return decorate


def fill_defaults(kw: dict[str, Any], values: dict[str, Any], source: str = "derived") -> None:
    """Set in ``kw`` each of ``values`` (by click parameter name) that no source gave (the
    command line, its variable and the config file left it at its default)."""
    ctx = click.get_current_context()
    res = resolution(ctx)
    for name, value in values.items():
        if ctx.get_parameter_source(name) is ParameterSource.DEFAULT and name not in res.sources:
            derived(kw, name, value, source)


def derived(kw: dict[str, Any], name: str, value: Any, source: str) -> None:
    """Set ``name`` in ``kw`` to what the command worked out from ``source``."""
    ctx = click.get_current_context()
    kw[name] = ctx.params[name] = value
    resolution(ctx).sources[name] = source


def printed() -> bool:
    """With ``--print-config``: print the settings as resolved and say so (the command
    then returns without starting anything)."""
    ctx = click.get_current_context()
    res = resolution(ctx)
    if res.printing:
        click.echo(render(ctx, res.file, res.sources))
    return res.printing
