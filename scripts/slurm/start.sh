#!/usr/bin/env bash
# scripts/slurm/start.sh - the project's own single-node SLURM cluster, for tests, CI and trying the
# pipeline's SLURM launcher on one machine. Installs (if needed, through scripts/system-packages.sh) and
# starts SLURM 22.05 from Debian bookworm packages, without systemd: munged + slurmctld + slurmd (+ mariadbd
# + slurmdbd, so that sacct works and submitit learns about cancelled/killed jobs).
#
#   sudo bash scripts/slurm/start.sh     # ~15 s fresh (plus apt-get the first time); then `sinfo`
#   sudo bash scripts/slurm/stop.sh      # cancels jobs, stops the daemons
#
# tests/slurm/conftest.py (fixture `slurm_cluster`) runs it when no usable cluster is up, and stops it at
# the end of the session. Idempotent: with the same SLURM_ROOT and config it does nothing; anything
# half-up is stopped and restarted from a clean state. Refuses to touch a running cluster that another
# SLURM_ROOT started (use that SLURM_ROOT, or stop it first). Must run as root.
#
# The node advertises SLURM_CPUS CPUs whatever the hardware; EnforcePartLimits=ALL rejects bigger asks
# at once. DependencyParameters is left unset on purpose: `afterok` on a failed job then pends forever
# unless the job was submitted with --kill-on-invalid-dep=yes, which the pipeline does itself.
#
# Env knobs (defaults in brackets):
#   SLURM_ROOT        state/log/spool/pid dir                          [/tmp/pipeline-slurm]
#   SLURM_CPUS        CPUs advertised for the node (overcommitted)     [8]
#   SLURM_MEM_MB      RealMemory advertised (not enforced)             [16000]
#   SLURM_PARTITION   partition name (the default partition)           [debug]
#   SLURM_ACCOUNTING  1 = slurmdbd + MariaDB so sacct works fully;
#                     0 = no DB (sacct only via `sacct -c`, jobcomp)   [1]
#   SLURM_KEEP_STATE  1 = keep slurmctld state + accounting DB of the last run [0]
#   SLURMCTLD_PORT / SLURMD_PORT / SLURMDBD_PORT                       [6817/6818/6819]
#   SLURM_EXTRA_CONF  extra slurm.conf lines, e.g. "DependencyParameters=kill_invalid_depend"
#   SLURM_SKIP_INSTALL=1  never call apt-get
#
# Exit status: 0 up, 3 packages missing and not installed (its last line says why; the test fixture skips
# then), 1 other errors.
set -euo pipefail

