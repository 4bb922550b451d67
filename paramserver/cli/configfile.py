"""``--config FILE``: a TOML file with a table per command (``[server]``, ``[worker]``, ...)
whose keys are the command's option names (``lr = 0.01``, ``checkpoint-dir = "/ckpt"``;
``checkpoint_dir`` too), and before the first table the group's own (``log-level``). Each
key and value is checked as the command line would check it, in every table, so that a
mistake names the file, the key and the value. And ``--print-config``'s output: the
resolved settings in the same form, each with where it came from. Torch-free.
"""

from __future__ import annotations

import datetime
import difflib
import importlib
import json
import re
from dataclasses import dataclass
from typing import Any

import click
from click.core import ParameterSource

from paramserver.settings import SettingOption


@dataclass(frozen=True)
class Entry:
    """One key of the file: as written, and the option's value it gives."""

    key: str
    raw: Any
    value: Any


@dataclass(frozen=True)
class Values:
    """What a config file gives one command: ``top`` (the group's settings) and ``own``
    (its table's), by click parameter name."""

    path: str
    table: str
    top: dict[str, Entry]
    own: dict[str, Entry]

    def defaults(self) -> dict[str, Any]:
        """The command's settings as click's default map."""
        return {name: entry.value for name, entry in self.own.items()}


def toml(value: Any) -> str:
    """``value`` written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


MAX_BYTES = 1 << 20  # the largest config file read: settings are a few hundred bytes
SHOWN = 80  # characters of a value an error message quotes


def cut(text: str, limit: int = SHOWN) -> str:
    """``text``, or its first ``limit`` characters and how long it was: an error quotes
    what it names, never a whole 20 MiB string."""
    return text if len(text) <= limit else f"{text[: limit - 10]}... ({len(text)} characters)"


def shown(value: Any) -> str:
    """``value`` as TOML for a message, cut to ``SHOWN`` characters."""
    return cut(toml(value))


def _fail(path: str, message: str) -> click.UsageError:
    return click.UsageError(f"{path}: {cut(message, 8 * SHOWN)}")  # click's quote values whole


def read(path: str) -> dict[str, Any]:
    """The TOML document at ``path``.

    Raises:
        click.UsageError: it cannot be read or is not TOML.
    """
    for name in ("tomllib", "tomli"):  # the standard library's from Python 3.11
        try:
            parser: Any = importlib.import_module(name)
            break
        except ModuleNotFoundError:
            continue
    else:
        raise _fail(path, "a config file needs Python 3.11 or later (tomllib), or tomli.")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise _fail(path, f"cannot be read: {exc.strerror}.") from None
    if len(raw) > MAX_BYTES:
        raise _fail(path, f"is larger than {MAX_BYTES >> 20} MiB: not a config file.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(
            path, f"is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})."
        ) from None
    try:
        doc: dict[str, Any] = parser.loads(text)
    except parser.TOMLDecodeError as exc:
        raise _fail(path, f"is not TOML: {exc}.") from None
    except RecursionError:
        raise _fail(path, "is not TOML a config can be: its values nest too deep.") from None
    return doc


def options(command: click.Command) -> dict[str, SettingOption]:
    """The options a file may set for ``command``, by key: each option's name without the
    dashes in front (``--config`` and ``--print-config`` are not among them)."""
    return {
        p.opts[0].lstrip("-"): p
        for p in command.params
        if isinstance(p, SettingOption) and p.expose_value
    }


def load(path: str, ctx: click.Context, group: click.Group) -> Values:
    """What the file at ``path`` gives ``ctx``'s command, once every table of it is found
    to be a command's and every key one of its options, with a value that option takes.

    Raises:
        click.UsageError: naming the file, the key (or table) and the value.
    """
    top, tables = {}, {}
    for key, value in read(path).items():
        if not isinstance(value, dict):
            top[key] = value
        elif key in group.commands:
            tables[key] = _check(path, f"[{key}] ", value, group.commands[key], ctx)
        else:
            known = ", ".join(f"[{name}]" for name in sorted(group.commands))
            raise _fail(
                path, f"[{key}] = {shown(value)}: unknown table; a table is a command's: {known}."
            )
    name = str(ctx.command.name)
    return Values(path, name, _check(path, "", top, group, ctx), tables.get(name, {}))


def _check(
    path: str, where: str, entries: dict[str, Any], command: click.Command, ctx: click.Context
) -> dict[str, Entry]:
    known = options(command)
    out: dict[str, Entry] = {}
    for key, raw in entries.items():
        param = known.get(key.replace("_", "-"))
        if param is None:
            close = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            if where:
                why = f"paramserver {command.name} has no option --{key}"
            else:
                why = "before the first table go only paramserver's own options (log-level)"
            hint = f"; did you mean {close[0]}?" if close else "."
            raise _fail(path, f"{where}{cut(key)} = {shown(raw)}: unknown key: {why}{hint}")
        if param.name in out:
            raise _fail(
                path,
                f"{where}{key} = {shown(raw)}: given twice, as {out[str(param.name)].key} too.",
            )
        out[str(param.name)] = Entry(key, raw, _convert(path, where, key, raw, param, ctx))
    return out


def _convert(
    path: str, where: str, key: str, raw: Any, param: SettingOption, ctx: click.Context
) -> Any:
    """``raw`` as ``param`` takes it: what the command line's conversion gives, with TOML's
    types kept apart (a switch takes true or false, a whole number no fraction)."""

    def bad(why: str) -> click.UsageError:
        return _fail(path, f"{where}{key} = {shown(raw)}: {why}")

    if isinstance(raw, dict | list | datetime.date | datetime.time):
        raise bad("takes one value: a string, a number, or true or false.")
    if param.is_bool_flag != isinstance(raw, bool):
        raise bad("takes true or false." if param.is_bool_flag else "takes a value, not a switch.")
    if isinstance(param.type, click.types.IntParamType) and isinstance(raw, float):
        raise bad(f"{raw!r} is not a valid integer.")
    try:
        return param.type_cast_value(ctx, raw)
    except click.BadParameter as exc:
        raise bad(exc.message) from None


def source(ctx: click.Context, param: click.Parameter, file: Values | None) -> str:
    """Where ``param``'s value in ``ctx`` came from (click's record)."""
    got = ctx.get_parameter_source(str(param.name))
    if got is ParameterSource.COMMANDLINE:
        return "command line"
    if got is ParameterSource.ENVIRONMENT:
        return f"env {param.envvar}"
    if got is ParameterSource.DEFAULT_MAP and file is not None:
        return f"file {file.path}"
    return "default"


def group_setting(ctx: click.Context, file: Values | None, name: str) -> tuple[Any, str] | None:
    """The group's setting ``name`` (``paramserver --log-level ...``) and its source: the
    file's where the command line and the variable left it at its default."""
    parent = ctx.find_root()  # the paramserver group, above ``checkpoint`` too
    if parent is ctx or name not in parent.params:
        return None
    param = next(p for p in parent.command.params if p.name == name)
    value, where = parent.params[name], source(parent, param, None)
    if where == "default" and file is not None and name in file.top:
        return file.top[name].value, f"file {file.path}"
    return value, where


