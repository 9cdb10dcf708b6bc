#!/usr/bin/env bash
# A SLURM cluster on this machine, for tests/test_slurm*.py: Debian's slurm-wlm (22.05 on bookworm) and
# munge, installed when missing, no cgroups (proctrack/linuxproc, task/none).
#
#   .ci/slurm.sh             one node `localhost` with this machine's CPUs and memory, partition `ci`
#   .ci/slurm.sh --nodes 2   the same, and a partition `ci2` of two nodes `oodjax-n1` and `oodjax-n2`: each a
#                            slurmd in a network namespace of its own (a veth pair on the bridge `oodjax-br0`,
#                            10.213.0.11 and .12; slurmctld listens on the bridge's 10.213.0.1 too) and a UTS
#                            namespace whose host name /etc/hosts maps to that address, so that srun, the JAX
#                            coordinator and gloo see two hosts, as on a real cluster
#   .ci/slurm.sh --down      stops every daemon, removes the namespaces, the bridge and the /etc/hosts lines
#
# Idempotent: a cluster already answering as asked is left as it is. Needs root (or sudo), apt-get, and for
# two nodes `ip netns` and `unshare --uts`. What fails is one line on stderr, status 1.
set -euo pipefail

nodes=1
down=0
while (($#)); do
    case $1 in
        --nodes) nodes=${2:-}; shift 2 ;;
        --nodes=*) nodes=${1#--nodes=}; shift ;;
        --down) down=1; shift ;;
        *) echo "usage: .ci/slurm.sh [--nodes 1|2] [--down]" >&2; exit 2 ;;
    esac
done
if [[ $nodes != 1 && $nodes != 2 ]]; then
    echo "usage: .ci/slurm.sh [--nodes 1|2] [--down]" >&2
    exit 2
fi

sudo=$([[ $(id -u) == 0 ]] || echo sudo)
BRIDGE=oodjax-br0
PREFIX=10.213.0
CONTROLLER=$PREFIX.1
NAMES=(oodjax-n1 oodjax-n2)
HOSTS_TAG="# oodjax .ci/slurm.sh"

fail() {
    echo "slurm: $*" >&2
    exit 1
}

stop_daemons() {  # each daemon by the id in its pid file, then waits for it to go
    local pidfile pid
    for pidfile in /run/slurmctld.pid /run/slurmd*.pid; do
        [[ -s $pidfile ]] || continue
        pid=$(<"$pidfile")
        if kill "$pid" 2>/dev/null; then
            for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        fi
        $sudo rm -f "$pidfile"
    done
}

remove_nodes() {
    local name
    for name in "${NAMES[@]}"; do
        $sudo ip link del "$name-h" 2>/dev/null || true
        $sudo ip netns del "$name" 2>/dev/null || true
    done
    $sudo ip link del "$BRIDGE" 2>/dev/null || true
    if grep -q "$HOSTS_TAG" /etc/hosts; then
        grep -v "$HOSTS_TAG" /etc/hosts >/tmp/oodjax-hosts && $sudo cp /tmp/oodjax-hosts /etc/hosts
        rm -f /tmp/oodjax-hosts
    fi
}

if ((down)); then
    stop_daemons
    remove_nodes
    echo "slurm: down"
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

