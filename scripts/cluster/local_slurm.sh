#!/usr/bin/env bash
# A one-machine Slurm cluster (munged + slurmctld + slurmd) for trying and testing the job
# scripts; docs/slurm.md tells how to use it. Needs root.
#
#   bash scripts/cluster/local_slurm.sh start     # install slurm-wlm and munge if missing,
#                                                 # configure, start
#   export SLURM_CONF=/tmp/mpiddp-slurm/slurm.conf    # (start prints it) for sbatch, srun, squeue
#   bash scripts/cluster/local_slurm.sh status    # daemons, node and queue
#   bash scripts/cluster/local_slurm.sh stop      # cancel jobs, stop the daemons, remove the
#                                                 # scratch dir
#   bash scripts/cluster/local_slurm.sh pmi2-library   # install libpmi2-0 if missing, print
#                                                      # its path
#   bash scripts/cluster/local_slurm.sh check-ports    # are the daemons' ports free? (start
#                                                      # checks it too)
#
# Everything it writes lives in one scratch directory, LOCAL_SLURM_DIR (default
# /tmp/mpiddp-slurm): configuration, munge key and socket, state, spool, logs and pid files.
# The node has the CPUs slurmd finds; LOCAL_SLURM_CPUS=N at start pretends it has N.
# slurmctld and slurmd listen on TCP ports 6817 and 6818, Slurm's defaults; LOCAL_SLURM_PORT=P at
# start moves them to P and P+1 (where another Slurm, or any program, holds the defaults: start
# names the program holding a port and stops before anything is installed or started).
# It also has LOCAL_SLURM_GPUS (default 2) fake GPUs: Slurm's gpu resources (gres) backed by
# device files in the scratch directory, so that GPU job scripts (--gpus-per-node) schedule
# and get CUDA_VISIBLE_DEVICES as on a GPU node; there is no CUDA device behind them.
#
# LOCAL_SLURM_NODES=K at start: a K-node cluster on the nodes of scripts/cluster/local_cluster.sh
# (which must be up with K nodes or more): slurmctld in node 0, one slurmd in each node under
# its own name and address, so that jobs span nodes over the emulated network. Slurm's
# commands must then run in a node: scripts/cluster/local_cluster.sh exec 0 -- sbatch ...
# Nothing under /etc is written and no system service is started, so `stop` leaves the machine
# as it was, except for the packages `start` installed (it says so).
#
# pmi2-library: Slurm's PMI-2 client library (Debian's libpmi2-0), which MPIs without a PMI-2
# client of their own load under `srun --mpi=pmi2` (Intel MPI: I_MPI_PMI_LIBRARY=<its path>).
set -euo pipefail

DIR="${LOCAL_SLURM_DIR:-/tmp/mpiddp-slurm}"
# 0: this machine is the one node; K: K emulated nodes (recorded at start for stop/status).
NODES="${LOCAL_SLURM_NODES:-$(cat "$DIR/nodes" 2>/dev/null || echo 0)}"
CLUSTER="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/local_cluster.sh"
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
CONF="$DIR/slurm.conf"
PORT="${LOCAL_SLURM_PORT:-6817}"     # slurmctld's; slurmd's is the next one
MARK="$DIR/.made-by-local_slurm"     # stop removes only a directory this script made
export SLURM_CONF="$CONF"            # every Slurm command (and daemon) reads this config

say() { echo "[local_slurm] $*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root: it installs packages and runs slurmctld/slurmd \
as root (SlurmUser=root). Run: sudo bash $0 $1"
}

# Run a command where the cluster's daemons and clients live: on this machine, or (emulated
# nodes) in node I of scripts/cluster/local_cluster.sh, under that node's name and address.
in_node() {  # in_node I COMMAND...
  local index="$1"; shift
  if [ "$NODES" = 0 ]; then "$@"; else bash "$CLUSTER" exec "$index" -- "$@"; fi
}

# Shell commands that mount this machine's cgroup file systems again, as they are mounted
# here (cgroup v1 controllers on a tmpfs, or cgroup v2), for a slurmd in an emulated node.
cgroup_mounts() {
  awk '$2 ~ "^/sys/fs/cgroup" && ($3 == "tmpfs" || $3 == "cgroup" || $3 == "cgroup2") {
         printf "mkdir -p %s && mount -t %s -o %s %s %s && ", $2, $3, $4, $1, $2 }' /proc/self/mounts
}

