"""deploy/k8s/trainer: the Kubeflow Trainer runtime and its example TrainJob validate offline,
strictly (an unknown field anywhere is an error), against the CRDs vendored from Kubeflow
Trainer and JobSet (``deploy/k8s/trainer/crds/SOURCES.md``); the JobSet the Trainer makes of
them validates against JobSet's CRD, and each of its jobs against Kubernetes' own schemas
(``kubernetes-validate --strict``, two versions, as ``test_k8s.py`` does for the base).
What they say agrees: the workers' shard addresses are the Trainer's endpoints of the server
job's pods, the shard count its pod count, the server's worker count the TrainJob's
``numNodes``, and every PARAMSERVER_* variable one the role reads.

The JobSet is made here as Trainer v2.3.0's plain-ML path makes it (read from its
``pkg/runtime/framework/plugins``: the trainer job's replicas 1, its completions and
parallelism the TrainJob's ``numNodes``, its container ``node`` taking the TrainJob's image
and variables; ``runtimePatches`` merged by name; endpoints ``<trainjob>-<job>-<i>-<pod>.
<trainjob>``): a model of the controller, not the controller. The CRDs' CEL rules
(``x-kubernetes-validations``) are not evaluated offline."""

from __future__ import annotations

import copy
import gzip
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.integration.test_deploy import cli_envvars
from tests.integration.test_k8s import KUBECTL, VERSIONS, env_of, needs_kubectl, validate

TRAINER = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "trainer"
ROLE_VARIABLES = {"PARAMSERVER_SHARDS"}  # --shard auto's count, read by the roles code


def crd_schema(name: str) -> dict:
    """The served version's schema of a vendored CRD, closed: an object that lists its
    properties takes no others (unless the CRD preserves unknown fields there)."""
    crd = yaml.safe_load(gzip.decompress((TRAINER / "crds" / f"{name}.yaml.gz").read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    return closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def closed(schema: dict) -> dict:
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for value in schema.values():
            if isinstance(value, dict):
                closed(value)
            elif isinstance(value, list):
                for item in value:
                    closed(item)
    return schema


SCHEMAS = {
    "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes",
    "TrainJob": "trainer.kubeflow.org_trainjobs",
    "JobSet": "jobset.x-k8s.io_jobsets",
}


def errors(doc: dict) -> list[str]:
    """Every way ``doc`` breaks its kind's vendored CRD schema."""
    validator = jsonschema.Draft7Validator(crd_schema(SCHEMAS[doc["kind"]]))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def load(name: str) -> dict:
    return yaml.safe_load((TRAINER / name).read_text())


def upsert_env(container: dict, env: list[dict]) -> None:
    """Variables set by name, as the Trainer's ``apply.UpsertEnvVars`` does."""
    have = container.setdefault("env", [])
    for var in env:
        at = next((i for i, e in enumerate(have) if e["name"] == var["name"]), None)
        if at is None:
            have.append(var)
        else:
            have[at] = var


def jobset_of(runtime: dict, trainjob: dict) -> dict:
    """The JobSet Trainer v2.3.0 makes of the runtime and the TrainJob (module docstring)."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    jobs = {j["name"]: j for j in spec["replicatedJobs"]}
    for patch in trainjob["spec"].get("runtimePatches", []):
        for pjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pod = jobs[pjob["name"]]["template"]["spec"]["template"]["spec"]
            for pc in pjob["template"]["spec"]["template"]["spec"].get("containers", []):
                container = next(c for c in pod["containers"] if c["name"] == pc["name"])
                upsert_env(container, pc.get("env", []))
    trainer = trainjob["spec"].get("trainer", {})
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])
    for job in jobs.values():
        if (
            job["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step")
            != "trainer"
        ):
            continue
        job["replicas"] = 1
        job["template"]["spec"]["completions"] = job["template"]["spec"]["parallelism"] = nodes
        node = next(
            c
            for c in job["template"]["spec"]["template"]["spec"]["containers"]
            if c["name"] == "node"
        )
        for key in ("image", "command", "args"):
            if key in trainer:
                node[key] = trainer[key]
        upsert_env(node, trainer.get("env", []))
    name = trainjob["metadata"]["name"]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/trainjob-name": name}},
        "spec": spec,
    }


def endpoints(jobset: dict, job_name: str) -> list[str]:
    """The Trainer's endpoints of a replicated job's pods (its IdentifyPodNetwork)."""
    name = jobset["metadata"]["name"]
    subdomain = jobset["spec"].get("network", {}).get("subdomain", name)
    job = next(j for j in jobset["spec"]["replicatedJobs"] if j["name"] == job_name)
    pods = job["template"]["spec"].get("parallelism", 1)
    return [
        f"{name}-{job_name}-{r}-{p}.{subdomain}"
        for r in range(job.get("replicas", 1))
        for p in range(pods)
    ]


def resolved(container: dict, jobset_name: str) -> dict[str, str]:
    """The container's variables as the kubelet sets them: $(VAR) of those before it, the
    JobSet's name label from the downward API."""
    out: dict[str, str] = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if ref == "metadata.labels['jobset.sigs.k8s.io/jobset-name']":
            out[var["name"]] = jobset_name
        elif "value" in var:
            out[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), var["value"])
    return out


def containers(jobset: dict) -> dict[str, dict]:
    return {
        j["name"]: j["template"]["spec"]["template"]["spec"]["containers"][0]
        for j in jobset["spec"]["replicatedJobs"]
    }


def made() -> list[tuple[str, dict]]:
    """The JobSets of the runtime alone (an empty TrainJob) and of the example."""
    runtime, example = load("runtime.yaml"), load("example-trainjob.yaml")
    bare = {"metadata": {"name": "run"}, "spec": {"runtimeRef": example["spec"]["runtimeRef"]}}
    return [("runtime alone", jobset_of(runtime, bare)), ("example", jobset_of(runtime, example))]


@pytest.mark.parametrize("name", ["runtime.yaml", "example-trainjob.yaml"])
def test_the_runtime_and_the_example_validate_against_the_trainers_crds(name):
    doc = load(name)
    assert not errors(doc), errors(doc)


@pytest.mark.parametrize("which", [0, 1])
def test_the_jobset_the_trainer_makes_validates_against_jobsets_crd(which):
    what, jobset = made()[which]
    assert not errors(jobset), (what, errors(jobset))


@pytest.mark.parametrize("version", VERSIONS)
def test_its_jobs_and_the_claim_validate_strictly_against_kubernetes(tmp_path, version):
    docs = [yaml.safe_load((TRAINER / "checkpoints.yaml").read_text())]
    for _, jobset in made():
        for job in jobset["spec"]["replicatedJobs"]:
            name = f"{jobset['metadata']['name']}-{job['name']}-0"
            docs.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": name, **job["template"].get("metadata", {})},
                    "spec": job["template"]["spec"],
                }
            )
    out = validate(tmp_path, docs, version)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_validation_can_fail():
    """A misspelt field deep in a pod, a CRD's own field misspelt, a wrong type: each found."""
    runtime = load("runtime.yaml")
    server = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    server["template"]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    runtime["spec"]["mlPolicy"]["numNode"] = 2
    trainjob = load("example-trainjob.yaml")
    trainjob["spec"]["trainer"]["numNodes"] = "four"
    found = errors(runtime) + errors(trainjob)
    assert any("imagePullPolicyy" in e for e in found), found
    assert any("numNode'" in e for e in found), found
    assert any("trainer/numNodes" in e for e in found), found