def blame(
    ctx: click.Context, file: Values | None, sources: dict[str, str], message: str
) -> str | None:
    """``message`` (a setting's refusal) as the file's fault, if it names an option
    whose value came from the file; else None."""
    if file is None:
        return None
    for name, entry in file.own.items():
        param = next(p for p in ctx.command.params if p.name == name)
        if name in sources or ctx.get_parameter_source(name) is not ParameterSource.DEFAULT_MAP:
            continue
        if re.search(re.escape(param.opts[0]) + r"(?![\w-])", message):
            why = cut(message, 8 * SHOWN)
            return f"{file.path}: [{file.table}] {entry.key} = {shown(entry.raw)}: {why}"
    return None


def _line(key: str, value: Any, secret: bool) -> str:
    if secret:
        return f"# {key}: {'set, not shown' if value else 'unset'}"
    return f"# {key}: unset" if value is None else f"{key} = {toml(value)}"


def render(ctx: click.Context, file: Values | None, sources: dict[str, str]) -> str:
    """``--print-config``: every setting of ``ctx``'s command (and its group's) as
    resolved, written as a config file of one table, each line saying where the value came
    from: the command line, a variable, the file, the default, or what the command worked
    out (a model's defaults, TF_CONFIG, ...). Secrets are not shown; unset ones are
    comments."""
    rows: list[tuple[str, str]] = []
    if ctx.parent is not None:
        for key, param in options(ctx.find_root().command).items():
            found = group_setting(ctx, file, str(param.name))
            if found is not None:
                rows.append((_line(key, found[0], param.setting.secret), found[1]))
    rows.append(("", ""))
    rows.append((f"[{ctx.command.name}]", ""))
    for key, param in options(ctx.command).items():
        name = str(param.name)
        where = sources.get(name) or source(ctx, param, file)
        rows.append((_line(key, ctx.params[name], param.setting.secret), where))
    width = min(40, max(len(text) for text, where in rows if where))
    head = f"# paramserver {ctx.command.name}: the settings as resolved, and where each came from"
    lines = [head] + [f"{text:<{width}}  # {where}" if where else text for text, where in rows]
    return "\n".join(lines)
