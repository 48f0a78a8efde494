#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests: slurmctld + slurmd with a private config.
#
#   tools/slurm_cluster.sh check       # exit 0 if it can run here (root, Debian's slurmd/slurmctld/srun)
#   tools/slurm_cluster.sh up DIR      # write DIR/slurm.conf, start both daemons, wait until srun works
#   tools/slurm_cluster.sh down DIR    # stop the daemons started by `up DIR` (by their pid files)
#
# Then `SLURM_CONF=DIR/slurm.conf srun -n 2 CMD` runs two tasks. Everything (state, spool, logs,
# pid files) lives under DIR; nothing is written to /etc. Authentication is auth/none with
# cred/none (Debian bookworm's SLURM 22.05 ships both plugins): the cluster lives inside one
# machine for the length of a test, so munge adds nothing. The daemons listen on two free ports
# chosen at `up`, so two clusters (or a leftover one) never collide.
# Needs root (slurmd runs tasks as the submitting user) and, on Debian:
#   apt-get install -y --no-install-recommends slurmd slurmctld slurm-client
set -euo pipefail

die() { echo "slurm_cluster: $*" >&2; exit 1; }

check() {
    [ "$(id -u)" = 0 ] || die "needs root (slurmd)"
    for bin in slurmctld slurmd srun sinfo; do
        command -v "$bin" >/dev/null || [ -x "/usr/sbin/$bin" ] || die "needs $bin (apt-get install -y slurmd slurmctld slurm-client)"
    done
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

up() {
    local dir=$1 host ctld_port d_port cpus
    check
    mkdir -p "$dir/state" "$dir/spool"
    host=$(hostname -s)
    ctld_port=$(free_port)
    d_port=$(free_port)
    # Slots for tasks, not cores: 8 or the machine's CPUs if more (config_overrides lets slurmd accept
    # more than the hardware has). Not `nproc`: it answers OMP_NUM_THREADS (1 in tests), and a 1-CPU
    # node leaves `srun -n 2` pending for ever.
    cpus=$(getconf _NPROCESSORS_ONLN)
    [ "$cpus" -ge 8 ] || cpus=8
    while [ "$d_port" = "$ctld_port" ]; do d_port=$(free_port); done
    cat > "$dir/slurm.conf" <<EOF
ClusterName=unifieddist
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
EOF
    slurmctld -f "$dir/slurm.conf" || die "slurmctld did not start: $(tail -n 3 "$dir/slurmctld.log" 2>/dev/null)"
    slurmd -f "$dir/slurm.conf" || die "slurmd did not start: $(tail -n 3 "$dir/slurmd.log" 2>/dev/null)"
    local tries=0
    until SLURM_CONF="$dir/slurm.conf" sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; do
        tries=$((tries + 1))
        [ $tries -lt 60 ] || { down "$dir"; die "the node did not become idle in 30 s: $(tail -n 3 "$dir/slurmctld.log")"; }
        sleep 0.5
    done
}

down() {
    local dir=$1 pidfile pid
    if [ -f "$dir/slurm.conf" ]; then  # end what still runs (a hung test's step) before the daemons go
        SLURM_CONF="$dir/slurm.conf" timeout 10 scancel --user "$(id -un)" 2>/dev/null || true
        for _ in $(seq 50); do
            [ -z "$(SLURM_CONF="$dir/slurm.conf" timeout 5 squeue -h 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    check) check ;;
    up) up "${2:?usage: slurm_cluster.sh up DIR}" ;;
    down) down "${2:?usage: slurm_cluster.sh down DIR}" ;;
    *) die "usage: slurm_cluster.sh check | up DIR | down DIR" ;;
esac
