"""Roles from a scheduler's environment (``paramserver/cluster/roles.py``): TF_CONFIG and
``--shard auto``; what they imply, and one-line errors for what they cannot mean."""

from __future__ import annotations

import json

import pytest

from paramserver.cluster import roles
from paramserver.errors import ConfigError

CLUSTER = {"ps": ["ps-0.ps:2222", "ps-1.ps:2223"], "chief": ["c-0:1"], "worker": ["w-0:1", "w-1:1"]}


def env(kind: str, index: int, cluster: dict | None = None) -> dict[str, str]:
    doc = {"cluster": cluster or CLUSTER, "task": {"type": kind, "index": index}}
    return {"TF_CONFIG": json.dumps(doc)}


def test_a_ps_task_is_a_shard_on_its_own_port_for_every_worker():
    task = roles.tf_config(env("ps", 1))
    assert roles.server_settings(task) == {
        "shard": "1/2",
        "port": 2223,
        "host": "0.0.0.0",
        "workers": 3,
    }


def test_a_worker_or_chief_task_dials_every_ps_in_order():
    for kind, index in (("worker", 1), ("chief", 0)):
        settings = roles.worker_settings(roles.tf_config(env(kind, index)))
        assert settings == {
            "server_address": "ps-0.ps:2222,ps-1.ps:2223",
            "name": f"{kind}-{index}",
        }


def test_no_tf_config_changes_nothing():
    assert roles.tf_config({}) is None and roles.tf_config({"TF_CONFIG": " "}) is None


@pytest.mark.parametrize(
    "environ,call,message",
    [
        ({"TF_CONFIG": "{nope"}, None, "TF_CONFIG is not a TF_CONFIG"),
        ({"TF_CONFIG": '{"cluster": {}}'}, None, "TF_CONFIG is not a TF_CONFIG"),
        (env("ps", 0, {"worker": ["w:1"]}), None, "cluster.ps must list"),
        (env("worker", 0), "server", "run `paramserver worker` for it"),
        (env("ps", 0), "worker", "run `paramserver server` for it"),
        (env("ps", 5), "server", "task.index 5 is not one of its 2 ps"),
    ],
)
def test_what_a_tf_config_cannot_mean_is_one_sentence(environ, call, message):
    with pytest.raises(ConfigError, match=message):
        task = roles.tf_config(environ)
        (roles.server_settings if call == "server" else roles.worker_settings)(task)


def test_shard_auto_takes_the_pods_ordinal():
    assert roles.auto_shard("paramserver-2", {"PARAMSERVER_SHARDS": "3"}) == "2/3"
    with pytest.raises(ConfigError, match="host name is 'laptop'"):
        roles.auto_shard("laptop", {"PARAMSERVER_SHARDS": "3"})
    with pytest.raises(ConfigError, match="needs PARAMSERVER_SHARDS"):
        roles.auto_shard("paramserver-3", {"PARAMSERVER_SHARDS": "3"})
    with pytest.raises(ConfigError, match="needs PARAMSERVER_SHARDS"):
        roles.auto_shard("paramserver-0", {})
