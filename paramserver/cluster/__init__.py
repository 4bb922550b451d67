"""Running many processes as one job: ``launch`` (the local cluster of ``paramserver
launch`` and ``make run``), ``procs`` (children started, watched for readiness and always
stopped), ``roles`` (a process's role and shard from Slurm, Kubernetes or compose
variables) and ``rundir`` (a run's folder of logs and files).

May import: ``server``, ``worker``, ``training``, ``transport`` and everything below them.
Never ``bench`` or ``cli``.
"""
