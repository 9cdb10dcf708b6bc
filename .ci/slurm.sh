#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests/test_slurm.py: Debian's slurm-wlm (22.05 on
# bookworm) and munge, installed when missing, one node `localhost` with this machine's CPUs and memory,
# no cgroups (proctrack/linuxproc, task/none), one partition `ci`. Idempotent: a cluster already
# answering is left as it is. Needs root (or sudo) and apt-get.
set -euo pipefail

sudo=$([[ $(id -u) == 0 ]] || echo sudo)
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

answering() { timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
if answering; then
    echo "slurm: already up: $(sinfo -h -o '%P %D %T %c CPUs')"
    exit 0
fi

if [[ ! -s /etc/munge/munge.key ]]; then
    $sudo mungekey --create --keyfile=/etc/munge/munge.key
fi
$sudo chown munge:munge /etc/munge/munge.key
$sudo chmod 0400 /etc/munge/munge.key
$sudo mkdir -p /run/munge
$sudo chown munge:munge /run/munge
if ! pgrep -x munged >/dev/null; then
    $sudo runuser -u munge -- /usr/sbin/munged
fi

cpus=$(nproc)
memory=$(($(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
$sudo mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
$sudo tee /etc/slurm/slurm.conf >/dev/null <<CONF
ClusterName=oodjax-ci
SlurmctldHost=localhost
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmdParameters=config_overrides
NodeName=localhost CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=ci Nodes=localhost Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP
CONF

pgrep -x slurmctld >/dev/null || $sudo /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || $sudo /usr/sbin/slurmd -N localhost
sleep 1
$sudo scontrol update NodeName=localhost State=RESUME 2>/dev/null || true  # a node left down or drained
for _ in $(seq 60); do
    if answering; then
        echo "slurm: up: $(sinfo -h -o '%P %D %T %c CPUs')"
        exit 0
    fi
    sleep 1
done
echo "slurm: the cluster did not come up; its logs:" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
