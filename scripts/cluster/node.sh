#!/usr/bin/env bash
# scripts/cluster/node.sh - act on one node (nodeK or login) of the cluster start.sh made.
#   node.sh exec  nodeK CMD...  run CMD inside nodeK (netns + hostname + mount ns: sees /shared, /local)
#                               with SLURM_CONF set, e.g. node.sh exec node1 sbatch -N2 job.sh
#   node.sh kill  nodeK         "power off": lazily unmount its /shared, SIGTERM then (after 5 s) SIGKILL
#                               every process in its network namespace; /local (tmpfs) is lost
#   node.sh kill9 nodeK         same, SIGKILL at once (no slurmd shutdown message to slurmctld)
#   node.sh up    nodeK         bring it back (start.sh nodeK), then wait until SLURM can use it (resume)
#   node.sh cut   nodeK         network partition: host end of its veth down (processes keep running)
#   node.sh heal  nodeK         veth up again (SLURM keeps a node it set DOWN meanwhile down for ~2 min: a ghost
#                               job step there runs on, as on a real cluster)
#   node.sh resume nodeK        wait until SLURM can use it; resume it if SLURM set it DOWN (what an admin does)
#   node.sh pids  nodeK         pids in its network namespace
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/common.sh"
[ $# -ge 2 ] || { sed -n '2,15p' "$0"; exit 2; }
cmd=$1 node=$2; shift 2
k=$(node_idx "$node")
case "$cmd" in
  exec)  in_node "$k" env SLURM_CONF="$SLURM_CONF" "$@" ;;
  kill)  node_down "$k" 5 ;;
  kill9) node_down "$k" 0 ;;
  up)    "$HERE/start.sh" "$node"
         [ "$k" -eq 0 ] || exec "$0" resume "$node" ;;  # a node killed may be DOWN or not responding yet
  cut)   ip link set "$(veth_of "$k")" down ;;
  heal)  ip link set "$(veth_of "$k")" up ;;
  resume)  # until SLURM can use it again; a node it set DOWN (cut past SlurmdTimeout) is resumed, as an admin does
         for _ in $(seq 240); do
           case "$(sinfo -h -n "$node" -o %t 2>/dev/null)" in
             idle|mix|alloc) exit 0 ;;
             down*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
           esac
           sleep 0.5
         done
         die "$node not usable: $(sinfo -h -n "$node" -o '%t %E')" ;;
  pids)  for p in $(node_pids "$k"); do echo "$p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-100)"; done ;;
  *)     die "unknown command $cmd" ;;
esac
