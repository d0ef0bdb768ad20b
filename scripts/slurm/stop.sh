#!/usr/bin/env bash
# scripts/slurm/stop.sh - stop the project's single-node SLURM cluster started by scripts/slurm/start.sh
# (by users: `sudo bash scripts/slurm/stop.sh`; by tests/slurm/conftest.py at the end of a test session
# in which it started the cluster). Cancels all jobs, remembers the job-id counter, then stops
# slurmd+slurmctld, slurmdbd, mariadbd+munged by their PID files (PID-reuse safe) and reaps leftover
# slurmstepd. Idempotent. Use the SLURM_ROOT the cluster was started with: a running controller of another
# SLURM_ROOT is left alone (exit status 1). SLURM_PURGE=1 also deletes $SLURM_ROOT.
set -uo pipefail
SLURM_ROOT=${SLURM_ROOT:-/tmp/pipeline-slurm}
log() { echo "[slurm/stop.sh] $(date +%T) $*" >&2; }

pid_of() {  # pid_of PIDFILE EXE_BASENAME -> prints pid if alive and really that program
  local f=$1 exe=$2 p
  [ -s "$f" ] || return 1
  p=$(cat "$f" 2>/dev/null) || return 1
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || return 1
  case "$(readlink -f "/proc/$p/exe" 2>/dev/null)" in */"$exe"|*/"$exe"-wlm) echo "$p"; return 0;; esac  # Debian: slurmctld -> slurmctld-wlm
  return 1
}
stop_all() {  # stop_all NAME:PIDFILE:EXE ...   SIGTERM all, wait up to 30 s, then SIGKILL
  local spec name f exe p pids=() names=()
  for spec in "$@"; do
    IFS=: read -r name f exe <<<"$spec"
    if p=$(pid_of "$f" "$exe"); then kill -TERM "$p" 2>/dev/null && { pids+=("$p"); names+=("$name"); }; fi
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  for _ in $(seq 300); do
    local alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && { log "stopped ${names[*]} (${pids[*]})"; return 0; }
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && { log "pid $p did not exit, SIGKILL"; kill -KILL "$p"; }; done
  return 0
}

# a controller started from another SLURM_ROOT is not ours: cancelling its jobs and stopping the munged and
# mariadbd it shares would break it while its slurmctld kept running
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q 'is UP'; then
  running_state=$(scontrol show config 2>/dev/null | awk '$1=="StateSaveLocation"{print $3}')
  if [ -n "$running_state" ] && [ "$running_state" != "$SLURM_ROOT/state" ]; then
    log "ERROR: the running cluster was started with SLURM_ROOT=${running_state%/state}, not $SLURM_ROOT; stop it with SLURM_ROOT=${running_state%/state}"
    exit 1
  fi
fi

# cancel all jobs while the controller is still up, so no job outlives the cluster
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q 'is UP'; then
  # remember the job-id counter: the next clean start continues from it, so job ids never
  # repeat (submitit folders like logs/%j would otherwise pick up stale result pickles)
  nj=$(scontrol show config 2>/dev/null | awk '$1=="NEXT_JOB_ID"{print $3}')
  [ -n "$nj" ] && mkdir -p "$SLURM_ROOT" && echo "$nj" > "$SLURM_ROOT/next_job_id"
  ids=$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ')
  if [ -n "${ids// /}" ]; then
    log "cancelling jobs: $ids"; scancel $ids 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -t R,CG -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

stop_all "slurmd:$SLURM_ROOT/run/slurmd.pid:slurmd" "slurmctld:$SLURM_ROOT/run/slurmctld.pid:slurmctld"
stop_all "slurmdbd:$SLURM_ROOT/run/slurmdbd.pid:slurmdbd"

# leftover job-step daemons (only ever spawned by our slurmd)
for d in /proc/[0-9]*; do
  case "$(readlink -f "$d/exe" 2>/dev/null)" in
    */slurmstepd|*/slurmstepd-wlm) p=${d#/proc/}; log "killing leftover slurmstepd $p"; kill -KILL "$p" 2>/dev/null || true;;
  esac
done

stop_all "mariadbd:/run/mysqld/mysqld.pid:mariadbd" "munged:/run/munge/munged.pid:munged"

# remove only stale pid files (never one whose process is still alive)
for f in "$SLURM_ROOT"/run/*.pid; do
  [ -e "$f" ] || continue
  p=$(cat "$f" 2>/dev/null); { [ -n "$p" ] && kill -0 "$p" 2>/dev/null; } || rm -f "$f"
done
[ "${SLURM_PURGE:-0}" = 1 ] && rm -rf "$SLURM_ROOT"
log "stopped"
exit 0
