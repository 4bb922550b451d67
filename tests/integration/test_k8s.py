"""deploy/k8s: the kustomize base and overlays build (``kubectl kustomize``), every manifest
validates offline against two Kubernetes versions (``kubernetes-validate --strict``), and
what they say agrees with the CLI: shard count, shard addresses, variables."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_deploy import cli_envvars

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
BUILDS = ("base", "overlays/gpu", "overlays/one-shard")
VERSIONS = ("1.30.0", "1.37.0")
KUBECTL = shutil.which("kubectl")
# the dev dependency's script, beside the Python that runs the tests
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (with kustomize) is not installed"
)
# Read by the roles code, not by a click option: --shard auto's shard count.
ROLE_VARIABLES = {"PARAMSERVER_SHARDS"}


def build(path: str) -> list[dict]:
    out = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(K8S / path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(tmp_path: Path, docs: list[dict], version: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"manifests-{version}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    tool = str(VALIDATE) if VALIDATE.exists() else shutil.which("kubernetes-validate")
    assert tool, "kubernetes-validate is a dev dependency: make install installs it"
    return subprocess.run(
        [tool, "--strict", "--quiet", "-k", version, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def raw_base() -> list[dict]:
    """The base's resource files as written (what validates without kustomize)."""
    listed = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"]
    return [d for f in listed for d in yaml.safe_load_all((K8S / "base" / f).read_text()) if d]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_base_files_validate_strictly_as_written(tmp_path, version):
    """Needs no kubectl: the base's files are whole resources on their own."""
    out = validate(tmp_path, raw_base(), version)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_kubectl
@pytest.mark.parametrize("path", BUILDS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_build_validates_strictly(tmp_path, path, version):
    out = validate(tmp_path, build(path), version)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_validation_can_fail(tmp_path):
    docs = raw_base()
    by_kind(docs)["StatefulSet"]["spec"]["replicaz"] = 2
    out = validate(tmp_path, docs, VERSIONS[0])
    assert out.returncode != 0 and "replicaz" in out.stdout + out.stderr


@needs_kubectl
@pytest.mark.parametrize("path", BUILDS)
def test_shards_replicas_and_addresses_agree(path):
    kinds = by_kind(build(path))
    sts, job, svc = kinds["StatefulSet"], kinds["Job"], kinds["Service"]
    replicas = sts["spec"]["replicas"]
    server = sts["spec"]["template"]["spec"]["containers"][0]
    worker = job["spec"]["template"]["spec"]["containers"][0]
    assert server["args"] == ["server", "--shard", "auto"]
    assert env_of(server)["PARAMSERVER_SHARDS"] == str(replicas)
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service
    expected = ",".join(f"{name}-{i}.{service}:50051" for i in range(replicas))
    assert env_of(worker)["PARAMSERVER_SERVER"] == expected
    assert server["readinessProbe"]["grpc"]["port"] == 50051
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    envvars = cli_envvars()
    for role, container in (("server", server), ("worker", worker)):
        unknown = set(env_of(container)) - envvars[role] - ROLE_VARIABLES
        assert not unknown, f"{role} sets variables paramserver {role} does not read: {unknown}"
    config = kinds["ConfigMap"]["data"]
    assert not set(config) - envvars["server"], "the ConfigMap sets what the server does not read"
    if path.endswith("gpu"):
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env_of(worker)["PARAMSERVER_DEVICE"] == "cuda"
