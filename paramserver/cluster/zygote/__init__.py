"""A Python with torch, gRPC and paramserver already imported that forks ``python -m
paramserver ARGS`` children on request: a child is up in a tenth of a second instead of the
seconds of CPU its imports cost (the launcher's starts and restarts, the test suite's
hundreds of start-ups). ``client`` is the caller's end (``Zygote``, ``Forked``), ``fork``
the zygote's.

The zygote is a single-threaded child of its caller that has imported modules and done
nothing else (no gRPC channel, no torch op, no thread), so a fork of it is as clean as a
fresh interpreter. A request carries the argv, the environment, the working folder, the
network namespace and the child's stdin, stdout and stderr (passed over a Unix socket);
the child puts them in place, sets ``sys.path`` and numpy's seed as a fresh interpreter
would, and runs ``paramserver`` as ``__main__``; its exit is an interpreter's (threads
joined, atexit run, streams flushed). The pid is the real process: kill -9, SIGSTOP and
/proc act on it; the caller signals it through a pidfd and learns its exit code from the
zygote, which reaps it.

What differs from an exec: /proc/PID/cmdline is the zygote's; what is read only when the
interpreter or a library loads (``PYTHONHASHSEED``, ``OMP_NUM_THREADS``) keeps the zygote's
value (paramserver sets its thread counts itself); modules come from the paths the caller
had when the zygote started.

May import: ``errors``. Nothing else of paramserver (its children import what they run).
"""

from paramserver.cluster.zygote.client import PRELOAD, Forked, Zygote, ZygoteLost

__all__ = ["PRELOAD", "Forked", "Zygote", "ZygoteLost"]
