"""The ``paramserver`` group and its entry point: every command of ``run`` and ``inspect``,
``--log-level`` before them, and errors as one line on stderr with a non-zero exit.
"""

from __future__ import annotations

import logging
import sys

import click

from paramserver import settings
from paramserver.cli import inspect, run
from paramserver.cli.flags import Logging
from paramserver.errors import ConfigError, DataUnavailable, ParamServerError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@settings.options(Logging)
@click.version_option(package_name="paramserver")
def cli(log_level: str) -> None:
    """An asynchronous parameter server for data-parallel PyTorch training."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


for _command in (
    run.server,
    run.worker,
    run.launch,
    run.chaos,
    inspect.status,
    inspect.health,
    inspect.plot,
    inspect.export,
    inspect.checkpoint,
    inspect.bench,
):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors become one line on stderr and a non-zero exit."""
    from paramserver.cluster.procs import die_with_parent_if_asked

    die_with_parent_if_asked()
    try:
        cli.main(args=argv, prog_name="paramserver", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("paramserver: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"paramserver: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (ConfigError, DataUnavailable) as exc:
        click.echo(f"paramserver: error: {exc}", err=True)
        sys.exit(2)
    except ParamServerError as exc:
        click.echo(f"paramserver: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("paramserver: interrupted", err=True)
        sys.exit(130)
