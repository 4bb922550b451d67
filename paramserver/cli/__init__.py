"""Command line: ``paramserver server | worker | launch | status | health | plot | export |
bench``. ``main`` is the group and the entry point, ``run`` the commands that train,
``inspect`` those that look at a server, a run or the code, ``options`` a command made of
the settings declarations with ``--config FILE`` and ``--print-config``, ``configfile`` the
file and the printout, ``flags`` the settings that only the command line has, and
``statusview`` the status table.

Every option can also be set through the ``PARAMSERVER_*`` variable shown in its help, or
in a config file: the command line wins over the variables, they over the file, and the
file over the defaults.

May import: every package (it is the top of the layering); nothing imports it but
``__main__``.
"""

from __future__ import annotations

from paramserver.cli.inspect import bench, export, health, plot, status
from paramserver.cli.main import cli, main
from paramserver.cli.options import fill_defaults
from paramserver.cli.run import (
    launch,
    model_defaults,
    security_config,
    server,
    server_config,
    worker,
)

__all__ = [
    "bench",
    "cli",
    "export",
    "fill_defaults",
    "health",
    "launch",
    "main",
    "model_defaults",
    "plot",
    "security_config",
    "server",
    "server_config",
    "status",
    "worker",
]
