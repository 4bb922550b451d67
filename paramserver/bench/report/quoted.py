"""The figures README's results block quotes (``readme.py`` renders them): which key of
which benchmark's latest lines, in words, and against which target."""

from __future__ import annotations

from dataclasses import dataclass

GROUPED = ("sparse",)  # docs/bench's sub-folders whose files are benchmarks' lines


@dataclass(frozen=True)
class Figure:
    """One ratio README quotes from a benchmark's latest line."""

    bench: str
    key: str  # a key of the line; "a.b" for a nested key, "a.1" for a list's item
    what: str
    unit: str = " ×"
    target: str = ""  # the line's key holding the figure's target, if it has one
    digits: int = 2  # decimals shown
    loss: bool = False  # the target is a loss at most: the figure is at least -target


FIGURES = (
    Figure(
        "transport",
        "push_vs_tcp",
        "same-host push of 64 MiB (shared memory) vs raw loopback TCP",
        target="target_push_vs_tcp",
    ),
    Figure(
        "transport",
        "push_remote_vs_tcp",
        "push of 64 MiB over the data port (loopback) vs TCP",
        target="target_push_remote_vs_tcp",
    ),
    Figure(
        "step",
        "step_vs_local_64",
        "a worker's step at batch 64 vs a local step (`--overlap off`)",
        target="target_step_vs_local_64",
    ),
    Figure(
        "step",
        "step_vs_local_overlap_256",
        "the same at batch 256, `--overlap on`",
        target="target_step_vs_local_256",
    ),
    Figure(
        "straggler",
        "ps_vs_ddp.async",
        "`async` samples/s vs PyTorch DDP, one of 2 workers slowed",
        target="target_ps_vs_ddp",
    ),
    Figure(
        "scaling",
        "delay1_vs_local.1",
        "2 same-host `delay-1` workers of the MLP vs one local process",
        target="target_2_workers_vs_local",
    ),
    Figure(
        "scaling",
        "delay1_vs_local_all_cores.1",
        "the same vs a local process with a thread per core",
        target="target_2_workers_vs_local_all_cores",
    ),
    Figure(
        "step",
        "step_vs_local_cuda_mlp_64",
        "GPU: a worker's step of the MLP at batch 64 vs a local step",
        target="target_step_vs_local_cuda_mlp_64",
    ),
    Figure(
        "step",
        "step_vs_local_cuda_resnet_256",
        "the same, ResNet at batch 256",
        target="target_step_vs_local_cuda_resnet_256",
    ),
    Figure(
        "step",
        "step_vs_local_cuda_mlp_20m_1024",
        "the same, 20M-parameter MLP at batch 1024",
        target="target_step_vs_local_cuda_mlp_20m_1024",
    ),
    Figure(
        "scaling",
        "async_vs_local_cuda_mlp_64.1",
        "GPU: 2 `async` workers of the MLP sharing it vs one local process",
        target="target_2_workers_vs_local_cuda_mlp_64",
    ),
    Figure(
        "scaling",
        "async_vs_local_cuda_resnet_256.1",
        "the same, ResNet at batch 256",
        target="target_2_workers_vs_local_cuda_resnet_256",
    ),
    Figure(
        "scaling",
        "async_vs_local_cuda_mlp_20m_1024.1",
        "the same, 20M-parameter MLP at batch 1024",
        target="target_2_workers_vs_local_cuda_mlp_20m_1024",
    ),
    Figure(
        "network",
        "local32_int8_time_to_88_vs_ddp_100mbit",
        "local steps (H 32, int8, `sync`) vs DDP at 100 Mbit/s: time to 88%",
        target="target_time_to_88_vs_ddp_100mbit",
    ),
    Figure(
        "network",
        "local32_int8_accuracy_points_vs_ddp_100mbit",
        "the same: accuracy, 6 epochs",
        unit=" points",
        target="target_accuracy_points_vs_ddp_100mbit",
    ),
    Figure(
        "network",
        "local32_int8_time_to_88_vs_ddp_10mbit",
        "the same, 10 Mbit/s: time to 88%",
        target="target_time_to_88_vs_ddp_10mbit",
    ),
    Figure(
        "straggler",
        "local_async_vs_sync",
        "local steps, 1 of 2 workers 3x slower: async/sync samples/s",
        target="target_local_async_vs_sync",
    ),
    Figure(
        "server",
        "sgd_64mib_apply_vs_bound",
        "one shard's SGD apply of 64 MiB pushes vs its memory bound",
        unit="",
        target="target_apply_vs_bound",
    ),
    Figure(
        "server",
        "adam_64mib_apply_vs_bound",
        "the same, Adam",
        unit="",
        target="target_apply_vs_bound",
    ),
    Figure(
        "sparse",
        "auc_minus_ddp",
        "DLRM, 1M-row table, 2 `async` workers: AUC − DDP's",
        unit="",
        target="target_auc_minus_ddp",
        digits=4,
        loss=True,
    ),
    Figure(
        "sparse",
        "sparse_vs_local",
        "the same: samples/s vs one process",
        target="target_sparse_vs_local",
    ),
    Figure(
        "criteo",
        "criteo_auc_delta",
        "Criteo-like DLRM (26 tables), 2 workers: AUC − one process's",
        unit="",
        target="target_criteo_auc_delta",
        digits=4,
        loss=True,
    ),
    Figure(
        "criteo",
        "criteo_sparse_vs_local",
        "the same: samples/s vs one process",
        target="target_criteo_vs_local",
    ),
    Figure(
        "criteo",
        "criteo_push_server_ms",
        "a shard's table work for a Criteo push",
        unit=" ms",
        target="target_criteo_push_server_ms",
    ),
)
