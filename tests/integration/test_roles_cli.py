"""A server and a worker that take their roles from TF_CONFIG alone, as under Kubeflow's
TFJob or Volcano: no --server, --shard or --port, and they train to the end."""

from __future__ import annotations

import json

from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from tests.conftest import DEADLINE, free_port
from tests.integration.test_server_restart import _status


def test_tf_config_alone_places_the_server_and_the_worker(tmp_path):
    port = free_port()
    cluster = {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}
    tf = {
        k: json.dumps({"cluster": cluster, "task": {"type": k, "index": 0}})
        for k in ("ps", "worker")
    }
    base = {"PARAMSERVER_DATASET": "synthetic", "PARAMSERVER_EPOCHS": "1"}
    procs: list[Child] = []
    try:
        server = Child(
            "server",
            ["server"],
            tmp_path / "server.log",
            capture_stdout=True,
            env={**base, "TF_CONFIG": tf["ps"]},
        )
        procs.append(server)
        address = server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        assert address == f"127.0.0.1:{port}"
        worker = Child(
            "worker",
            ["worker", "--device", "cpu"],
            tmp_path / "worker.log",
            env={"TF_CONFIG": tf["worker"]},
        )
        procs.append(worker)
        assert worker.proc.wait(DEADLINE) == 0, worker.tail(20)
        st = _status(address)
        assert st.batches_done == st.batches_total > 0
        assert "on 0.0.0.0:" in (tmp_path / "server.log").read_text()
    finally:
        stop_all(procs)
