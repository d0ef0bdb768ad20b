#!/usr/bin/env bash
# scripts/cluster/stop.sh - tear down what start.sh brought up: jobs, every process in each node's network
# namespace (slurmd, slurmstepd, tasks, FUSE client), the FUSE mounts, namespaces, veths, slurmctld, slurmdbd,
# mariadbd, munged, the weed server and the bridge. Idempotent; kills only pids recorded under $MN_RUN or
# found inside the nodes' network namespaces (nothing by name). Logs and state stay unless MN_PURGE=1.
# Use the same MN_* knobs as start.sh (see common.sh).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"
[ "$(id -u)" = 0 ] || die "must run as root"
T0=$(date +%s.%N)

# 1. cancel jobs while slurmctld can still tell slurmd to kill them
if pid_alive "$MN_RUN/slurmctld.pid" slurmctld; then
  timeout 10 scancel --quiet --full $(timeout 10 squeue -h -o %i 2>/dev/null) 2>/dev/null || true
fi

# 2. nodes: every process in each node's netns (holder, weed mount, slurmd, slurmstepd, tasks), then netns
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$MN_NS($MN_PREFIX[0-9]+|$MN_LOGIN)$"); do
  k=${ns#"$MN_NS"}; k=${k#"$MN_PREFIX"}; [ "$k" = "$MN_LOGIN" ] && k=0
  node_down "$k" 5
  ip link del "$(veth_of "$k")" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  log "$ns removed"
done

# 3. host side
if pid_alive "$MN_RUN/slurmctld.pid" slurmctld; then kill_pids 10 "$(cat "$MN_RUN/slurmctld.pid")"; fi
if pid_alive "$MN_RUN/slurmdbd.pid" slurmdbd; then kill_pids 10 "$(cat "$MN_RUN/slurmdbd.pid")"; log "slurmdbd stopped"; fi
if pid_alive "$MN_RUN/mysqld.pid" mariadbd; then kill_pids 20 "$(cat "$MN_RUN/mysqld.pid")"; log "mariadbd stopped"; fi
# weed server can need >30 s for a graceful SIGTERM; its data is wiped by the next start.sh anyway
# (unless MN_KEEP_STATE=1), so SIGKILL after 3 s
if pid_alive "$MN_RUN/weed-server.pid" weed; then
  kill_pids "$([ "${MN_KEEP_STATE:-0}" = 1 ] && echo 30 || echo 3)" "$(cat "$MN_RUN/weed-server.pid")"; log "weed server stopped"
  # weed always puts these gRPC sockets in /tmp, named by port (no flag moves them)
  rm -f "/tmp/seaweedfs-master-grpc-$((MN_WEED_MASTER_PORT + 10000)).sock" "/tmp/seaweedfs-volume-grpc-$((MN_WEED_VOLUME_PORT + 10000)).sock"
fi
ip link del "$MN_BRIDGE" 2>/dev/null || true
if pid_alive "$MN_RUN/munged.pid" munged; then kill_pids 5 "$(cat "$MN_RUN/munged.pid")"; fi
rm -f "$MN_RUN"/*.pid "$MN_RUN"/*.sock

# 4. mount points start.sh created in the root fs (only if still empty)
if [ -s "$MN_RUN/created-dirs" ]; then
  while read -r d; do [ -n "$d" ] && rmdir "$d" 2>/dev/null; done < "$MN_RUN/created-dirs"
  rm -f "$MN_RUN/created-dirs"
fi
if [ "${MN_PURGE:-0}" = 1 ]; then
  find "$MN_ROOT" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
fi
log "stopped in $(printf '%.1f' "$(echo "$(date +%s.%N) - $T0" | bc)")s"