SLURM_ROOT=${SLURM_ROOT:-/tmp/pipeline-slurm}
SLURM_CPUS=${SLURM_CPUS:-8}
SLURM_MEM_MB=${SLURM_MEM_MB:-16000}
SLURM_PARTITION=${SLURM_PARTITION:-debug}
SLURM_ACCOUNTING=${SLURM_ACCOUNTING:-1}
SLURM_KEEP_STATE=${SLURM_KEEP_STATE:-0}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
SLURMDBD_PORT=${SLURMDBD_PORT:-6819}
SLURM_EXTRA_CONF=${SLURM_EXTRA_CONF:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODE=$(hostname -s)
CONF=/etc/slurm/slurm.conf
DBDCONF=/etc/slurm/slurmdbd.conf
MYSOCK=/run/mysqld/mysqld.sock
export SLURM_ROOT

log() { echo "[slurm/start.sh] $(date +%T) $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"

pid_alive() {  # pid_alive PIDFILE EXE_BASENAME  (guards against PID reuse)
  local f=$1 exe=$2 p
  [ -s "$f" ] || return 1
  p=$(cat "$f" 2>/dev/null) || return 1
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || return 1
  case "$(readlink -f "/proc/$p/exe" 2>/dev/null)" in */"$exe"|*/"$exe"-wlm) return 0;; esac  # Debian: slurmctld -> slurmctld-wlm
  return 1
}
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
reap_orphans() {  # reap_orphans USER EXE: stop every EXE run by USER (SIGTERM, then SIGKILL after 30 s)
  local user=$1 exe=$2
  pgrep -u "$user" -x "$exe" >/dev/null || return 0
  log "stopping a leftover $exe ($(pgrep -u "$user" -x "$exe" | tr '\n' ' '))"
  pkill -TERM -u "$user" -x "$exe"
  wait_for 300 0.1 bash -c "! pgrep -u $user -x $exe" || pkill -KILL -u "$user" -x "$exe"
  wait_for 50 0.1 bash -c "! pgrep -u $user -x $exe"
}
wait_for() {  # wait_for TRIES SLEEP CMD...
  local n=$1 s=$2; shift 2
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep "$s"; done
  "$@" >/dev/null 2>&1
}
node_ok() { sinfo -h -n "$NODE" -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)$'; }
ctld_ok() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

# ------------------------------------------------------------------ install
need_pkgs=()
for b in slurmctld slurmd sbatch munged pgrep; do command -v $b >/dev/null 2>&1 || need_pkgs=(slurmctld slurmd slurm-client munge procps); done
if [ "$SLURM_ACCOUNTING" = 1 ]; then
  command -v slurmdbd >/dev/null 2>&1 && command -v mariadbd >/dev/null 2>&1 || need_pkgs+=(slurmdbd mariadb-server)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  [ "${SLURM_SKIP_INSTALL:-0}" = 1 ] && { log "ERROR: missing packages and SLURM_SKIP_INSTALL=1: ${need_pkgs[*]}"; exit 3; }
  # one apt at a time, waiting for the dpkg lock of any other apt (scripts/test.sh runs it once for all the tests;
  # pytest-xdist workers may start both clusters at once). Its last line says what could not be installed and why.
  bash "$HERE/../system-packages.sh" slurmctld slurmd slurm-client munge procps \
      $( [ "$SLURM_ACCOUNTING" = 1 ] && echo slurmdbd mariadb-server ) || exit 3
fi

# ------------------------------------------------------------------ hostname must resolve
# (srun/slurmstepd and torch.distributed MASTER_ADDR=<hostname> need it)
if ! getent hosts "$NODE" >/dev/null 2>&1; then
  log "adding '127.0.0.1 $NODE' to /etc/hosts"
  echo "127.0.0.1 $NODE" >> /etc/hosts || log "WARNING: cannot write /etc/hosts; torch.distributed MASTER_ADDR=$NODE will not resolve"
fi

# ------------------------------------------------------------------ desired config
mkdir -p "$SLURM_ROOT"/{state,spool/slurmd,run,log} /etc/slurm
if [ "$SLURM_ACCOUNTING" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=${SLURMDBD_PORT}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
# job ids continue from the last run (see stop.sh), also after a clean start
FIRST_JOB_ID=$(cat "$SLURM_ROOT/next_job_id" 2>/dev/null || echo 1)
case "$FIRST_JOB_ID" in ''|*[!0-9]*) FIRST_JOB_ID=1;; esac
NEWCONF=$(cat <<EOF
# generated by scripts/slurm/start.sh (SLURM_ROOT=${SLURM_ROOT})
ClusterName=ci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# requeued jobs wait cred_expire+1 s before they may start again (default 120 s)
AuthInfo=cred_expire=10
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
${ACCT}
JobCompType=jobcomp/filetxt
JobCompLoc=${SLURM_ROOT}/log/jobcomp.txt
StateSaveLocation=${SLURM_ROOT}/state
SlurmdSpoolDir=${SLURM_ROOT}/spool/slurmd
SlurmctldPidFile=${SLURM_ROOT}/run/slurmctld.pid
SlurmdPidFile=${SLURM_ROOT}/run/slurmd.pid
SlurmctldLogFile=${SLURM_ROOT}/log/slurmctld.log
SlurmdLogFile=${SLURM_ROOT}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# slurmd reports the configured CPUs/memory instead of the real hardware (2 cores here)
SlurmdParameters=config_overrides
ReturnToService=2
# reject (instead of queueing forever) jobs asking for more than the node has
EnforcePartLimits=ALL
SlurmctldTimeout=120
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=300
KillWait=5
OverTimeLimit=0
Waittime=0
MessageTimeout=10
MaxArraySize=1001
FirstJobId=${FIRST_JOB_ID}
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${SLURM_CPUS} RealMemory=${SLURM_MEM_MB} State=UNKNOWN
PartitionName=${SLURM_PARTITION} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
${SLURM_EXTRA_CONF}
EOF
)

# ------------------------------------------------------------------ already up?
up=1
pid_alive /run/munge/munged.pid munged || up=0
pid_alive "$SLURM_ROOT/run/slurmctld.pid" slurmctld || up=0
pid_alive "$SLURM_ROOT/run/slurmd.pid" slurmd || up=0
if [ "$SLURM_ACCOUNTING" = 1 ]; then
  pid_alive "$SLURM_ROOT/run/slurmdbd.pid" slurmdbd || up=0
  pid_alive /run/mysqld/mysqld.pid mariadbd || up=0
fi
# comments do not change a running cluster: a config that differs only in them is the same config
conf_body() { grep -v '^#'; }
if [ $up = 1 ] && [ "$(conf_body 2>/dev/null <"$CONF")" = "$(conf_body <<<"$NEWCONF")" ] && node_ok; then
  log "cluster already running"; sinfo; exit 0
fi

# a controller started from another SLURM_ROOT: stop.sh below would cancel its jobs and stop the munged
# and mariadbd it shares, yet leave its slurmctld holding the port. Leave it alone instead.
if ctld_ok; then
  running_state=$(scontrol show config 2>/dev/null | awk '$1=="StateSaveLocation"{print $3}')
  if [ -n "$running_state" ] && [ "$running_state" != "$SLURM_ROOT/state" ]; then
    die "a cluster started with SLURM_ROOT=${running_state%/state} is running; use it (SLURM_ROOT=${running_state%/state}) or stop it first (SLURM_ROOT=${running_state%/state} bash $HERE/stop.sh)"
  fi
fi

# half-up or different config: stop what start.sh started, then start clean
bash "$HERE/stop.sh" >/dev/null 2>&1 || true
for p in "$SLURMCTLD_PORT" "$SLURMD_PORT" $( [ "$SLURM_ACCOUNTING" = 1 ] && echo "$SLURMDBD_PORT" ); do
  port_busy "$p" && die "port $p on 127.0.0.1 is already in use (another slurm? set SLURM*_PORT)"
done
printf '%s\n' "$NEWCONF" > "$CONF"
rm -f /etc/slurm/cgroup.conf   # no cgroup plugins are used; a stale one cannot hurt then
if [ "$SLURM_KEEP_STATE" != 1 ]; then
  rm -rf "$SLURM_ROOT/state" "$SLURM_ROOT/spool"; mkdir -p "$SLURM_ROOT"/{state,spool/slurmd}
  : > "$SLURM_ROOT/log/jobcomp.txt"
fi

# ------------------------------------------------------------------ munge
mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
chmod 0755 /run/munge; chmod 0700 /var/log/munge /var/lib/munge /etc/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
# a munged (or mariadbd below) of an earlier start that lost its PID file is invisible to stop.sh: stop it here
reap_orphans munge munged
rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
runuser -u munge -- /usr/sbin/munged --num-threads 2
wait_for 50 0.1 bash -c 'munge -n </dev/null | unmunge' || die "munged not working"

# ------------------------------------------------------------------ accounting: mariadb + slurmdbd
if [ "$SLURM_ACCOUNTING" = 1 ]; then
  mkdir -p /run/mysqld "$SLURM_ROOT/log/mariadb"; chown mysql:mysql /run/mysqld "$SLURM_ROOT/log/mariadb"
  if [ ! -d /var/lib/mysql/mysql ]; then
    log "initialising MariaDB datadir"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  fi
  reap_orphans mysql mariadbd  # it would hold the datadir's locks: a new one could never start
  rm -f /run/mysqld/mysqld.pid "$MYSOCK"
  setsid /usr/sbin/mariadbd --user=mysql --skip-networking --socket="$MYSOCK" \
      --pid-file=/run/mysqld/mysqld.pid --log-error="$SLURM_ROOT/log/mariadb/mariadb.log" \
      --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
      </dev/null >/dev/null 2>&1 &
  wait_for 600 0.1 mariadb-admin --socket="$MYSOCK" ping || die "mariadbd did not start (see $SLURM_ROOT/log/mariadb/mariadb.log)"
  wait_for 50 0.1 test -s /run/mysqld/mysqld.pid
  mariadb --socket="$MYSOCK" <<SQL
$( [ "$SLURM_KEEP_STATE" != 1 ] && echo "DROP DATABASE IF EXISTS slurm_acct_db;" )
CREATE OR REPLACE USER 'slurm'@'localhost' IDENTIFIED BY 'slurm-ci';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
  cat > "$DBDCONF" <<EOF
# generated by scripts/slurm/start.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=${SLURMDBD_PORT}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm-ci
StorageLoc=slurm_acct_db
PidFile=${SLURM_ROOT}/run/slurmdbd.pid
LogFile=${SLURM_ROOT}/log/slurmdbd.log
DebugLevel=info
EOF
  chmod 600 "$DBDCONF"
  /usr/sbin/slurmdbd          # daemonizes itself
  wait_for 150 0.1 port_busy "$SLURMDBD_PORT" || die "slurmdbd did not come up (see $SLURM_ROOT/log/slurmdbd.log)"
fi

# ------------------------------------------------------------------ slurmctld + slurmd
if [ "$SLURM_KEEP_STATE" = 1 ]; then /usr/sbin/slurmctld -i; else /usr/sbin/slurmctld -c -i; fi
wait_for 100 0.1 ctld_ok || { tail -30 "$SLURM_ROOT/log/slurmctld.log" >&2; die "slurmctld did not come up"; }
/usr/sbin/slurmd -N "$NODE"
if ! wait_for 100 0.1 node_ok; then
  log "node state '$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null)', trying to resume"
  scontrol update nodename="$NODE" state=resume 2>/dev/null || true
  wait_for 30 0.1 node_ok || { tail -30 "$SLURM_ROOT/log/slurmd.log" >&2; die "node not usable"; }
fi
if [ "$SLURM_ACCOUNTING" = 1 ]; then  # cluster auto-registers with slurmdbd; wait until sacct answers
  wait_for 100 0.1 bash -c 'sacctmgr -n -P show cluster format=cluster | grep -qx ci' || log "WARNING: cluster not yet registered in slurmdbd"
fi
# end-to-end smoke tests: munge creds + slurmstepd (srun), and the first pass of the
# main scheduler (batch jobs are only scheduled from ~3 s after slurmctld starts)
timeout 60 srun -J smoke -n 1 -t 1 true || die "smoke test 'srun -n 1 true' failed"
sj=$(sbatch --parsable -J smoke -t 1 -o /dev/null --wrap true) || die "smoke sbatch failed"
wait_for 600 0.1 bash -c "scontrol show job $sj | grep -q JobState=COMPLETED" || die "smoke batch job $sj did not complete"
log "cluster up (accounting=$SLURM_ACCOUNTING, root=$SLURM_ROOT)"
sinfo
