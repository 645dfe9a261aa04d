#!/usr/bin/env bash
# A small cluster on one machine: N hosts (2 to 4), each a set of Linux
# namespaces, joined by a private bridge, with a real Slurm.
#
# Usage (as root):
#   tests/cluster/cluster.sh up N     # hosts node1..nodeN, Slurm up (down first if up)
#   tests/cluster/cluster.sh exec HOST COMMAND...   # HOST: head or nodeK
#   tests/cluster/cluster.sh down     # every process, namespace, mount gone
# then, for example:
#   tests/cluster/cluster.sh exec head srun -N 2 -n 4 --mpi=pmi2 python prog.py
#   tests/cluster/cluster.sh exec node1 mpiexec -launcher ssh \
#       -launcher-exec "$DIR/ssh" -iface eth0 -hosts node1,node2 -n 4 python prog.py
#   tests/cluster/cluster.sh exec node1 mpirun --hostfile "$DIR/hostfile" \
#       --mca plm_rsh_agent "$DIR/ssh" -n 4 python prog.py
# DIR is $JAXCOMM_CLUSTER_DIR (default /var/tmp/jaxcomm-cluster); it holds
# the configuration, the logs, the fake ssh and the host file. Commands run
# with the caller's environment (PATH, an activated venv): the file system
# is shared by every host, as a cluster's home is.
#
# Each node is a network, UTS (host name), IPC and mount namespace (its own
# /dev/shm and /etc/hosts), so MPI cannot use shared memory between nodes:
# UCX takes two processes for one node when they share the boot id and the
# IPC namespace. Each node's eth0 is a veth whose peer sits on the bridge
# br0 in the namespace "head" (the login node: slurmctld, 10.213.37.1); node
# K is 10.213.37.(10+K). Nothing is routed beyond the bridge. Namespaces are
# held by processes (unshare ... sleep), not by files under /run/netns, so
# nothing outside DIR is left behind once those processes end. munged runs
# in the root namespace with its key and socket in DIR (a Unix socket path
# crosses network namespaces).
set -euo pipefail

DIR=${JAXCOMM_CLUSTER_DIR:-/var/tmp/jaxcomm-cluster}
NET=10.213.37

die() {
  echo "cluster.sh: $*" >&2
  exit 1
}

# The process that holds HOST's namespaces.
holder() {
  local pid
  pid=$(cat "$DIR/$1/pid" 2>/dev/null) || die "no host $1 (is the cluster up?)"
  [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$(cat "$DIR/$1/netns")" ] || die "host $1 is gone"
  echo "$pid"
}

# Runs a command inside HOST's namespaces, in the current directory
# (entering a mount namespace would start it in /).
in_host() {
  local pid
  pid=$(holder "$1")
  shift
  nsenter -t "$pid" -n -u -i -m --wd="$PWD" -- "$@"
}

# Every process in a namespace held by one of our hosts, and munged.
our_processes() {
  local namespaces pid
  namespaces=$(cat "$DIR"/*/netns 2>/dev/null || true)
  if [ -n "$namespaces" ]; then
    # One pass over /proc: a readlink per process would take seconds.
    find /proc -mindepth 3 -maxdepth 3 -path '/proc/[0-9]*/ns/net' -printf '%l %h\n' 2>/dev/null |
      grep -F -f <(echo "$namespaces") | sed -E 's|^.* /proc/([0-9]+)/ns$|\1|' || true
  fi
  if [ -f "$DIR/munge/pid" ]; then
    pid=$(cat "$DIR/munge/pid")
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = munged ] && echo "$pid"
  fi
  return 0
}

down() {
  [ -d "$DIR" ] || return 0
  local pids all p
  pids=$(our_processes)
  all=$pids
  if [ -n "$pids" ]; then
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 50); do
      pids=$(our_processes)
      [ -z "$pids" ] && break
      sleep 0.1
    done
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
    fi
    for _ in $(seq 50); do
      [ -z "$(our_processes)" ] && break
      sleep 0.1
    done
    [ -z "$(our_processes)" ] || die "processes left: $(our_processes | tr '\n' ' ')"
    # A process that is exiting has left its namespaces already: wait for it too.
    for p in $all; do
      for _ in $(seq 50); do
        { [ -d "/proc/$p" ] && ! grep -q '^State:.*Z' "/proc/$p/status" 2>/dev/null; } || break
        sleep 0.1
      done
    done
  fi
  # The mounts and interfaces went with their namespaces' last process.
  rm -rf "$DIR"
}

