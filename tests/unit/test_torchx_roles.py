"""Roles under torchx (``paramserver.cluster.torchx_roles``): what PARAMSERVER_TORCHX and
each scheduler's host variables mean for a server and a worker, and its errors."""

from __future__ import annotations

import os

import pytest

from paramserver.cluster import torchx_roles as tx
from paramserver.errors import ConfigError
from tests.conftest import paramserver_run


def test_the_setting_parses_and_refuses_what_is_not_it():
    assert tx.from_env({}) is None and tx.from_env({tx.ENV: " "}) is None
    got = tx.from_env({tx.ENV: "SLURM_JOB_NODELIST_HET_GROUP_0 2 50051"})
    assert got == tx.Torchx("SLURM_JOB_NODELIST_HET_GROUP_0", 2, 50051)
    for bad in ("${rank0_env} 2 50051", "X 0 50051", "X two 50051", "X 2", "X 2 3 4"):
        with pytest.raises(ConfigError, match="RANK0_ENV SHARDS PORT"):
            tx.from_env({tx.ENV: bad})


@pytest.mark.parametrize(
    ("rank0", "shard1"),
    [
        ("SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_JOB_NODELIST_HET_GROUP_1"),
        ("VC_SERVER_0_HOSTS", "VC_SERVER_1_HOSTS"),
        ("TORCHX_RANK0_HOST", "TORCHX_RANK0_HOST"),
    ],
)
def test_each_schedulers_variable_for_a_shards_host(rank0, shard1):
    assert tx.host_env(rank0, 0) == rank0
    assert tx.host_env(rank0, 1) == shard1


def test_a_shard_listens_two_ports_above_the_last():
    t = tx.Torchx("TORCHX_RANK0_HOST", 3, 50051)
    assert tx.server_settings(t, "0/3") == {"port": 50051, "host": "0.0.0.0"}
    assert tx.server_settings(t, "2/3")["port"] == 50055  # data ports 50052, 50054 between
    for bad in ("3/3", "1/2", "auto", "${replica_id}/3"):
        with pytest.raises(ConfigError, match="--shard I/3"):
            tx.server_settings(t, bad)


def test_a_worker_dials_every_shard_where_its_scheduler_put_it():
    slurm = tx.Torchx("SLURM_JOB_NODELIST_HET_GROUP_0", 2, 50051)
    env = {"SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n2"}
    assert tx.worker_settings(slurm, env) == {"server_address": "n1:50051,n2:50053"}
    local = tx.Torchx("TORCHX_RANK0_HOST", 2, 29500)
    got = tx.worker_settings(local, {"TORCHX_RANK0_HOST": "localhost"})
    assert got == {"server_address": "localhost:29500,localhost:29502"}
    volcano = tx.Torchx("VC_SERVER_0_HOSTS", 1, 50051)
    assert tx.worker_settings(volcano, {"VC_SERVER_0_HOSTS": "a.b,c.d"})["server_address"] == (
        "a.b:50051"
    )
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST_HET_GROUP_1 .shard 1's. is not set"):
        tx.worker_settings(slurm, {"SLURM_JOB_NODELIST_HET_GROUP_0": "n1"})


def test_a_host_named_once_serves_every_shard_only_on_this_host():
    """local_docker names the server-0 container for every replica: shard 1 is not there."""
    t = tx.Torchx("TORCHX_RANK0_HOST", 2, 50051)
    with pytest.raises(ConfigError, match="one host for every shard"):
        tx.worker_settings(t, {"TORCHX_RANK0_HOST": "paramserver-server-0"})
    one = tx.Torchx("TORCHX_RANK0_HOST", 1, 50051)
    got = tx.worker_settings(one, {"TORCHX_RANK0_HOST": "paramserver-server-0"})
    assert got == {"server_address": "paramserver-server-0:50051"}


def test_a_server_port_after_the_components_arguments_is_refused(tmp_path):
    env = {**os.environ, tx.ENV: "TORCHX_RANK0_HOST 2 50051", "PARAMSERVER_CONFIG": ""}
    out = paramserver_run("server", "--shard", "1/2", "--port", "6000", env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "shard 1/2 listens on 50053" in out.stderr and "--port 6000" in out.stderr
