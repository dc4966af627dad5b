#!/usr/bin/env bash
# Start a p2ploco node for real, configured from the environment (see node/README.md).
#   P2PLOCO_CONFIG         run config that starts a run (default: configs/150m.yaml next to this folder, unless
#                          P2PLOCO_INITIAL_PEERS is set: then the node trains the config of the run it joins)
#   P2PLOCO_RUN_ID         the run's name (default: the config's run_id; needed to join without P2PLOCO_CONFIG)
#   P2PLOCO_INITIAL_PEERS  space-separated multiaddrs of peers already in the swarm (empty: start a new swarm)
#   P2PLOCO_PORT           TCP port to listen on (default 31350: not the bootstrap's 31337 nor its hubs' 31338-31341)
#   P2PLOCO_LISTEN_IP      the interface to listen on (default 0.0.0.0: all of them)
#   P2PLOCO_PUBLIC_IP      the address other peers dial; omit on a LAN where the interface address is reachable
#   P2PLOCO_HOME           where the identity key and logs live (default ~/.p2ploco)
#   extra arguments are passed to `p2ploco node start` (e.g. --set inner.batch_size=8)
# The node continues from the checkpoint in P2PLOCO_HOME/logs if there is one (--resume auto), so that a
# supervisor's restarts rejoin the run where the node left it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
port="${P2PLOCO_PORT:-31350}"
home="${P2PLOCO_HOME:-$HOME/.p2ploco}"
mkdir -p "$home"

args=(node start --host-maddrs "/ip4/${P2PLOCO_LISTEN_IP:-0.0.0.0}/tcp/$port" --identity "$home/identity.key"
      --log-dir "$home/logs" --resume auto)
if [[ -n "${P2PLOCO_CONFIG:-}" || -z "${P2PLOCO_INITIAL_PEERS:-}" ]]; then
  args+=(--config "${P2PLOCO_CONFIG:-$here/../configs/150m.yaml}")
fi
if [[ -n "${P2PLOCO_RUN_ID:-}" ]]; then
  args+=(--run-id "$P2PLOCO_RUN_ID")
fi
if [[ -n "${P2PLOCO_PUBLIC_IP:-}" ]]; then
  args+=(--announce-maddrs "/ip4/$P2PLOCO_PUBLIC_IP/tcp/$port")
fi
for peer in ${P2PLOCO_INITIAL_PEERS:-}; do
  args+=(--initial-peers "$peer")
done
exec p2ploco "${args[@]}" "$@"
