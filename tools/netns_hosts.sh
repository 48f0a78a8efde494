#!/usr/bin/env bash
# Two test "hosts" on this machine: Linux network namespaces joined by a veth pair.
#
#   tools/netns_hosts.sh up   SUFFIX   # ud-h1-SUFFIX (192.0.2.1) <-> ud-h2-SUFFIX (192.0.2.2)
#   tools/netns_hosts.sh down SUFFIX   # kill every process inside them, delete them (and the veth)
#   tools/netns_hosts.sh check         # exit 0 if namespaces can be made here (root, iproute2)
#   tools/netns_hosts.sh exec SUFFIX 1|2 COMMAND...   # run COMMAND on host 1 or 2
#
# Each namespace gets lo and one interface named udnet0 (the same name on both "hosts", as
# horovodrun's --network-interface and HOROVOD_GLOO_IFACE need), addresses from the documentation
# range 192.0.2.0/24 only, and no default route: a process inside reaches the other namespace
# and nothing else, so no traffic leaves the machine. Like real hosts, each has its own host name
# (`exec` runs the command in a new UTS namespace named after the network namespace) and an
# /etc/hosts naming both (ip netns exec bind-mounts /etc/netns/NAME/hosts over /etc/hosts;
# resolv.conf there points at the namespace's own loopback, so name look-ups never leave it
# either). Host names matter: torchrun's c10d rendezvous decides which node serves the store by
# comparing the endpoint with the addresses of its own host name.
# Needs root and iproute2 (Debian: apt-get install -y iproute2).
set -euo pipefail

NIC=udnet0
ADDR1=192.0.2.1
ADDR2=192.0.2.2

die() { echo "netns_hosts: $*" >&2; exit 1; }

check() {
    [ "$(id -u)" = 0 ] || die "needs root (ip netns add)"
    command -v ip >/dev/null || die "needs iproute2 (apt-get install -y iproute2)"
    local probe="ud-probe-$$" err
    if ! err=$(ip netns add "$probe" 2>&1); then
        die "ip netns add fails here (${err:-no reason given}); needs CAP_SYS_ADMIN and network namespace support"
    fi
    ip netns del "$probe"
}

kill_inside() {  # every process inside namespace $1, SIGKILL, until none is left (bounded)
    local ns=$1 tries=0 pids
    while pids=$(ip netns pids "$ns" 2>/dev/null) && [ -n "$pids" ] && [ $tries -lt 20 ]; do
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
        tries=$((tries + 1))
        sleep 0.1
    done
}

up() {
    local s=$1 a="ud-h1-$1" b="ud-h2-$1"
    ip netns add "$a"
    ip netns add "$b"
    # Created straight into the namespaces: nothing appears in (or routes through) the root namespace.
    ip link add "$NIC" netns "$a" type veth peer name "$NIC" netns "$b"
    ip -n "$a" addr add "$ADDR1/24" dev "$NIC"
    ip -n "$b" addr add "$ADDR2/24" dev "$NIC"
    for ns in "$a" "$b"; do
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$NIC" up
    done
    # the peer is reached over the veth and nothing else is routed
    ip -n "$a" route get "$ADDR2" | grep -q "dev $NIC" || die "$a: $ADDR2 not routed via $NIC"
    ip -n "$b" route get "$ADDR1" | grep -q "dev $NIC" || die "$b: $ADDR1 not routed via $NIC"
    if ip -n "$a" route show default | grep -q . || ip -n "$b" route show default | grep -q .; then
        die "a namespace has a default route"
    fi
    for ns in "$a" "$b"; do
        mkdir -p "/etc/netns/$ns"
        printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "$ADDR1" "$a" "$ADDR2" "$b" > "/etc/netns/$ns/hosts"
        printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' > "/etc/netns/$ns/resolv.conf"
    done
    echo "$a $ADDR1 $NIC"
    echo "$b $ADDR2 $NIC"
}

down() {
    local s=$1 ns
    for ns in "ud-h1-$s" "ud-h2-$s"; do
        if ip netns list | awk '{print $1}' | grep -qx "$ns"; then
            kill_inside "$ns"
            ip netns del "$ns" || true
        fi
        rm -rf "/etc/netns/$ns"
    done
    rmdir /etc/netns 2>/dev/null || true  # only if no other namespace keeps files there
}

run_on() {  # run_on SUFFIX 1|2 COMMAND...: on that host, under its own host name
    local ns="ud-h$2-$1"
    shift 2
    exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$1" && shift && exec "$@"' sh "$ns" "$@"
}

case "${1:-}" in
    up) [ -n "${2:-}" ] || die "usage: $0 up SUFFIX"; up "$2" ;;
    down) [ -n "${2:-}" ] || die "usage: $0 down SUFFIX"; down "$2" ;;
    check) check ;;
    exec) [ $# -ge 4 ] && [[ "$3" =~ ^[12]$ ]] || die "usage: $0 exec SUFFIX 1|2 COMMAND..."; shift; run_on "$@" ;;
    *) die "usage: $0 up SUFFIX | down SUFFIX | exec SUFFIX 1|2 COMMAND... | check" ;;
esac
