from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "nbytes", "role")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    nbytes: int
    role: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "total_bytes", "dtype", "tables")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    dtype: str
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "rows", "dim", "dtype", "optimizer", "lr", "init")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    dim: int
    dtype: str
    optimizer: str
    lr: float
    init: str
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., init: _Optional[str] = ...) -> None: ...

class RowGradients(_message.Message):
    __slots__ = ("table", "ids", "values", "shm", "shm_offset")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    values: bytes
    shm: bool
    shm_offset: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ..., shm: _Optional[bool] = ..., shm_offset: _Optional[int] = ...) -> None: ...

class RowsRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "table", "ids", "more", "shm", "shm_stamp")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_STAMP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    table: str
    ids: bytes
    more: _containers.RepeatedCompositeFieldContainer[TableIds]
    shm: bool
    shm_stamp: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., table: _Optional[str] = ..., ids: _Optional[bytes] = ..., more: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., shm: _Optional[bool] = ..., shm_stamp: _Optional[int] = ...) -> None: ...

class TableIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class RowsResponse(_message.Message):
    __slots__ = ("values", "more", "low_clock", "shm", "shm_sizes")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    LOW_CLOCK_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZES_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    more: _containers.RepeatedScalarFieldContainer[bytes]
    low_clock: int
    shm: bool
    shm_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[bytes] = ..., more: _Optional[_Iterable[bytes]] = ..., low_clock: _Optional[int] = ..., shm: _Optional[bool] = ..., shm_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TrainingPlan(_message.Message):
    __slots__ = ("model", "dataset", "batch_size", "epochs", "seed", "world_size", "loss")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dataset: str
    batch_size: int
    epochs: int
    seed: int
    world_size: int
    loss: str
    def __init__(self, model: _Optional[str] = ..., dataset: _Optional[str] = ..., batch_size: _Optional[int] = ..., epochs: _Optional[int] = ..., seed: _Optional[int] = ..., world_size: _Optional[int] = ..., loss: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("name", "worker_id", "train_samples", "shm_name", "shm_nonce", "shm_slots", "shm_rows_bytes", "join_id", "past_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    SHM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHM_ROWS_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOIN_ID_FIELD_NUMBER: _ClassVar[int]
    PAST_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    worker_id: str
    train_samples: int
    shm_name: str
    shm_nonce: bytes
    shm_slots: int
    shm_rows_bytes: int
    join_id: str
    past_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., worker_id: _Optional[str] = ..., train_samples: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_nonce: _Optional[bytes] = ..., shm_slots: _Optional[int] = ..., shm_rows_bytes: _Optional[int] = ..., join_id: _Optional[str] = ..., past_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("worker_id", "rank", "clock", "manifest", "plan", "policy", "lease_seconds", "chunk_bytes", "incarnation", "shm", "shard", "shards", "model_numel", "shard_offset", "shm_control", "data_port", "data_nonce", "origin", "relay_norm", "push_norm")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NUMEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_CONTROL_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_NONCE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RELAY_NORM_FIELD_NUMBER: _ClassVar[int]
    PUSH_NORM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: int
    clock: int
    manifest: Manifest
    plan: TrainingPlan
    policy: str
    lease_seconds: float
    chunk_bytes: int
    incarnation: str
    shm: bool
    shard: int
    shards: int
    model_numel: int
    shard_offset: int
    shm_control: str
    data_port: int
    data_nonce: bytes
    origin: str
    relay_norm: bool
    push_norm: bool
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., clock: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., plan: _Optional[_Union[TrainingPlan, _Mapping]] = ..., policy: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., incarnation: _Optional[str] = ..., shm: _Optional[bool] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ..., model_numel: _Optional[int] = ..., shard_offset: _Optional[int] = ..., shm_control: _Optional[str] = ..., data_port: _Optional[int] = ..., data_nonce: _Optional[bytes] = ..., origin: _Optional[str] = ..., relay_norm: _Optional[bool] = ..., push_norm: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "iteration", "incarnation", "shm", "batches", "common_cut", "dtype", "exact", "ahead")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    COMMON_CUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    iteration: int
    incarnation: str
    shm: bool
    batches: int
    common_cut: int
    dtype: str
    exact: int
    ahead: bool
    def __init__(self, worker_id: _Optional[str] = ..., iteration: _Optional[int] = ..., incarnation: _Optional[str] = ..., shm: _Optional[bool] = ..., batches: _Optional[int] = ..., common_cut: _Optional[int] = ..., dtype: _Optional[str] = ..., exact: _Optional[int] = ..., ahead: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "staleness", "total_bytes", "batch", "finished", "shm", "batches", "cut_written", "dtype", "exact", "iteration", "next_batches")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    CUT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    version: int
    staleness: int
    total_bytes: int
    batch: int
    finished: bool
    shm: bool
    batches: _containers.RepeatedScalarFieldContainer[int]
    cut_written: int
    dtype: str
    exact: int
    iteration: int
    next_batches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., staleness: _Optional[int] = ..., total_bytes: _Optional[int] = ..., batch: _Optional[int] = ..., finished: _Optional[bool] = ..., shm: _Optional[bool] = ..., batches: _Optional[_Iterable[int]] = ..., cut_written: _Optional[int] = ..., dtype: _Optional[str] = ..., exact: _Optional[int] = ..., iteration: _Optional[int] = ..., next_batches: _Optional[_Iterable[int]] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "iteration", "total_bytes", "samples", "loss", "incarnation", "empty", "dtype", "shard", "shm", "shm_slot", "rows", "row_cache_hits", "row_cache_misses", "row_chunks", "batches", "exact", "topk", "scale_block", "idle", "norm_sq")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_SLOT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ROW_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    SCALE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    NORM_SQ_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    iteration: int
    total_bytes: int
    samples: int
    loss: float
    incarnation: str
    empty: bool
    dtype: str
    shard: int
    shm: bool
    shm_slot: int
    rows: _containers.RepeatedCompositeFieldContainer[RowGradients]
    row_cache_hits: int
    row_cache_misses: int
    row_chunks: int
    batches: _containers.RepeatedScalarFieldContainer[int]
    exact: int
    topk: int
    scale_block: int
    idle: _containers.RepeatedScalarFieldContainer[int]
    norm_sq: float
    def __init__(self, worker_id: _Optional[str] = ..., iteration: _Optional[int] = ..., total_bytes: _Optional[int] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., incarnation: _Optional[str] = ..., empty: _Optional[bool] = ..., dtype: _Optional[str] = ..., shard: _Optional[int] = ..., shm: _Optional[bool] = ..., shm_slot: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowGradients, _Mapping]]] = ..., row_cache_hits: _Optional[int] = ..., row_cache_misses: _Optional[int] = ..., row_chunks: _Optional[int] = ..., batches: _Optional[_Iterable[int]] = ..., exact: _Optional[int] = ..., topk: _Optional[int] = ..., scale_block: _Optional[int] = ..., idle: _Optional[_Iterable[int]] = ..., norm_sq: _Optional[float] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data", "rows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    rows: RowGradients
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., rows: _Optional[_Union[RowGradients, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "clock", "duplicate")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    version: int
    clock: int
    duplicate: bool
    def __init__(self, version: _Optional[int] = ..., clock: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    pull: PullRequest
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: PushResponse
    pull: PullHeader
    def __init__(self, push: _Optional[_Union[PushResponse, _Mapping]] = ..., pull: _Optional[_Union[PullHeader, _Mapping]] = ...) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("round", "incarnation", "worker_id", "cause")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    round: int
    incarnation: str
    worker_id: str
    cause: str
    def __init__(self, round: _Optional[int] = ..., incarnation: _Optional[str] = ..., worker_id: _Optional[str] = ..., cause: _Optional[str] = ...) -> None: ...

class RewindResponse(_message.Message):
    __slots__ = ("version", "incarnation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    incarnation: str
    def __init__(self, version: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StepNormRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "round", "has_total", "total")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HAS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    round: int
    has_total: bool
    total: float
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., round: _Optional[int] = ..., has_total: _Optional[bool] = ..., total: _Optional[float] = ...) -> None: ...

class StepNormResponse(_message.Message):
    __slots__ = ("part", "closed", "applied", "round", "last_round", "last_total")
    PART_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_TOTAL_FIELD_NUMBER: _ClassVar[int]
    part: float
    closed: bool
    applied: bool
    round: int
    last_round: int
    last_total: float
    def __init__(self, part: _Optional[float] = ..., closed: _Optional[bool] = ..., applied: _Optional[bool] = ..., round: _Optional[int] = ..., last_round: _Optional[int] = ..., last_total: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "finished", "incarnation", "returning")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RETURNING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    finished: bool
    incarnation: str
    returning: bool
    def __init__(self, worker_id: _Optional[str] = ..., finished: _Optional[bool] = ..., incarnation: _Optional[str] = ..., returning: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "name", "rank", "clock", "last_seen_seconds", "samples", "samples_per_second", "lag", "row_cache_hits", "row_cache_misses")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    rank: int
    clock: int
    last_seen_seconds: float
    samples: int
    samples_per_second: float
    lag: int
    row_cache_hits: int
    row_cache_misses: int
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., clock: _Optional[int] = ..., last_seen_seconds: _Optional[float] = ..., samples: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., lag: _Optional[int] = ..., row_cache_hits: _Optional[int] = ..., row_cache_misses: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "policy", "workers", "pushes_applied", "bytes_in", "bytes_out", "max_staleness", "staleness_histogram", "samples", "train_loss", "train_seconds", "incarnation", "model", "world_size", "workers_joined", "workers_expired", "uptime_seconds", "learning_rate", "batches_done", "batches_total", "pushes_skipped", "duplicates", "checkpoint_version", "checkpoint_age_seconds", "min_workers", "rounds", "pulls_answered", "barrier_wait_seconds", "rows_held", "rows_pulled", "rows_pushed", "checkpoint_failures", "checkpoint_failing_seconds", "checkpoint_error", "cuts_pending", "cut_written", "batches_applied", "pushes_repeated", "pushes_late", "pushes_coalesced", "apply_failures", "table_rows", "table_admitted", "table_evicted", "table_dropped", "table_reborn", "pushes_compensated", "pushes_uncompensated", "tested_epoch", "test_accuracy", "test_loss", "test_auc", "evaluation_failures", "test_perplexity")
    class StalenessHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class TableRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TableAdmittedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TableEvictedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TableDroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TableRebornEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_JOINED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DONE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUSHES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PULLS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    BARRIER_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    CUTS_PENDING_FIELD_NUMBER: _ClassVar[int]
    CUT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BATCHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REPEATED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_LATE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_COALESCED_FIELD_NUMBER: _ClassVar[int]
    APPLY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TABLE_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TABLE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    TABLE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TABLE_REBORN_FIELD_NUMBER: _ClassVar[int]
    PUSHES_COMPENSATED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_UNCOMPENSATED_FIELD_NUMBER: _ClassVar[int]
    TESTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TEST_AUC_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TEST_PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    version: int
    policy: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    pushes_applied: int
    bytes_in: int
    bytes_out: int
    max_staleness: int
    staleness_histogram: _containers.ScalarMap[int, int]
    samples: int
    train_loss: float
    train_seconds: float
    incarnation: str
    model: str
    world_size: int
    workers_joined: int
    workers_expired: int
    uptime_seconds: float
    learning_rate: float
    batches_done: int
    batches_total: int
    pushes_skipped: int
    duplicates: int
    checkpoint_version: int
    checkpoint_age_seconds: float
    min_workers: int
    rounds: int
    pulls_answered: int
    barrier_wait_seconds: float
    rows_held: int
    rows_pulled: int
    rows_pushed: int
    checkpoint_failures: int
    checkpoint_failing_seconds: float
    checkpoint_error: str
    cuts_pending: int
    cut_written: int
    batches_applied: int
    pushes_repeated: int
    pushes_late: int
    pushes_coalesced: int
    apply_failures: int
    table_rows: _containers.ScalarMap[str, int]
    table_admitted: _containers.ScalarMap[str, int]
    table_evicted: _containers.ScalarMap[str, int]
    table_dropped: _containers.ScalarMap[str, int]
    table_reborn: _containers.ScalarMap[str, int]
    pushes_compensated: int
    pushes_uncompensated: int
    tested_epoch: int
    test_accuracy: float
    test_loss: float
    test_auc: float
    evaluation_failures: int
    test_perplexity: float
    def __init__(self, version: _Optional[int] = ..., policy: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., pushes_applied: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., max_staleness: _Optional[int] = ..., staleness_histogram: _Optional[_Mapping[int, int]] = ..., samples: _Optional[int] = ..., train_loss: _Optional[float] = ..., train_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ..., model: _Optional[str] = ..., world_size: _Optional[int] = ..., workers_joined: _Optional[int] = ..., workers_expired: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., learning_rate: _Optional[float] = ..., batches_done: _Optional[int] = ..., batches_total: _Optional[int] = ..., pushes_skipped: _Optional[int] = ..., duplicates: _Optional[int] = ..., checkpoint_version: _Optional[int] = ..., checkpoint_age_seconds: _Optional[float] = ..., min_workers: _Optional[int] = ..., rounds: _Optional[int] = ..., pulls_answered: _Optional[int] = ..., barrier_wait_seconds: _Optional[float] = ..., rows_held: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., checkpoint_failures: _Optional[int] = ..., checkpoint_failing_seconds: _Optional[float] = ..., checkpoint_error: _Optional[str] = ..., cuts_pending: _Optional[int] = ..., cut_written: _Optional[int] = ..., batches_applied: _Optional[int] = ..., pushes_repeated: _Optional[int] = ..., pushes_late: _Optional[int] = ..., pushes_coalesced: _Optional[int] = ..., apply_failures: _Optional[int] = ..., table_rows: _Optional[_Mapping[str, int]] = ..., table_admitted: _Optional[_Mapping[str, int]] = ..., table_evicted: _Optional[_Mapping[str, int]] = ..., table_dropped: _Optional[_Mapping[str, int]] = ..., table_reborn: _Optional[_Mapping[str, int]] = ..., pushes_compensated: _Optional[int] = ..., pushes_uncompensated: _Optional[int] = ..., tested_epoch: _Optional[int] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., test_auc: _Optional[float] = ..., evaluation_failures: _Optional[int] = ..., test_perplexity: _Optional[float] = ...) -> None: ...
