"""The torchx component (``paramserver.launchers.torchx``) on torchx's local scheduler:
``torchx run -s local_cwd ... --wait`` starts 2 shards and 2 workers, they train the
synthetic data set to the end, the shards exit on their own (``--exit-when-done``) with a
checkpoint at the run's last version, and the app SUCCEEDS. The AppDef's roles are checked
as the Slurm and Kubernetes schedulers would read them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from paramserver.cluster.torchx_roles import ENV
from tests.conftest import DEADLINE

BIN = Path(sys.executable).parent


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on every interface now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("", p))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def test_the_component_trains_to_the_end_on_torchxs_local_scheduler(tmp_path):
    port = free_ports(4)  # 2 shards: gRPC and data port each
    cmd = [
        str(BIN / "torchx"),
        *("run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}", "--wait", "--log"),
        "paramserver.launchers.torchx:paramserver",
        *("--workers", "2", "--shards", "2", "--port", str(port), "--device", "cpu"),
        "--",
        *("--dataset", "synthetic", "--epochs", "1", "--run-dir", "off"),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "50"),
    ]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its replicas too, so a failed test kills them all
    )
    try:
        out, _ = proc.communicate(timeout=2 * DEADLINE)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "job finished: SUCCEEDED" in out, out[-4000:]
    for i in (0, 1):
        assert f"server/{i} paramserver server listening on 127.0.0.1:{port + 2 * i}" in out
        assert re.search(rf"server/{i} .*every worker has left: stopping \(--exit-when-done\)", out)
    versions = {
        m[1]: int(m[0])
        for m in re.findall(r"checkpoint of version (\d+) written to \S+shard(\d)of2\.pt", out)
    }
    assert versions.keys() == {"0", "1"} and len(set(versions.values())) == 1, versions
    steps = [int(s) for s in re.findall(r"rank \d finished: (\d+) steps", out)]
    assert len(steps) == 2 and sum(steps) == versions["0"] > 0  # async: a step a push
    assert f"localhost:{port},localhost:{port + 2}" in out  # the workers dialled both


def test_the_appdef_the_schedulers_get():
    from torchx.specs import macros

    from paramserver.launchers.torchx import paramserver

    app = paramserver("--model", "resnet", workers=3, shards=2, image="img:1", port=6000)
    server, worker = app.roles
    assert (server.name, server.num_replicas, worker.num_replicas) == ("server", 2, 3)
    assert server.args[:6] == [
        "server",
        "--shard",
        f"{macros.replica_id}/2",
        "--workers",
        "3",
        "--exit-when-done",
    ]
    assert server.args[6:] == ["--model", "resnet"] and server.image == worker.image == "img:1"
    values = macros.Values(img_root="", app_id="a", replica_id="1", rank0_env="VC_SERVER_0_HOSTS")
    resolved = values.apply(server)
    assert resolved.args[2] == "1/2" and resolved.env[ENV] == "VC_SERVER_0_HOSTS 2 6000"
    assert values.apply(worker).env[ENV] == "VC_SERVER_0_HOSTS 2 6000"
