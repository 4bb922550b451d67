"""A run's report after each epoch, for ``launch`` and for ``paramserver server`` alike:
load the global model, evaluate it on the test set, append a line to the run folder's
metrics.jsonl, and at the end draw curve.png and write summary.json.

Where the weights come from is a ``Source``: ``launch`` reads its shards as an observer
(``cluster/reading.py``), a server reads its own state in process
(``cluster/server_evaluation.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.rundir import RunDir
from paramserver.codec import layout
from paramserver.codec.rows import TableSpec
from paramserver.config import ServerConfig
from paramserver.errors import ParamServerError
from paramserver.policy.staleness import Policy
from paramserver.sparse.embedding import TableEmbedding, make_tables
from paramserver.training import data, losses
from paramserver.training.evaluation import Evaluation, evaluate_batches
from paramserver.training.figures import figures, finite

log = logging.getLogger(__name__)


class Source(Protocol):
    """Where a run's figures come from."""

    def status(self) -> pb.StatusResponse: ...

    def weights(self, manifest: layout.Manifest) -> tuple[int, np.ndarray]:
        """The current version and its flat weights (every shard's)."""
        ...


@dataclasses.dataclass
class Job:
    """What a run trains, read and checked before any process starts or any call is served."""

    dataset: data.Data
    model: torch.nn.Module
    state: tuple[layout.Manifest, list[torch.Tensor]]  # ``models.state(model)``
    specs: list[TableSpec]
    per_epoch: int
    loss: losses.Loss | None = None  # --loss; None: cross-entropy (its perplexity too)

    @classmethod
    def prepare(cls, scfg: ServerConfig, data_dir: str | None) -> Job:
        dataset = data.load(scfg.dataset, data_dir, seed=scfg.seed)
        model = models.build(scfg.model)
        make_tables(model, scfg.table_rows)  # as the servers do
        state = models.state(model)  # refuses a model it cannot carry
        per_epoch = data.batches_per_epoch(dataset.train_size, scfg.batch_size)
        if per_epoch < 1:
            raise ParamServerError(
                f"{dataset.train_size} samples do not make one batch of {scfg.batch_size}."
            )
        loss = losses.resolve(scfg.loss) if scfg.loss else None  # refused here if bad
        return cls(dataset, model, state, models.table_specs(model), per_epoch, loss)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One epoch's line, and what it was read from."""

    status: pb.StatusResponse
    version: int
    evaluation: Evaluation


class EpochReport:
    """The run folder's figures, one line an epoch.

    Args:
        run: the run folder.
        job: the model (its tables already attached to the source's reader) and test set.
        source: the run's status and weights.
        say: where each epoch's line goes (a log, or a line above a progress bar).
    """

    def __init__(
        self,
        run: RunDir,
        job: Job,
        source: Source,
        say: Callable[[str], None] = log.info,
        t0: float | None = None,
    ):
        self.run, self.job, self.source, self.say = run, job, source, say
        self.t0 = time.perf_counter() if t0 is None else t0

    def resumed(self, st: pb.StatusResponse, epochs: int, where: str) -> int:
        """The epochs a resumed run (``where``: its checkpoints) had completed, said once:
        they are not evaluated again."""
        if not st.batches_done:
            return 0
        per_epoch = self.job.per_epoch
        done = st.batches_done // per_epoch
        log.info(
            "resumed from %s: %d of %d batches done, in epoch %d of %d",
            where,
            st.batches_done,
            epochs * per_epoch,
            min(done + 1, epochs),
            epochs,
        )
        return min(done, epochs - 1)

    def record(self, epoch: int) -> Recorded:
        """Load the run's current weights and buffers into the job's model, evaluate it,
        append a metrics line and say it."""
        model, dataset = self.job.model, self.job.dataset
        manifest, tensors = self.job.state
        st = self.source.status()
        version, flat = self.source.weights(manifest)
        layout.unflatten_into(manifest, torch.from_numpy(flat), tensors)
        for module in model.modules():
            if isinstance(module, TableEmbedding):
                module.forget()  # so that the evaluation reads the tables' current rows
        result = evaluate_batches(model, dataset.test_batches(2000), self.job.loss)
        acc, loss, area, perplexity = result
        self.run.append_metrics(
            {
                "epoch": epoch,
                "test_accuracy": finite(acc),  # None where the outputs are not classes
                "test_loss": loss,
                **({"test_auc": area} if area is not None else {}),
                **({"test_perplexity": finite(perplexity)} if perplexity is not None else {}),
                "train_loss": st.train_loss if math.isfinite(st.train_loss) else None,
                "samples": st.samples,
                "version": version,
                "max_staleness": st.max_staleness,
                "live_workers": len(st.workers),
                "wall_s": time.perf_counter() - self.t0,
                "train_s": st.train_seconds,  # first applied push to the last one before this
            }
        )
        self.say(f"epoch {epoch}: test {figures(acc, loss, area, perplexity)}, version {version}")
        return Recorded(st, version, result)

    def finish(
        self, scfg: ServerConfig, st: pb.StatusResponse, failed: list[str] | None = None
    ) -> dict[str, Any]:
        """Draw curve.png and write summary.json (what ``launch --json`` prints: the last
        evaluation and the server's counters); returns the summary."""
        self.run.plot(f"{scfg.model}, {Policy.label(scfg.policy)}, {scfg.workers} workers")
        last = self.run.read_metrics()[-1]
        summary = {
            "policy": st.policy,
            "policy_label": Policy.label(scfg.policy),
            "workers": scfg.workers,
            "epochs": scfg.epochs,
            "model": scfg.model,
            "test_accuracy": last["test_accuracy"],
            "test_loss": last["test_loss"],
            **({"test_auc": last["test_auc"]} if "test_auc" in last else {}),
            **({"test_perplexity": last["test_perplexity"]} if "test_perplexity" in last else {}),
            "samples": st.samples,
            "samples_per_s": st.samples / st.train_seconds if st.train_seconds > 0 else 0.0,
            "train_s": st.train_seconds,
            "wall_s": time.perf_counter() - self.t0,
            "max_staleness": st.max_staleness,
            "staleness_histogram": {str(k): v for k, v in sorted(st.staleness_histogram.items())},
            "version": st.version,
            "failed_workers": list(failed or []),
            "run_dir": str(self.run.path),
        }
        self.run.write_json("summary.json", summary)
        return summary
