"""Running many processes as one job: ``launch`` (the local cluster of ``paramserver
launch`` and ``make run``), ``commands`` (each command's settings, and a child's argv from
its config), ``procs`` (children started, watched for readiness and always stopped; ``python -m``
ones forked from ``zygote``, an interpreter that has imported torch and the package),
``roles`` (a process's role and shard from Slurm, Kubernetes or compose variables),
``rundir`` (a run's folder of logs and files) and ``netns`` (hosts in network namespaces
with shaped links, for the network bench and the compose test).

May import: ``server``, ``worker``, ``training``, ``transport`` and everything below them.
Never ``bench`` or ``cli``.
"""
