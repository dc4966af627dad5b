"""p2ploco: peer-to-peer low-communication LLM pre-training over a hivemind DHT."""

__version__ = "0.1.0"
# The version of the messages peers exchange (swarm/wire.py). It is part of a run's config fingerprint, so peers
# that speak different versions never meet in a round: the newcomer refuses to start, in one line.
# 2: streams closed by the side that read last; reducers answer "missed"; groups and decisions say whom they leave
# out and why; votes report only peers rejected as malformed; records carry "unsettled".
# 3: contributions are weighted by the tokens they were trained on (joins and groups carry them); peers behind a
# NAT say so (joins, groups, records) and reduce no span.
# 4: contributions pointing against the others are left out, their senders banned (collective/robust.py).
# 5: a resparsified result of n contributions keeps min(result_topk, n x topk) values per chunk.
# 6: with resparsified results, a group of n holders sends max(1, min(topk, result_topk // n)) values per chunk each.
# 7: hubs: a member may join with 0 tokens (it contributes nothing), asks reducers for results with "listen", and
# records may say role "hub"; a group is fitted to its contributors, not its holders.
# 8: a contribution is fitted to every attempt's group (a redo's, the next coordinator's after a dead group), not
# only to the first group a peer took part in; state digests hashed 16 MiB blocks of SHA-256 in parallel.
# 9: state digests are BLAKE3 (metrics.state_digest); records say params_digest, claims state_digest.
# 10: reducers sign every result and coordinators every group they hand out (swarm/evidence.py); contributions and
# votes name the group's digest; votes list each piece's digest with its reducer's signature, and the refusals both
# ways; decisions carry proofs, and a redo's passive members; a commit needs a majority of the group's holders.
# 11: peers behind NATs hold tethers to their coordinators (sync/tether.py); a group's digest covers the run's
# max_reducers; a group answered in full says what most members hold and trained once, and lists only the others.
# 12: a member answers probes with whether it takes part in the round at the group's coordinator (sync/liveness.py).
PROTOCOL_VERSION = 12