# LOCAL_SLURM_PORT: a number, with room for slurmd's port after it.
check_port_setting() {
  [[ "$PORT" =~ ^[1-9][0-9]*$ ]] && [ "$PORT" -ge 1024 ] && [ "$PORT" -le 65534 ] ||
    die "LOCAL_SLURM_PORT must be a port number from 1024 to 65534 (slurmd takes the next one)"
}

# The programs listening on TCP port $1 in this network namespace, one "NAME (pid PID)" a line;
# "a process not visible here" where the socket's owner cannot be seen (another user's when not
# root, or one outside this container sharing its network).
# Read from /proc, so that no tool that may be missing (ss, netstat) is needed.
listeners() {  # listeners PORT
  local inodes inode fd pid found
  # /proc/net/tcp{,6}: the local address as HEXADDR:HEXPORT, state 0A (LISTEN), inode field 10.
  inodes="$(awk -v port=":$(printf '%04X' "$1")" \
            '$4 == "0A" && substr($2, length($2) - 4) == port { print $10 }' \
            /proc/net/tcp /proc/net/tcp6 2>/dev/null | sort -u)"
  for inode in $inodes; do
    found=""
    for fd in $(find /proc/[0-9]*/fd -lname "socket:\[$inode\]" 2>/dev/null); do
      pid="${fd#/proc/}"; pid="${pid%%/*}"
      found+="$(cat "/proc/$pid/comm" 2>/dev/null || echo '?') (pid $pid)"$'\n'
    done
    [ -n "$found" ] ||
      found="a process not visible here (another user's, or outside this container)"$'\n'
    printf '%s' "$found"
  done | sort -u
}

# Stop, naming the programs, when another program listens on slurmctld's or slurmd's port: the
# daemons would start, fail with "Address already in use", and leave that line at the end of
# their logs after a screen of other output. With emulated nodes, inside each node.
check_ports() {
  check_port_setting
  local i port holders busy=0
  if [ "$NODES" != 0 ]; then   # each node is a network namespace of its own: look inside it
    for i in $(seq 0 $((NODES - 1))); do
      in_node "$i" env LOCAL_SLURM_NODES=0 LOCAL_SLURM_PORT="$PORT" bash "$SELF" check-ports \
        >/dev/null || die "the ports are in use in emulated node $i (above)"
    done
    return
  fi
  for port in "$PORT" $((PORT + 1)); do
    holders="$(listeners "$port" | paste -sd, - | sed 's/,/, /g')"
    if [ -n "$holders" ]; then
      say "error: port $port, which $([ "$port" = "$PORT" ] && echo slurmctld || echo slurmd)" \
          "needs, is in use by $holders"
      busy=1
    fi
  done
  if [ "$busy" = 1 ]; then
    say "stop that program (a Slurm of the system: systemctl stop slurmctld slurmd; a cluster" \
        "of this script under another LOCAL_SLURM_DIR: its stop), or give this cluster other" \
        "ports: LOCAL_SLURM_PORT=P at start gives slurmctld port P and slurmd P+1" \
        "(LOCAL_SLURM_PORT=7817 bash $SELF start). Every listening port: ss -ltnp"
    exit 1
  fi
}

# Slurm's commands, where they reach the controller: here, or in emulated node 0.
client() { in_node 0 "$@"; }

# The slurmd daemons' tags: slurmd (this machine), or slurmd-I for emulated node I.
slurmd_tags() {
  if [ "$NODES" = 0 ]; then echo slurmd; else seq -f 'slurmd-%g' 0 $((NODES - 1)); fi
}

# The pid in a pid file, if that process is alive and is the program we expect. The daemons
# detach, so an init that does not reap (containers) keeps them as zombies: those are dead.
alive() {  # alive PIDFILE PROGRAM
  local pid
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] &&
    ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null && echo "$pid"
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
     command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and there is no apt-get"
  say "installing slurm-wlm and munge with apt-get (they stay installed after stop)"
  # Keep the packages from starting their own services: we run the daemons ourselves.
  local policy=/usr/sbin/policy-rc.d made_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
  fi
  local install=(apt-get install -y -q --no-install-recommends slurm-wlm munge)
  local rc=0
  DEBIAN_FRONTEND=noninteractive "${install[@]}" >&2 ||
    { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive "${install[@]}" >&2; } || rc=$?
  [ -z "$made_policy" ] || rm -f "$policy"
  [ "$rc" = 0 ] || die "apt-get could not install slurm-wlm and munge"
}

