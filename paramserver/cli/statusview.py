"""``paramserver status``: a server's Status as a table (or one JSON line)."""

from __future__ import annotations

import json
import math
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from paramserver._proto import paramserver_pb2 as pb
from paramserver.server.bookkeeping.status import TABLE_COUNTS
from paramserver.training.figures import figures

_INTEGERS = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64}
_FLOATS = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}


def _plain(descriptor: Any, d: dict[str, Any]) -> None:
    """``d`` (``MessageToDict`` of a message of ``descriptor``) with JSON's own values: every
    64-bit integer a number (protobuf's JSON makes them strings), a float that is not
    finite null (protobuf's JSON makes it "NaN"), nested messages alike; maps are left."""
    for f in descriptor.fields:
        message = f.message_type
        if f.name not in d or (message is not None and message.GetOptions().map_entry):
            continue
        if message is not None:
            for v in d[f.name] if f.is_repeated else [d[f.name]]:
                _plain(message, v)
        elif f.type in _INTEGERS:
            d[f.name] = [int(v) for v in d[f.name]] if f.is_repeated else int(d[f.name])
        elif f.type in _FLOATS and not f.is_repeated:
            value = float(d[f.name])
            d[f.name] = value if math.isfinite(value) else None


def as_json(st: pb.StatusResponse) -> str:
    """One JSON line with every field: integers as numbers, a value not yet known (a NaN,
    as the training loss before any push) as null."""
    d: dict[str, Any] = MessageToDict(
        st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _plain(pb.StatusResponse.DESCRIPTOR, d)
    d["staleness_histogram"] = {int(k): int(v) for k, v in d["staleness_histogram"].items()}
    for name in TABLE_COUNTS:
        d[name] = {k: int(v) for k, v in d[name].items()}
    d["finished"] = finished(st)
    return json.dumps(d, sort_keys=True)


def finished(st: pb.StatusResponse) -> bool:
    """Whether every batch of the run's plan is applied."""
    return 0 < st.batches_total <= st.batches_done


def _progress(st: pb.StatusResponse) -> str:
    """The batches applied of the plan's, and whether that is all of them."""
    if not st.batches_total:
        return ""
    done = f"  batches {st.batches_done}/{st.batches_total} "
    done += f"({100 * st.batches_done / st.batches_total:.1f}%)"
    if finished(st):
        done += ": RUN FINISHED (workers that join get nothing to train)"
    return done


def render(st: pb.StatusResponse, address: str) -> str:
    """The status as a header and one row per live worker."""
    rate = st.samples / st.train_seconds if st.train_seconds > 0 else 0.0
    progress = _progress(st)
    checkpoint = (
        f"  checkpoint v{st.checkpoint_version} {st.checkpoint_age_seconds:.0f}s ago"
        if st.checkpoint_age_seconds >= 0
        else ""
    )
    lines = [
        f"server {address}  incarnation {st.incarnation}  up {st.uptime_seconds:.0f}s",
        f"model {st.model}  policy {st.policy}  version {st.version}  "
        f"workers {len(st.workers)} live (min {st.min_workers}, max {st.world_size}){progress}",
        f"throughput {rate:.0f} samples/s  pushes {st.pushes_applied}  duplicates "
        f"{st.duplicates}  skipped {st.pushes_skipped}  loss {_loss(st.train_loss)}  "
        f"lr {st.learning_rate:.3g}  max staleness {st.max_staleness}{checkpoint}",
        "",
        f"{'rank':>4}  {'worker':<16}  {'name':<24} {'clock':>8} {'lag':>5} "
        f"{'last seen':>10} {'samples':>10} {'samples/s':>10}",
    ]
    for w in st.workers:
        lines.append(
            f"{w.rank:>4}  {w.worker_id:<16}  {w.name[:24]:<24} {w.clock:>8} {w.lag:>5} "
            f"{w.last_seen_seconds:>9.1f}s {w.samples:>10} {w.samples_per_second:>10.0f}"
        )
    if not st.workers:
        lines.append("  (no live workers)")
    if st.checkpoint_failing_seconds >= 0:
        lines.append(
            f"CHECKPOINTS FAILING for {st.checkpoint_failing_seconds:.0f}s "
            f"({st.checkpoint_failures} failed writes, {st.cuts_pending} cuts waiting): "
            f"{st.checkpoint_error}"
        )
    if st.rows_held:
        hits = sum(w.row_cache_hits for w in st.workers)
        looked = hits + sum(w.row_cache_misses for w in st.workers)
        lines.append(
            f"tables: {st.rows_held} rows held, {st.rows_pulled} pulled, "
            f"{st.rows_pushed} pushed; live workers' row caches "
            f"{100 * hits / max(looked, 1):.1f}% hits"
        )
    if st.tested_epoch:
        tested = figures(st.test_accuracy, st.test_loss, st.test_auc, st.test_perplexity)
        lines.append(f"test after epoch {st.tested_epoch}: {tested}")
    if st.evaluation_failures:
        lines.append(f"EVALUATIONS FAILED {st.evaluation_failures} times (see the server's log)")
    hist = ", ".join(f"{k}: {v}" for k, v in sorted(st.staleness_histogram.items()))
    lines.append(f"staleness histogram {{{hist}}}")
    return "\n".join(lines)


def _loss(loss: float) -> str:
    """The training loss, or "-" before the first push brought one."""
    return "-" if math.isnan(loss) else f"{loss:.4f}"
