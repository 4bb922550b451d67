"""A torchx component: a paramserver cluster as one torchx AppDef, the same ``torchx run``
line on torchx's local, Slurm and Kubernetes schedulers::

    torchx run -s local_cwd paramserver.launchers.torchx:paramserver \\
        --workers 2 --shards 2 -- --dataset synthetic --epochs 1

Two roles: ``server``, ``shards`` replicas of ``paramserver server --shard I/S
--exit-when-done`` (they exit 0 once the run is over and the workers have left, so the app
ends), and ``worker``, ``workers`` replicas of ``paramserver worker``. The arguments after
``--`` are the server's settings of the run (model, data set, policy, epochs, ...: the
server owns the plan). Shard i listens on ``port + 2 * i`` on its host, which the workers
find through the scheduler's variables (``paramserver.cluster.torchx_roles``).

Needs torchx (``pip install torchx-nightly``: its PyPI releases lag its nightly by years).
"""

# no `from __future__ import annotations`: torchx reads the parameters' types
from torchx import specs

from paramserver.cluster.torchx_roles import ENV


def paramserver(
    *server_args: str,
    workers: int = 2,
    shards: int = 1,
    image: str = "paramserver:cpu",
    port: int = 50051,
    device: str = "auto",
    cpu: int = 1,
    memMB: int = 2048,  # noqa: N803 - torchx's own name for it
    server_timeout: int = 300,
    max_retries: int = 0,
) -> specs.AppDef:
    """A paramserver cluster: shard servers and workers that train on the batches they hand out.

    Args:
        server_args: the run's settings for `paramserver server` (--model, --dataset, --policy,
            --epochs, --checkpoint-dir, ...)
        workers: worker replicas (the server's --workers)
        shards: server shards
        image: the image both roles run (local_cwd: ignored, the current folder)
        port: shard 0's gRPC port; shard i listens on port + 2i, its data port one above
        device: the workers' --device (auto, cpu, cuda)
        cpu: CPUs a replica asks for
        memMB: memory a replica asks for, in MB
        server_timeout: seconds a worker waits for the shards to answer at its start
        max_retries: times the scheduler restarts a failed replica
    """
    env = {ENV: f"{specs.macros.rank0_env} {shards} {port}"}
    resource = specs.Resource(cpu=cpu, gpu=0, memMB=memMB)
    server = specs.Role(
        name="server",  # the first role: ${rank0_env} names its replica 0's host
        image=image,
        entrypoint="paramserver",
        args=[
            "server",
            *("--shard", f"{specs.macros.replica_id}/{shards}"),
            *("--workers", str(workers)),
            "--exit-when-done",
            *server_args,
        ],
        env=dict(env),
        num_replicas=shards,
        resource=resource,
        port_map={"grpc": port},
        max_retries=max_retries,
    )
    worker = specs.Role(
        name="worker",
        image=image,
        entrypoint="paramserver",
        args=["worker", "--device", device, "--server-timeout", str(server_timeout)],
        env=dict(env),
        num_replicas=workers,
        resource=resource,
        max_retries=max_retries,
    )
    return specs.AppDef(name="paramserver", roles=[server, worker])
