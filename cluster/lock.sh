#!/usr/bin/env bash
# Regenerate the hash-locked requirements of the two images:
#   cluster/requirements.lock          Ray nodes (cluster/Dockerfile): pyproject.toml's
#                                      dependencies + cluster/requirements.in
#   cluster/mlflow/requirements.lock   MLflow server (cluster/mlflow/Dockerfile):
#                                      cluster/mlflow/requirements.in
# Both are resolved for the images' platform (CPython 3.11, Linux x86_64, glibc >= 2.28),
# whatever machine runs this, with a sha256 hash for every file: the Dockerfiles install
# them with `pip install --require-hashes`, so a file that changed on the index fails the build.
#
# Usage (from anywhere; needs uv: pip install uv):
#   cluster/lock.sh                    # both lock files, newest versions the inputs allow
#   UV_EXCLUDE_NEWER=2026-01-31 cluster/lock.sh     # as the index stood on that date
# A CUDA build of PyTorch other than PyPI's (for an older NVIDIA driver), in a lock of its own:
#   TORCH_BACKEND=cu126 NODE_LOCK=cluster/requirements-cu126.lock cluster/lock.sh
# then build with --build-arg LOCK_FILE=cluster/requirements-cu126.lock
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126  (cluster/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

uv="${UV:-uv}"
command -v "$uv" >/dev/null || { echo "lock.sh: uv not found (pip install uv)" >&2; exit 2; }
node_lock="${NODE_LOCK:-cluster/requirements.lock}"
common=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes
        --no-header --quiet)

header() {
    cat <<HEADER
# Hash-locked requirements for $1: do not edit, regenerate with cluster/lock.sh
# (uv pip compile $2 --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes${3:+ $3})
HEADER
}

torch=()
[[ -n "${TORCH_BACKEND:-}" ]] && torch=(--torch-backend "$TORCH_BACKEND")

tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
"$uv" pip compile pyproject.toml cluster/requirements.in "${common[@]}" "${torch[@]}" -o "$tmp"
{ header "the Ray node image (cluster/Dockerfile)" "pyproject.toml cluster/requirements.in" \
         "${torch[*]}"; cat "$tmp"; } > "$node_lock"
"$uv" pip compile cluster/mlflow/requirements.in "${common[@]}" -o "$tmp"
{ header "the MLflow server image (cluster/mlflow/Dockerfile)" "cluster/mlflow/requirements.in"; \
  cat "$tmp"; } > cluster/mlflow/requirements.lock
echo "lock.sh: wrote $node_lock ($(grep -c '^[a-z0-9]' "$node_lock") packages)," \
     "cluster/mlflow/requirements.lock ($(grep -c '^[a-z0-9]' cluster/mlflow/requirements.lock) packages)" >&2
