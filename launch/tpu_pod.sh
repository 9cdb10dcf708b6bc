#!/bin/bash
# One job of the study on a Cloud TPU VM pod: the same command on every worker, one process per host.
#
# Usage (launch/sweep.py writes these lines; see `python -m launch.sweep --backend tpu --dry_run`):
#   launch/tpu_pod.sh CONFIG [--config.FIELD=VALUE ...]
#
# Variables (defaults in brackets):
#   TPU_NAME         name of the TPU VM pod slice (required)
#   TPU_ZONE         its zone, e.g. us-central2-b (required)
#   TPU_PROJECT      Google Cloud project [gcloud's configured project]
#   OODJAX_REPO      repository path on every worker, same on all [~/oodjax]
#   OODJAX_VENV      virtualenv with jax[tpu] on every worker [$OODJAX_REPO/.venv]
#   OODJAX_DATA_DIR  testset mirror on every worker [unset: the hub]
#   HF_HOME          Hugging Face cache on every worker [unset: ~/.cache/huggingface]
#   JAX_COMPILATION_CACHE_DIR  compiled programs, reused by later jobs on the same workers
#                    [$OODJAX_REPO/.cache/jax]
#   JAX_PLATFORMS    the one backend JAX may start on the workers: a worker whose TPU JAX cannot use
#                    stops instead of training on its CPUs [tpu]
# JAX's memory fraction (XLA_CLIENT_MEM_FRACTION) configures its GPU client only: a TPU program may take
# the whole of each chip's memory, which is what launch.estimate tests TPU fits against.
# Each worker sources launch/xla_flags.sh (the accelerator XLA flags, LIBTPU_INIT_ARGS here) before
# it starts; OODJAX_XLA_FLAGS=none on the worker turns them off.
# Each worker learns its index and the pod's host names from the VM metadata server
# (agent-worker-number, worker-network-endpoints) and exports them as TPU_WORKER_ID and
# TPU_WORKER_HOSTNAMES for oodjax.engine.distributed; worker 0 coordinates.
# --config.output_dir must be a POSIX file system every worker reaches, where renaming a directory is
# one atomic step: Filestore (NFS) or Managed Lustre. Not a bucket mounted with gcsfuse: orbax commits
# each checkpoint by renaming its directory, which gcsfuse cannot do (every save fails); gs:// paths are
# not supported directly either. Checkpoints are written by all workers, results by worker 0 only.
# Each worker's Python runs in a session of its own (setsid), its output in
# $OODJAX_REPO/.cache/tpu_pod/worker-<ID>.log, which the SSH session follows: a dropped SSH
# session (or this script stopped) leaves training running; rerunning this script while it runs is
# refused by the run locks. SIGTERM, SIGUSR1 or SIGHUP to a worker's Python (a spot or preemptible VM
# going down sends SIGTERM, with a short grace period) makes every worker finish its step, checkpoint
# every run and exit with status 75 (oodjax.engine.preemption.PREEMPTED_EXIT_CODE), if the grace
# period allows; running this script again resumes each run from its newest checkpoint.

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
