#!/usr/bin/env bash
# scripts/system-packages.sh - install, once and one apt at a time, the Debian (bookworm) packages the tests need:
# FUSE 3 (tests/test_sharedfs.py, tests/test_two_committers.py), SLURM with munge and slurmdbd + MariaDB
# (tests/slurm/, tests/multinode/), and the tools scripts/cluster/ runs (ip, nsenter, pgrep, bc, curl).
#
#   bash scripts/system-packages.sh                 # every package the tests need (scripts/test.sh runs this first)
#   bash scripts/system-packages.sh fuse3 ...       # only these (scripts/fuse/install.sh, scripts/slurm/start.sh and
#                                                   # scripts/cluster/start.sh call it with theirs)
#   bash scripts/system-packages.sh --can-install   # install nothing: could this machine install packages?
#
# Quick and quiet when everything is there: dpkg-query (or the package's commands on PATH, for a machine whose
# SLURM or FUSE does not come from Debian) says so, and apt is never called. Otherwise, as root, it takes its own
# lock (so that pytest-xdist workers starting the clusters at once install one after the other), looks again,
# runs `apt-get update` (retried: apt's lists lock does not wait) and `apt-get install --no-install-recommends`,
# which waits up to 10 min for the dpkg lock of any other apt instead of failing (DPkg::Lock::Timeout). A
# policy-rc.d that refuses every service start keeps postinst scripts from starting munge, MariaDB or slurmd
# with Debian's default config; it is removed again unless it was there before.
#
# Exit status: 0 every package installed; 3 missing, and this machine cannot install packages (not root, no
# apt-get, no apt source, or the sources cannot be reached); 1 missing, and apt failed where it should work (the
# lock held for longer than the wait, a broken dependency, ...). A failure is one line on stderr naming the
# packages and why; tests/conftest.py runs `--can-install` to tell a test skipped for a package this machine
# cannot have (allowed) from one it should have had (the test session fails).
set -uo pipefail

# Every Debian package a test needs, and the commands that show it is there without dpkg.
declare -A COMMANDS=(
  [fuse3]="fusermount3"
  [slurmctld]="slurmctld"
  [slurmd]="slurmd"
  [slurm-client]="sbatch srun sinfo squeue scontrol sacct sacctmgr scancel"
  [slurmdbd]="slurmdbd"
  [munge]="munged munge unmunge"
  [mariadb-server]="mariadbd mariadb-install-db mariadb mariadb-admin"
  [util-linux]="nsenter unshare findmnt mountpoint runuser setsid flock"
  [iproute2]="ip"
  [procps]="pgrep pkill"
  [bc]="bc"
  [curl]="curl"
)
ALL=(fuse3 slurmctld slurmd slurm-client slurmdbd munge mariadb-server util-linux iproute2 procps bc curl)
LOCK_TIMEOUT_S=${SYSTEM_PACKAGES_LOCK_TIMEOUT_S:-600}   # for dpkg's lock, and for this script's own
UPDATE_TRIES=5
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"     # a non-root PATH lacks sbin, where the daemons are

log() { echo "[system-packages] $*" >&2; }

installed() {  # installed PKG: dpkg has it, or (a package this script knows) every command it is used for
  local pkg=$1 c
  if command -v dpkg-query >/dev/null 2>&1 \
     && [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null)" = "ii " ]; then
    return 0
  fi
  [ -n "${COMMANDS[$pkg]:-}" ] || return 1
  for c in ${COMMANDS[$pkg]}; do command -v "$c" >/dev/null 2>&1 || return 1; done
}

missing_of() { local p; for p in "$@"; do installed "$p" || echo "$p"; done; }

# the Release files apt would fetch first, one a line, from apt's own reading of the sources
release_uris() {
  apt-get update --print-uris -o Debug::NoLocking=1 2>/dev/null | sed -nE "s#^'([^']*/(In)?Release)'.*#\1#p"
}

