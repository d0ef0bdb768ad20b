#!/usr/bin/env bash
# scripts/fuse/install.sh - make FUSE 3 usable on this machine (Debian bookworm, root): installs the
# `fuse3` package (fusermount3) when it is missing. Idempotent: does nothing when fusermount3 is there.
#
# tests/sharedfs.py runs it before mounting one SeaweedFS filer twice through `weed mount`; its
# skip_reason() turns a failure here into a skipped test.
#
# Env knobs:  FUSE_SKIP_INSTALL=1  never call apt-get
# Exit status: 0 fusermount3 present (and /dev/fuse exists), 3 fuse3 missing and not installable
# (or no /dev/fuse, or not root), 1 other errors.
set -euo pipefail

log() { echo "[fuse/install.sh] $(date +%T) $*" >&2; }

if ! command -v fusermount3 >/dev/null 2>&1; then
  [ "${FUSE_SKIP_INSTALL:-0}" = 1 ] && { log "ERROR: fusermount3 missing and FUSE_SKIP_INSTALL=1"; exit 3; }
  [ "$(id -u)" = 0 ] || { log "ERROR: fusermount3 missing and not root: cannot apt-get install fuse3"; exit 3; }
  log "apt-get install fuse3"
  export DEBIAN_FRONTEND=noninteractive
  made_policy=0   # keep postinst scripts from trying to start services
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
  fi
  install_failed() {
    [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    log "ERROR: cannot install fuse3 (no network or no Debian bookworm apt sources?)"; exit 3
  }
  apt-get update -qq || install_failed   # stale lists would 404 on superseded security updates
  apt-get install -y -qq --no-install-recommends fuse3 >/dev/null || install_failed
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  command -v fusermount3 >/dev/null 2>&1 || { log "ERROR: fuse3 installed but no fusermount3 on PATH"; exit 3; }
  log "install done"
fi
[ -e /dev/fuse ] || { log "ERROR: no /dev/fuse (the kernel's FUSE device; containers need --device /dev/fuse)"; exit 3; }
