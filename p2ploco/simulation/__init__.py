"""The protocol's own code for thousands of peers in one process (``benchmarks/simulate.py``): virtual time
(``clock.py``), simulated links and NATs (``network.py``), a Kademlia model of the DHT (``dht.py``), peers running
the real directory, sync services and outer algorithm (``swarm.py``), and what a run showed (``report.py``). Used by
benchmarks and tests, never by a node."""
