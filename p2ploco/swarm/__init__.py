"""A peer's membership of a run, everything hivemind: the DHT, peer records, status, reachability and state
transfer. A round's sync stands on it, in ``p2ploco/sync/``."""

# Listen on every IPv4 interface, on a port the OS picks (as hivemind-dht does).
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
