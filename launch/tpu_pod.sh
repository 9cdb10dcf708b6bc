#!/bin/bash
# One job of the study on a Cloud TPU VM pod: the same command on every worker, one process per host.
#
# Usage (launch/sweep.py writes these lines; see `python -m launch.sweep --backend tpu --dry_run`):
#   launch/tpu_pod.sh CONFIG [--config.FIELD=VALUE ...]
#
# Variables (docs/clusters.md; defaults in brackets): TPU_NAME and TPU_ZONE (required), TPU_PROJECT,
# OODJAX_REPO [~/oodjax, the same on every worker], OODJAX_VENV [$OODJAX_REPO/.venv], OODJAX_DATA_DIR,
# HF_HOME, JAX_COMPILATION_CACHE_DIR [$OODJAX_REPO/.cache/jax], JAX_PLATFORMS [tpu: a worker whose TPU JAX
# cannot use stops instead of training on its CPUs].
# Each worker learns its index and the pod's hosts from the VM metadata server, for
# oodjax.engine.distributed. --config.output_dir must be a POSIX file system every worker reaches where
# a rename is atomic (Filestore, Managed Lustre): not gcsfuse, since orbax commits a checkpoint by renaming.
# Each worker's Python runs in a session of its own (setsid), logging to
# $OODJAX_REPO/.cache/tpu_pod/worker-<ID>.log, so a dropped SSH session leaves training running. A spot
# VM's SIGTERM ends in a checkpoint of every run and exit status 75, if its grace period allows; running
# this script again resumes each run (while it runs, the run locks refuse a second start).

set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: launch/tpu_pod.sh CONFIG [--config.FIELD=VALUE ...]" >&2
    exit 2
fi
: "${TPU_NAME:?set TPU_NAME to the TPU VM pod slice}"
: "${TPU_ZONE:?set TPU_ZONE to its zone}"
OODJAX_REPO=${OODJAX_REPO:-'~/oodjax'}
OODJAX_VENV=${OODJAX_VENV:-$OODJAX_REPO/.venv}
JAX_PLATFORMS=${JAX_PLATFORMS:-tpu}

project_flag=()
if [[ -n ${TPU_PROJECT:-} ]]; then
    project_flag=(--project="$TPU_PROJECT")
fi

# Quote every argument once here; the worker's shell sees them verbatim.
arguments=$(printf ' %q' "$@")
forwarded=""
for name in JAX_PLATFORMS OODJAX_DATA_DIR HF_HOME JAX_COMPILATION_CACHE_DIR; do
    if [[ -n ${!name:-} ]]; then
        forwarded+=$(printf ' %s=%q' "$name" "${!name}")
    fi
done

read -r -d '' remote <<REMOTE || true
set -euo pipefail
metadata() { curl -sf -H Metadata-Flavor:Google "http://metadata.google.internal/computeMetadata/v1/instance/attributes/\$1"; }
export TPU_WORKER_ID=\$(metadata agent-worker-number)
export TPU_WORKER_HOSTNAMES=\$(metadata worker-network-endpoints | tr ',' '\n' | awk -F: '{print (NF == 3 ? \$3 : \$1)}' | paste -sd, -)
export OODJAX_PROCESSES_PER=per_node HF_HUB_OFFLINE=\${HF_HUB_OFFLINE:-1}${forwarded}
cd ${OODJAX_REPO}
source launch/xla_flags.sh
export JAX_COMPILATION_CACHE_DIR=\${JAX_COMPILATION_CACHE_DIR:-\$PWD/.cache/jax}
log=\$PWD/.cache/tpu_pod/worker-\$TPU_WORKER_ID.log
mkdir -p "\${log%/*}"
rm -f "\$log.status"
: > "\$log"  # there before tail opens it
setsid --wait bash -c '"\$@"; echo \$? > "\$0.status"' "\$log" ${OODJAX_VENV}/bin/python -m oodjax.main --config=${arguments# } >> "\$log" 2>&1 < /dev/null &
tail -n +1 -F -s 0.2 --pid=\$! "\$log"
exit "\$(cat "\$log.status")"
REMOTE

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$TPU_ZONE" "${project_flag[@]}" --worker=all --command="$remote"