answers() {  # answers URI: apt's own download of it works (its proxy settings, https), within ~20 s
  local uri=$1 dir rc
  case "$uri" in http://*|https://*) ;; *) return 0;; esac   # file:, cdrom:: local
  [ -x /usr/lib/apt/apt-helper ] || return 0
  dir=$(mktemp -d) || return 1
  chmod 755 "$dir"   # apt downloads as user _apt
  timeout 30 /usr/lib/apt/apt-helper -o Acquire::Retries=0 -o Acquire::http::Timeout=10 \
    -o Acquire::https::Timeout=10 download-file "$uri" "$dir/probe" >/dev/null 2>&1
  rc=$?; rm -rf "$dir"; return $rc
}

# why this machine cannot install Debian packages (one phrase), or nothing when it can
why_cannot() {
  local uris u hosts
  [ "$(id -u)" = 0 ] || { echo "not root"; return; }
  command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 \
    || { echo "no apt-get here (not a Debian system)"; return; }
  uris=$(release_uris)
  [ -n "$uris" ] || { echo "no apt source (nothing in /etc/apt/sources.list or /etc/apt/sources.list.d)"; return; }
  for u in $(echo "$uris" | head -3); do answers "$u" && return; done
  hosts=$(echo "$uris" | sed -E 's#^([a-z]+://[^/]*).*#\1#' | sort -u | tr '\n' ' ')
  echo "the apt sources do not answer (${hosts% }): no network?"
}

if [ "${1:-}" = --can-install ]; then
  why=$(why_cannot)
  [ -z "$why" ] && exit 0
  log "this machine cannot install Debian packages: $why"; exit 3
fi
case "${1:-}" in -*) echo "usage: $0 [--can-install | PACKAGE...]" >&2; exit 2;; esac
[ $# -gt 0 ] && wanted=("$@") || wanted=("${ALL[@]}")

mapfile -t missing < <(missing_of "${wanted[@]}")
if [ ${#missing[@]} = 0 ]; then
  [ $# = 0 ] && log "all ${#wanted[@]} Debian packages the tests need are installed"
  exit 0
fi
why=$(why_cannot)
[ -z "$why" ] || { log "cannot install ${missing[*]}: $why"; exit 3; }

# one install at a time from this script (xdist workers start the clusters at once); then look again
mkdir -p /run/lock 2>/dev/null
exec 9>>/run/lock/pipeline-system-packages.lock
if ! flock -w "$LOCK_TIMEOUT_S" 9; then
  log "cannot install ${missing[*]}: another scripts/system-packages.sh held its lock for ${LOCK_TIMEOUT_S} s"; exit 1
fi
mapfile -t missing < <(missing_of "${missing[@]}")
[ ${#missing[@]} = 0 ] && exit 0

t0=$SECONDS
log "apt-get install ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
made_policy=0   # keep postinst scripts from starting services
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
fi
out=$(mktemp)
cleanup() { [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d; rm -f "$out"; }
trap cleanup EXIT
APT=(apt-get -o "DPkg::Lock::Timeout=$LOCK_TIMEOUT_S" -o Acquire::Retries=3)

# stale lists would 404 on superseded security updates. update waits for no lock: retried, a bounded number of times
for try in $(seq "$UPDATE_TRIES"); do
  timeout 900 "${APT[@]}" update -qq >"$out" 2>&1 && break
  [ "$try" = "$UPDATE_TRIES" ] && break
  sleep $((try * 5))
done
ok=0
for try in 1 2; do   # a second try for a lock that another apt took between our update and install
  if timeout 1800 "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}" >"$out" 2>&1; then ok=1; break; fi
  grep -qi 'lock' "$out" || break
  sleep 10
done
mapfile -t still < <(missing_of "${missing[@]}")
if [ $ok = 1 ] && [ ${#still[@]} = 0 ]; then
  log "installed ${missing[*]} in $((SECONDS - t0)) s"; exit 0
fi
why=$(why_cannot)   # the network may have gone meanwhile
last=$(grep -E '^(E|W): ' "$out" | tail -1); [ -n "$last" ] || last=$(tail -1 "$out")
if [ -n "$why" ]; then log "cannot install ${still[*]:-${missing[*]}}: $why (apt: ${last:-no output})"; exit 3; fi
log "cannot install ${still[*]:-${missing[*]}}: apt-get failed: ${last:-no output}"; exit 1