# Writes the Slurm, munge and launcher files for nodes 1..N.
configure() {
  local n=$1 k
  mkdir -p "$DIR/log" "$DIR/ctld" "$DIR/munge"
  {
    echo "127.0.0.1 localhost"
    echo "$NET.1 head"
    for k in $(seq "$n"); do echo "$NET.$((10 + k)) node$k"; done
  } >"$DIR/hosts"
  for k in $(seq "$n"); do echo "node$k slots=2"; done >"$DIR/hostfile"
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=jaxcomm
SlurmctldHost=head($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/socket
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/%n/spool
SlurmctldPidFile=$DIR/ctld/slurmctld.pid
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
MessageTimeout=20
NodeName=node[1-$n] CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 State=UNKNOWN
PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
EOF
  # ip netns exec mounts an empty /sys/fs/cgroup, where Slurm cannot tell
  # the version; these mount namespaces keep the machine's, but a node must
  # not depend on which one it sees.
  echo "CgroupPlugin=cgroup/v1" >"$DIR/cgroup.conf"
  # An ssh that enters a host's namespaces: what MPICH's and Open MPI's ssh
  # launchers call. As a login shell on a shared home would, it keeps PATH
  # (the venv) and starts in HOME; the rest of the environment is not
  # carried, as ssh does not carry it.
  cat >"$DIR/ssh" <<EOF
#!/usr/bin/env bash
set -euo pipefail
while [ \$# -gt 0 ]; do
  case \$1 in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=\${1%%.*}
shift
pid=\$(cat "$DIR/\$host/pid" 2>/dev/null) || { echo "ssh: \$host: no such host" >&2; exit 255; }
exec nsenter -t "\$pid" -n -u -i -m -- env -i PATH="\$PATH" HOME="\${HOME:-/root}" \
  \${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="\$LD_LIBRARY_PATH"} bash -c 'cd "\$HOME" && eval "\$1"' ssh "\$*"
EOF
  chmod +x "$DIR/ssh"
}

# Makes host NAME with address ADDR: a process holding fresh namespaces,
# its host name, loopback, /dev/shm and /etc/hosts.
make_host() {
  local name=$1 pid
  mkdir -p "$DIR/$name/spool"
  unshare --net --uts --ipc --mount --propagation private sleep infinity &
  pid=$!
  echo "$pid" >"$DIR/$name/pid"
  # unshare has execed sleep once the namespace differs from ours.
  for _ in $(seq 50); do
    [ "$(readlink "/proc/$pid/ns/net")" != "$(readlink /proc/self/ns/net)" ] &&
      [ "$(readlink "/proc/$pid/exe")" != "$(readlink -f "$(command -v unshare)")" ] && break
    sleep 0.05
  done
  readlink "/proc/$pid/ns/net" >"$DIR/$name/netns"
  nsenter -t "$pid" -n -u -i -m -- sh -ec "
    hostname $name
    ip link set lo up
    mount -t tmpfs -o mode=1777,size=4g shm /dev/shm
    mount --bind '$DIR/hosts' /etc/hosts"
}

up() {
  local n=$1 k
  [[ $n =~ ^[2-4]$ ]] || die "up N: N must be 2, 3 or 4"
  [ "$(id -u)" = 0 ] || die "needs root (namespaces, veth, a bridge)"
  for tool in slurmctld slurmd srun munged; do
    command -v "$tool" >/dev/null || die "$tool not found: apt-get install -y slurm-wlm munge"
  done
  down
  configure "$n"
  make_host head
  in_host head sh -ec "
    ip link add br0 type bridge
    ip addr add $NET.1/24 dev br0
    ip link set br0 up"
  for k in $(seq "$n"); do
    make_host "node$k"
    # The veth is made inside head, its eth0 end moved straight into the node.
    in_host head ip link add "veth$k" type veth peer name eth0 netns "$(holder "node$k")"
    in_host head sh -ec "ip link set veth$k master br0; ip link set veth$k up"
    in_host "node$k" sh -ec "
      ip addr add $NET.$((10 + k))/24 dev eth0
      ip link set eth0 up"
  done
  dd if=/dev/urandom of="$DIR/munge/key" bs=1024 count=1 status=none
  chmod 700 "$DIR/munge"
  chmod 400 "$DIR/munge/key"
  munged --force --key-file="$DIR/munge/key" --socket="$DIR/munge/socket" \
    --pid-file="$DIR/munge/pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
  export SLURM_CONF=$DIR/slurm.conf
  in_host head slurmctld -f "$SLURM_CONF"
  for k in $(seq "$n"); do in_host "node$k" slurmd -f "$SLURM_CONF"; done
  # Up when every node is idle.
  for _ in $(seq 300); do
    [ "$(in_host head sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$n" ] && break
    sleep 0.1
  done
  [ "$(in_host head sinfo -h -N -t idle -o %N | sort -u | wc -l)" = "$n" ] ||
    die "Slurm nodes not idle: $(in_host head sinfo -N 2>&1); logs in $DIR/log"
  echo "cluster up: head + node1..node$n on $NET.0/24, Slurm idle; SLURM_CONF=$SLURM_CONF, ssh agent $DIR/ssh, host file $DIR/hostfile"
}

case ${1:-} in
up) up "${2:-2}" ;;
down) down ;;
exec)
  [ $# -ge 3 ] || die "exec HOST COMMAND..."
  host=$2
  shift 2
  SLURM_CONF=$DIR/slurm.conf in_host "$host" "$@"
  ;;
*) die "usage: cluster.sh up N | exec HOST COMMAND... | down" ;;
esac