# Slurm's PMI-2 library (libpmi2.so.0), installed if missing; prints its path.
pmi2_library() {
  need_root pmi2-library
  local found
  found="$(ldconfig -p | awk '$1 == "libpmi2.so.0" { print $NF; exit }')"
  if [ -z "$found" ]; then
    command -v apt-get >/dev/null || die "libpmi2.so.0 is missing and there is no apt-get"
    say "installing libpmi2-0 with apt-get (it stays installed)"
    local install=(apt-get install -y -q --no-install-recommends libpmi2-0)
    DEBIAN_FRONTEND=noninteractive "${install[@]}" >&2 ||
      { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive "${install[@]}" >&2; } ||
      die "apt-get could not install libpmi2-0"
    found="$(ldconfig -p | awk '$1 == "libpmi2.so.0" { print $NF; exit }')"
    [ -n "$found" ] || die "libpmi2-0 is installed but libpmi2.so.0 is not in ldconfig's cache"
  fi
  echo "$found"
}

# N fake GPUs: character devices (the null device's numbers: nothing behind them) in the
# scratch directory, and a gres.conf beside slurm.conf naming them, without autodetection.
fake_gpus() {  # fake_gpus N
  mkdir -p "$DIR/dev"
  local i
  for i in $(seq 0 $(($1 - 1))); do
    [ -e "$DIR/dev/gpu$i" ] || mknod "$DIR/dev/gpu$i" c 1 3
  done
  printf 'AutoDetect=off\nName=gpu File=%s/dev/gpu[0-%d]\n' "$DIR" $(($1 - 1)) > "$DIR/gres.conf"
}