cpus=$(nproc)
memory=$(($(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
controller=localhost
two_nodes=""
two_node_partition=""
if ((nodes == 2)); then
    controller="localhost($CONTROLLER)"  # the name slurmctld knows itself by; the address every namespace reaches
    # Before `localhost`: while it is the only node read, SLURM takes any name looked up for it.
    two_nodes="NodeName=${NAMES[0]} NodeAddr=$PREFIX.11 CPUs=$cpus RealMemory=$((memory / 2)) State=UNKNOWN
NodeName=${NAMES[1]} NodeAddr=$PREFIX.12 CPUs=$cpus RealMemory=$((memory / 2)) State=UNKNOWN
"
    two_node_partition="
PartitionName=ci2 Nodes=${NAMES[0]},${NAMES[1]} Default=NO MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP"
fi
conf="ClusterName=oodjax-ci
SlurmctldHost=$controller
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
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
${two_nodes}NodeName=localhost CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=ci Nodes=localhost Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP$two_node_partition"

answering() {  # every node of the config idle, mixed or allocated
    local states
    states=$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [[ $(grep -cE ' (idle|mixed|allocated|completing)' <<<"$states") == "$([[ $nodes == 2 ]] && echo 3 || echo 1)" ]]
}
if [[ -f /etc/slurm/slurm.conf && $(</etc/slurm/slurm.conf) == "$conf" ]] && answering; then
    echo "slurm: already up: $(sinfo -h -o '%P %D %T %c CPUs' | paste -sd ';' -)"
    exit 0
fi

if squeue -h 2>/dev/null | grep -q .; then  # a restart below would strand them
    fail "jobs are queued or running (squeue) on a cluster not as asked; let them end or cancel them, then rerun"
fi
stop_daemons  # started afresh with this configuration
remove_nodes

if [[ ! -s /etc/munge/munge.key ]]; then
    $sudo mungekey --create --keyfile=/etc/munge/munge.key
fi
$sudo chown munge:munge /etc/munge/munge.key
$sudo chmod 0400 /etc/munge/munge.key
$sudo mkdir -p /run/munge
$sudo chown munge:munge /run/munge
if ! pgrep -x munged >/dev/null; then
    $sudo runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
fi

if ((nodes == 2)); then
    command -v ip >/dev/null || fail "no \`ip\` command (iproute2) to build the two nodes' network namespaces"
    $sudo ip link add "$BRIDGE" type bridge || fail "cannot create the bridge $BRIDGE (ip link add ... type bridge)"
    $sudo ip addr add "$CONTROLLER/24" dev "$BRIDGE"
    $sudo ip link set "$BRIDGE" up
    hosts=""
    for index in 0 1; do
        name=${NAMES[index]}
        address=$PREFIX.$((11 + index))
        $sudo ip netns add "$name" || fail "cannot create the network namespace $name (ip netns add)"
        $sudo ip link add "$name-h" type veth peer name eth0 netns "$name" ||
            fail "cannot create the veth pair of $name (ip link add ... type veth)"
        $sudo ip link set "$name-h" master "$BRIDGE"
        $sudo ip link set "$name-h" up
        $sudo ip netns exec "$name" ip addr add "$address/24" dev eth0
        $sudo ip netns exec "$name" ip link set eth0 up
        $sudo ip netns exec "$name" ip link set lo up
        hosts+="$address $name $HOSTS_TAG"$'\n'
    done
    printf '%s' "$hosts" | $sudo tee -a /etc/hosts >/dev/null
fi

$sudo mkdir -p /var/spool/slurmctld /var/log/slurm
for name in localhost "${NAMES[@]:0:$((nodes == 2 ? 2 : 0))}"; do
    $sudo mkdir -p "/var/spool/slurmd/$name"
done
printf '%s\n' "$conf" | $sudo tee /etc/slurm/slurm.conf >/dev/null

$sudo /usr/sbin/slurmctld || fail "slurmctld did not start: $(tail -n 1 /var/log/slurm/slurmctld.log 2>/dev/null)"
$sudo /usr/sbin/slurmd -N localhost || fail "slurmd of localhost did not start: $(tail -n 1 /var/log/slurm/slurmd-localhost.log)"
if ((nodes == 2)); then
    for name in "${NAMES[@]}"; do
        $sudo nsenter --net="/run/netns/$name" unshare --uts sh -c "hostname $name && exec /usr/sbin/slurmd -N $name" ||
            fail "slurmd of $name did not start in its namespaces: $(tail -n 1 "/var/log/slurm/slurmd-$name.log")"
    done
fi
sleep 1
for name in localhost "${NAMES[@]:0:$((nodes == 2 ? 2 : 0))}"; do
    $sudo scontrol update NodeName="$name" State=RESUME 2>/dev/null || true  # a node left down or drained
done
for _ in $(seq 60); do
    if answering; then
        echo "slurm: up: $(sinfo -h -o '%P %D %T %c CPUs' | paste -sd ';' -)"
        exit 0
    fi
    sleep 1
done
fail "the nodes did not come up: $(sinfo -h -N -o '%N %T' 2>&1 | paste -sd ' ' -) (logs: /var/log/slurm/)"
