"""In-process stand-ins for the swarm, used by tests and benchmarks, never by a node: a group of replicas that
all-reduce through shared memory (``communicator.py``), the links of a pipeline group's stages in one process
(``transport.py``), a whole heterogeneous swarm of replicas and groups in threads (``swarm.py``), and the threads
they run in (``threads.py``). Each reduces and links exactly as the swarm code does (the same ``reduce_span``, the
same ``StageTransport`` seam), so a run here repeats a swarm's arithmetic without its network.

This package sits on top: it imports the production modules, and none of them imports it."""