write_config() {
  local host node overrides="" controller nodes_lines i name first_job_id
  host="$(hostname -s)"
  # slurmd reports this machine's CPUs, sockets, cores and memory; use them as they are.
  node="$(slurmd -C | head -n 1)"
  [[ "$node" == NodeName=* ]] || die "slurmd -C did not describe the node: $node"
  if [ -n "${LOCAL_SLURM_CPUS:-}" ]; then
    # More CPUs than the machine has, for job scripts that ask for more tasks per node than
    # it has CPUs (--ntasks-per-node refuses that even with --overcommit).
    [[ "$LOCAL_SLURM_CPUS" =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_CPUS must be a number"
    node="NodeName=$host CPUs=$LOCAL_SLURM_CPUS $(grep -o 'RealMemory=[0-9]*' <<< "$node")"
    overrides="SlurmdParameters=config_overrides"
  fi
  if [ "$NODES" = 0 ]; then
    controller="$host(127.0.0.1)"
    nodes_lines="$node NodeAddr=127.0.0.1 State=UNKNOWN"
  else
    # Every emulated node is this machine's CPUs and memory over again (they share them).
    node="${node#NodeName=* }"
    controller="$(in_node 0 hostname)($(bash "$CLUSTER" address 0))"
    nodes_lines=""
    for i in $(seq 0 $((NODES - 1))); do
      name="$(in_node "$i" hostname)"
      nodes_lines+="NodeName=$name $node NodeAddr=$(bash "$CLUSTER" address "$i") State=UNKNOWN"$'\n'
    done
  fi
  local gpus="${LOCAL_SLURM_GPUS:-2}" gres_types=""
  [[ "$gpus" =~ ^[0-9]+$ ]] || die "LOCAL_SLURM_GPUS must be a number"
  if [ "$gpus" -gt 0 ]; then
    fake_gpus "$gpus"
    gres_types="GresTypes=gpu"
    nodes_lines="$(sed '/^NodeName=/s/$/ Gres=gpu:'"$gpus"'/' <<< "$nodes_lines")"
  fi
  # Seconds since the epoch, below Slurm's MaxJobId (67043328): a new range at every start.
  first_job_id=$(( $(date +%s) % 60000000 + 1000 ))
  cat > "$CONF" <<EOF
# Written by scripts/cluster/local_slurm.sh: a cluster for testing; removed by its 'stop'.
ClusterName=mpiddp-local
SlurmctldHost=$controller
# LOCAL_SLURM_PORT (default: Slurm's own 6817 and 6818).
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
# munged of this cluster, with its own key and socket (nothing in /etc/munge is used).
AuthType=auth/munge
CredType=cred/munge
# cred_expire also holds a requeued job back (cred_expire + 1 s; default 120): keep it short
# so that a preempted-and-requeued test job starts again within seconds.
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
# No cgroups: plain process tracking and no task binding work in containers and VMs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Like many sites: srun starts no PMI unless asked (--mpi=pmi2), so srun without it is testable.
MpiDefault=none
StateSaveLocation=$DIR/state
# %n: the node's name, so that several slurmd (emulated nodes) keep their files apart.
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
MailProg=/bin/true
$gres_types
# Job ids that no earlier start of this script used: MPICH names a job's shared-memory segment
# after its PMI job ("<job>.<step>"), so job 1 of a new cluster would meet a segment that a
# killed task of an earlier cluster's job 1 left in /dev/shm, and its ranks stop in MPI_Init
# ("Out of memory"). Real clusters never reuse ids this way.
FirstJobId=$first_job_id
# No accounting database: keep finished jobs in 'scontrol show job' for an hour instead.
MinJobAge=3600
KillWait=5
# Schedule pending jobs every few seconds (default 60), e.g. a requeued job once eligible.
SchedulerParameters=sched_interval=2
$overrides
$nodes_lines
# More tasks than CPUs: submit with --overcommit (-O), or start with LOCAL_SLURM_CPUS=N.
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

abandon() {  # a failed start: show the logs, undo what was started, fail
  say "error: $1; the logs end with:"
  tail -n 15 "$DIR"/log/* >&2 || true
  stop >/dev/null 2>&1 || true
  exit 1
}

# Run a daemon in the foreground of its own session and record its pid ourselves: a detaching
# daemon writes its pid file late or not at all when it fails (slurmd writes it only once it has
# registered), and then nothing could stop it.
launch() {  # launch TAG NODE PROGRAM ARGS...: NODE "" is this machine, else an emulated node
  local tag="$1" at="$2"; shift 2
  if [ -z "$at" ]; then
    setsid "$@" >> "$DIR/log/$tag.out" 2>&1 < /dev/null &
  else    # the same process through to the daemon (local_cluster.sh exec execs it)
    setsid bash "$CLUSTER" exec "$at" -- "$@" >> "$DIR/log/$tag.out" 2>&1 < /dev/null &
  fi
  echo $! > "$DIR/$tag.pid"
}

# Wait up to $2 seconds for the command $1 to succeed; slurm commands get 5 s each.
wait_for() {
  local deadline=$((SECONDS + $2))
  until eval "$1" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

start() {
  need_root start
  if [ -n "$(alive "$DIR/slurmctld.pid" slurmctld)" ]; then
    say "already running (stop it first to start afresh)"
    echo "export SLURM_CONF=$CONF"
    return
  fi
  if [ -e "$DIR" ]; then   # left from a run that did not stop cleanly: clear it first
    [ -e "$MARK" ] || die "$DIR exists and was not made by this script; set LOCAL_SLURM_DIR"
    stop
  fi
  NODES="${LOCAL_SLURM_NODES:-0}"
  if [ "$NODES" != 0 ]; then
    [[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_NODES must be a number"
    bash "$CLUSTER" exec $((NODES - 1)) -- true ||
      die "LOCAL_SLURM_NODES=$NODES needs scripts/cluster/local_cluster.sh up with $NODES" \
        "nodes or more"
  fi
  check_ports             # before anything is installed or started
  install_packages
  # Readable by all (the configuration, munge's socket), so that other users can submit too.
  mkdir -p "$DIR" && chmod 755 "$DIR" && touch "$MARK"
  mkdir -m 755 "$DIR/munge" && mkdir -m 700 "$DIR/state" "$DIR/spool" "$DIR/log"
  echo "$NODES" > "$DIR/nodes"
  # munged refuses to run as root without --force, and wants its socket directory to exist.
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge/munge.key"
  launch munged "" munged --foreground --force --key-file="$DIR/munge/munge.key" \
    --socket="$DIR/munge/munge.socket" --pid-file="$DIR/munge/munged.pid" \
    --seed-file="$DIR/munge/munged.seed"
  wait_for "[ -S '$DIR/munge/munge.socket' ]" 10 || abandon "munged did not start"
  write_config
  local controller_node="" expected_nodes=1
  [ "$NODES" = 0 ] || { controller_node=0; expected_nodes="$NODES"; }
  launch slurmctld "$controller_node" slurmctld -D
  wait_for "client timeout 5 scontrol ping | grep -q UP" 30 || abandon "slurmctld did not start"
  local tag node=""
  for tag in $(slurmd_tags); do
    [ "$tag" = slurmd ] || node="${tag#slurmd-}"         # slurmd-I runs in node I
    mkdir -m 700 "$DIR/spool/$(in_node "${node:-0}" hostname -s)"     # SlurmdSpoolDir's %n
    # `ip netns exec` gives a node a /sys of its own, without the cgroup mounts slurmd needs
    # to start: mount the machine's again there (in the node's private mount namespace).
    launch "$tag" "$node" sh -c "${node:+$(cgroup_mounts)} exec slurmd -D"
  done
  # Every node idle: sinfo lists one state per line (one line when all agree).
  wait_for "[ \"\$(client timeout 5 sinfo -h -o %T | sort -u)\" = idle ] &&
            [ \"\$(client timeout 5 sinfo -h -N -o %N | sort -u | wc -l)\" = $expected_nodes ]" 30 ||
    abandon "slurmd did not bring the node(s) up"
  say "running: $(client sinfo -h -o '%D node(s) %N, %c CPUs each, partition %P')"
  echo "export SLURM_CONF=$CONF"
  [ "$NODES" = 0 ] || say "commands in node 0: bash $CLUSTER exec 0 -- sbatch ..."
}

stop_daemon() {  # stop_daemon TAG [PROGRAM]: SIGTERM, then SIGKILL after 10 s
  local pid program="${2:-$1}"
  pid="$(alive "$DIR/$1.pid" "$program")" || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do [ -n "$(alive "$DIR/$1.pid" "$program")" ] || return 0; sleep 0.2; done
  say "$1 ($pid) did not stop on SIGTERM; killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  need_root stop
  if [ ! -e "$DIR" ]; then say "not running (no $DIR)"; return; fi
  [ -e "$MARK" ] || die "$DIR was not made by this script; not touching it"
  if [ -n "$(alive "$DIR/slurmctld.pid" slurmctld)" ]; then
    # Jobs first, so that slurmd's step daemons end their tasks before the daemons go.
    local jobs
    jobs="$(client timeout 10 squeue -h -o %i 2>/dev/null || true)"
    if [ -n "$jobs" ]; then
      say "cancelling jobs: $(echo $jobs)"
      # shellcheck disable=SC2086
      client timeout 10 scancel $jobs || true
      wait_for '[ -z "$(client timeout 5 squeue -h -o %i)" ]' 20 || say "jobs still listed; going on"
    fi
  fi
  local tag
  for tag in "$DIR"/slurmd*.pid; do
    [ -e "$tag" ] && stop_daemon "$(basename "$tag" .pid)" slurmd
  done
  stop_daemon slurmctld
  stop_daemon munged
  rm -rf "$DIR"
  say "stopped; removed $DIR. The packages slurm-wlm and munge stay installed" \
      "(apt-get purge slurm-wlm munge removes them)."
}

status() {
  local down=0 tag pid
  for tag in munged slurmctld $(slurmd_tags); do
    if pid="$(alive "$DIR/$tag.pid" "${tag%%-*}")"; then
      say "$tag: running (pid $pid)"
    else
      say "$tag: not running"; down=$((down + 1))
    fi
  done
  if [ "$down" = 0 ]; then
    client sinfo >&2 && client squeue >&2
    echo "export SLURM_CONF=$CONF"
  fi
  [ "$down" = 0 ]
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  pmi2-library) pmi2_library ;;
  check-ports) check_ports; say "ports $PORT (slurmctld) and $((PORT + 1)) (slurmd) are free" ;;
  *) echo "usage: $0 start|stop|status|pmi2-library|check-ports   (scratch directory: $DIR)" >&2
     exit 2 ;;
esac
