#!/usr/bin/env bash
# Build the paramserver image on any machine with a Docker daemon, including one whose builds
# reach no registry and no package index (an air-gapped cluster):
#   1. a wheelhouse in deploy/wheels, made on the host: paramserver, its dependencies and
#      torch (TORCH_VERSION, TORCH_VARIANT), so the build installs with pip --no-index;
#   2. the base: BASE_IMAGE if the daemon has it or can pull it, else a Debian bookworm base
#      made with debootstrap (as root) and `docker import` (paramserver-base:bookworm);
#   3. docker build -f deploy/Dockerfile.
# Usage: deploy/build-image.sh [TAG]      (default TAG: paramserver:$TORCH_VARIANT)
# Environment: TORCH_VERSION (2.13.0), TORCH_VARIANT (cpu; cu128 ... for GPU nodes),
#   BASE_IMAGE (python:3.11-slim-bookworm), PYTHON (python3: the Python 3.11 that makes the
#   wheelhouse), TORCH_INDEX (the variant's index on download.pytorch.org; empty: none),
#   DEBIAN_MIRROR (the host's apt mirror, else deb.debian.org).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim-bookworm}
PYTHON=${PYTHON:-python3}
TAG=${1:-paramserver:$TORCH_VARIANT}
FALLBACK_BASE=paramserver-base:bookworm
say() { echo "build-image: $*" >&2; }

docker info >/dev/null 2>&1 || { say "no Docker daemon answers: start dockerd first"; exit 1; }
started=$(date +%s)

# 1. The wheelhouse. The variant's index (TORCH_INDEX) gives torch X+cpu (or X+cu128), which
# sorts above PyPI's X; pip's own find-links (an offline mirror) take part as usual. An index
# whose host does not resolve is left out rather than retried.
index=${TORCH_INDEX-https://download.pytorch.org/whl/$TORCH_VARIANT}
host=$(echo "$index" | sed -n 's|^[a-z]*://\([^/:]*\).*|\1|p')
extra=()
if [ -n "$index" ] && { [ -z "$host" ] || getent hosts "$host" >/dev/null; }; then
    extra=(--extra-index-url "$index")
else
    say "$index unreachable: torch comes from pip's configured indexes and find-links"
fi
rm -f deploy/wheels/*.whl
# (pip's notes about configured indexes it cannot read are left out of the log)
"$PYTHON" -m pip wheel -q --wheel-dir deploy/wheels . "torch==$TORCH_VERSION" "${extra[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
say "wheelhouse: $(ls deploy/wheels/*.whl | wc -l) wheels, $(du -sh deploy/wheels | cut -f1)"

# 2. The base.
base=$BASE_IMAGE
if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 120 docker pull -q "$base" >/dev/null 2>&1; then
    base=$FALLBACK_BASE
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        say "$BASE_IMAGE cannot be pulled: making $base from Debian with debootstrap"
        [ "$(id -u)" = 0 ] || { say "debootstrap needs root"; exit 1; }
        if ! command -v debootstrap >/dev/null; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
        fi
        mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
        mirror=${mirror:-http://deb.debian.org/debian}
        rootfs=deploy/.rootfs
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,dataset-fashion-mnist \
            bookworm "$rootfs" "$mirror" >/dev/null
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -c . | docker import - "$base" >/dev/null
        rm -rf "$rootfs"
    fi
fi

# 3. The image.
docker build -q -f deploy/Dockerfile -t "$TAG" --build-arg "BASE_IMAGE=$base" \
    --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "TORCH_VARIANT=$TORCH_VARIANT" . >/dev/null
rm -f deploy/wheels/*.whl
size=$(docker image inspect -f '{{.Size}}' "$TAG")
say "built $TAG on $base in $(( $(date +%s) - started )) s: $(( size / 1000000 )) MB"
