#!/bin/sh
# Fetch the vendored CRDs again (SOURCES.md): Kubeflow Trainer's and JobSet's, at their tags.
set -eu
cd "$(dirname "$0")"
TRAINER=v2.3.0
JOBSET=v0.12.0
raw=https://raw.githubusercontent.com
for crd in clustertrainingruntimes trainjobs; do
    curl -fsSL "$raw/kubeflow/trainer/$TRAINER/manifests/base/crds/trainer.kubeflow.org_$crd.yaml" |
        gzip -9 -n >"trainer.kubeflow.org_$crd.yaml.gz"
done
curl -fsSL "$raw/kubernetes-sigs/jobset/$JOBSET/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" |
    gzip -9 -n >jobset.x-k8s.io_jobsets.yaml.gz
for f in *.yaml.gz; do printf '%s  %s\n' "$(gunzip -c "$f" | sha256sum | cut -d' ' -f1)" "$f"; done