@pytest.mark.parametrize("which", [0, 1])
def test_addresses_shards_and_workers_agree(which):
    what, jobset = made()[which]
    name = jobset["metadata"]["name"]
    by_job = containers(jobset)
    server, worker = resolved(by_job["server"], name), resolved(by_job["node"], name)
    shards = endpoints(jobset, "server")
    assert by_job["server"]["args"] == ["server", "--shard", "auto"]
    assert server["PARAMSERVER_SHARDS"] == str(len(shards)), what
    assert worker["PARAMSERVER_SERVER"] == ",".join(f"{e}:50051" for e in shards), what
    # --shard auto: the shard is the pod's index, the host name's last part
    assert all(re.search(r"-(\d+)\.", e)[1] == str(i) for i, e in enumerate(shards))
    assert server["PARAMSERVER_WORKERS"] == str(len(endpoints(jobset, "node"))), what
    assert server["PARAMSERVER_CHECKPOINT_DIR"] == f"/checkpoints/{name}"
    assert jobset["spec"]["successPolicy"]["targetReplicatedJobs"] == ["node"]
    envvars = cli_envvars()
    for role, container in (("server", by_job["server"]), ("worker", by_job["node"])):
        ours = {v for v in env_of(container) if v.startswith("PARAMSERVER_")}
        unknown = ours - envvars[role] - ROLE_VARIABLES
        assert not unknown, f"{role} sets variables paramserver {role} does not read: {unknown}"
    if what == "example":
        assert server["PARAMSERVER_MODEL"] == "resnet" and server["PARAMSERVER_POLICY"] == "ssp:3"
        assert by_job["node"]["image"] == "paramserver:cpu"
        assert len(endpoints(jobset, "node")) == 4


def test_the_vendored_crds_are_the_named_releases():
    """SOURCES.md's sha256 of each file, uncompressed: nobody edited them."""
    import hashlib

    table = (TRAINER / "crds" / "SOURCES.md").read_text()
    for path in sorted((TRAINER / "crds").glob("*.yaml.gz")):
        digest = hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()
        row = next(ln for ln in table.splitlines() if f"`{path.name}`" in ln)
        assert digest in row, path.name


@needs_kubectl
def test_the_kustomization_builds_with_the_image_set():
    out = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(TRAINER)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in docs} == {"ClusterTrainingRuntime", "PersistentVolumeClaim"}
    runtime = next(d for d in docs if d["kind"] == "ClusterTrainingRuntime")
    images = {
        c["image"] for c in containers({"spec": runtime["spec"]["template"]["spec"]}).values()
    }
    assert images == {"paramserver:cpu"}
    assert not errors(runtime), errors(runtime)
