#!/usr/bin/env bash
# scripts/fuse/install.sh - make FUSE 3 usable on this machine (Debian bookworm, root): installs the
# `fuse3` package (fusermount3) when it is missing, through scripts/system-packages.sh (which waits for the dpkg
# lock of any other apt instead of failing). Idempotent: does nothing when fusermount3 is there.
#
# tests/sharedfs.py runs it before mounting one SeaweedFS filer twice through `weed mount`; its
# skip_reason() turns a failure here into a skipped test (which fails the session where this machine could have
# installed fuse3: tests/conftest.py).
#
# Env knobs:  FUSE_SKIP_INSTALL=1  never call apt-get
# Exit status: 0 fusermount3 present (and /dev/fuse exists), 3 fuse3 missing and not installed (its
# last line says why: not root, no apt source, apt failed...) or no /dev/fuse, 1 other errors.
set -euo pipefail

log() { echo "[fuse/install.sh] $(date +%T) $*" >&2; }

if ! command -v fusermount3 >/dev/null 2>&1; then
  [ "${FUSE_SKIP_INSTALL:-0}" = 1 ] && { log "ERROR: fusermount3 missing and FUSE_SKIP_INSTALL=1"; exit 3; }
  # one apt at a time, waiting for the dpkg lock of any other (scripts/system-packages.sh); its line says why not
  bash "$(dirname "${BASH_SOURCE[0]}")/../system-packages.sh" fuse3 || exit 3
  command -v fusermount3 >/dev/null 2>&1 || { log "ERROR: fuse3 installed but no fusermount3 on PATH"; exit 3; }
fi
[ -e /dev/fuse ] || { log "ERROR: no /dev/fuse (the kernel's FUSE device; containers need --device /dev/fuse)"; exit 3; }
