"""A node's local ranks as a torch.distributed group: rank 0 (the node) starts the others as processes, on loopback.

Nothing of it listens beyond this machine's loopback. The ranks meet through a ``FileStore`` in a directory only this
user can enter (a ``TCPStore`` listens on every interface whatever host it is given, and takes writes from anyone who
reaches it: rendezvous keys written there could point a rank at another process, whose bytes it unpickles), and the
collectives' own sockets are bound to the loopback interface (gloo's by ``GLOO_SOCKET_IFNAME``, NCCL's bootstrap by
``NCCL_SOCKET_IFNAME``; both default to the address the host name resolves to, a LAN address on a typical machine).

Two process groups. ``control`` carries rank 0's commands and what it sends with them (``Command``); the other ranks
wait on it between rounds as long as the node takes (a catch-up, a round that waits for peers), so its timeout is
long. ``train`` carries each step's collectives (DDP's gradients, the step's sums) and times out in minutes: a rank
that hangs mid-step stops its node, not for good. A rank that exits closes its sockets, so the next collective fails
at once; rank 0 then names the rank (``RankError``) where a catch-all would say nothing.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from p2ploco.errors import TrainingError

START_TIMEOUT = timedelta(seconds=120)  # for every rank to start and join the group
CONTROL_TIMEOUT = timedelta(days=7)  # the longest a rank waits for rank 0's next command
STEP_TIMEOUT = timedelta(minutes=10)  # the longest one collective of an inner step may wait
EXIT_SECONDS = 30  # for the other ranks to exit once told to, before they are killed
STORE_FILE = "store"  # the ranks' rendezvous, in a directory of rank 0's that only this user can enter


class RankError(TrainingError):
    """A local rank of this node died or broke off: the node cannot train on and leaves the swarm."""


class Command(enum.IntEnum):
    """What rank 0 tells the other ranks, with a value."""

    STEP = 1  # take inner step ``value``
    PARAMS = 2  # take rank 0's local params (broadcast, or scattered to the shards, next)
    OPTIMIZER = 3  # take rank 0's inner optimizer state (broadcast, or scattered to the shards, next)
    EXIT = 4
    GATHER_PARAMS = 5  # send the local params' shards to rank 0 (``training.shard``)
    GATHER_OPTIMIZER = 6  # send the inner optimizer state's shards to rank 0 (``training.shard``)
    EVALUATE = 7  # score a share of rank 0's held-out batches with the params the shards hold (``training.shard``)


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 sends each other rank at start: the run's config as the node trains it, and its peer id (whose
    shard of the data the node trains)."""

    config: dict
    peer_id: str


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the rank-th GPU."""
    return device if device.type == "cpu" else torch.device("cuda", rank)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class LocalRanks:
    def __init__(self, rank: int, world: int, device: torch.device, processes: Sequence[subprocess.Popen],
                 rendezvous: str = ""):
        """``processes``: the other ranks' (rank 0 only), ``rendezvous``: the directory of their store (rank 0 only,
        removed on ``close``). The default process group is this node's."""
        self.rank, self.world, self.device, self.processes = rank, world, device, list(processes)
        self.rendezvous = rendezvous
        self.control = dist.group.WORLD
        self.train = dist.new_group(backend=_backend(device), timeout=STEP_TIMEOUT)

    @classmethod
    def start(cls, world: int, device: torch.device, setup: RankSetup) -> LocalRanks:
        """Rank 0: start ranks 1..world-1 (``python -m p2ploco.rank_process``) on the loopback and send them
        ``setup``. A rank that exits before it joins ends the start with RankError."""
        rendezvous = tempfile.mkdtemp(prefix="p2ploco-ranks-")  # mode 0700: this user's processes alone
        store = dist.FileStore(os.path.join(rendezvous, STORE_FILE), world)
        store.set_timeout(START_TIMEOUT)
        processes = [subprocess.Popen([sys.executable, "-m", "p2ploco.rank_process", rendezvous, str(rank),
                                       str(world), device.type], stdin=subprocess.DEVNULL) for rank in range(1, world)]
        try:
            for rank, process in enumerate(processes, start=1):
                while not store.check([f"up/{rank}"]):  # its interpreter and torch load: seconds
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=0.25)
                        raise RankError(f"local rank {rank} exited with code {process.returncode} as it started "
                                        f"(its error is in this node's log, above)")
            _init(device, store, 0, world)
            ranks = cls(0, world, device, processes, rendezvous)
            dist.broadcast_object_list([setup], src=0, device=ranks.device)
            return ranks
        except BaseException:
            for process in processes:
                process.kill()
                process.wait()
            if dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(rendezvous, ignore_errors=True)
            raise

    @classmethod
    def join(cls, rendezvous: str, rank: int, world: int, kind: str) -> tuple[LocalRanks, RankSetup]:
        """Rank ``rank`` > 0 on a device of ``kind`` (rank 0's: cpu or cuda): join rank 0's group through its store
        in ``rendezvous``; the setup it sends."""
        store = dist.FileStore(os.path.join(rendezvous, STORE_FILE), world)
        store.set_timeout(START_TIMEOUT)
        store.set(f"up/{rank}", "1")
        received: list = [None]
        device = rank_device(torch.device(kind), rank)
        _init(device, store, rank, world)
        ranks = cls(rank, world, device, ())
        dist.broadcast_object_list(received, src=0, device=ranks.device)
        return ranks, received[0]

    # -- rank 0's commands, and what goes with them (every rank calls these in the same order) --

    def command(self, kind: Command = Command.STEP, value: int = 0) -> tuple[Command, int]:
        """Rank 0 sends (``kind``, ``value``); every other rank receives and returns it."""
        message = torch.tensor([int(kind), value], dtype=torch.int64, device=self.device)
        with self.failures():
            dist.broadcast(message, src=0, group=self.control)
        return Command(int(message[0])), int(message[1])

    def share_params(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank's ``params`` <- rank 0's."""
        with self.failures(), torch.no_grad():
            for param in params:
                dist.broadcast(param.data, src=0, group=self.control)

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank's ``optimizer`` state <- rank 0's (on a checkpoint's load: rare, so sent whole)."""
        state: list = [None]
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(_on_cpu(optimizer.state_dict()), buffer)
            state[0] = buffer.getvalue()
        with self.failures():
            dist.broadcast_object_list(state, src=0, group=self.control, device=self.device)
        if self.rank != 0:
            optimizer.load_state_dict(torch.load(io.BytesIO(state[0]), weights_only=True))

    def sum_(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks, in place (a step's loss and stop votes)."""
        with self.failures():
            dist.all_reduce(values, group=self.train)
        return values

    # -- failures and the end --

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the other ranks that have exited (rank 0 only)."""
        return [(rank, process.returncode) for rank, process in enumerate(self.processes, start=1)
                if process.poll() is not None]

    def check(self) -> None:
        """RankError if another rank has exited (rank 0)."""
        exited = self.exited()
        if exited:
            rank, code = exited[0]
            raise RankError(f"local rank {rank} exited (code {code}); the node cannot train without it and leaves the "
                            f"swarm: start it again (with --resume to go on from its checkpoint)")

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """A collective that fails because another rank exited raises RankError naming it (rank 0); any other
        failure is raised as it is."""
        try:
            yield
        except RuntimeError:  # torch.distributed's errors (DistError and the backends') are RuntimeErrors
            for process in self.processes:  # it exited a moment ago: its sockets closed first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=1)
            self.check()
            raise

    def close(self) -> None:
        """Rank 0: tell the other ranks to exit and reap them (killed after EXIT_SECONDS), and leave the group. Once
        one has exited the others cannot be told (a command goes to all): they are killed at once."""
        told = False
        try:
            if not self.exited():
                with contextlib.suppress(RankError, RuntimeError):
                    self.command(Command.EXIT)
                    told = True
        finally:
            for process in self.processes:
                try:
                    process.wait(timeout=EXIT_SECONDS if told else 0)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            dist.destroy_process_group()
            shutil.rmtree(self.rendezvous, ignore_errors=True)


def loopback_interface() -> str:
    """The name of this machine's loopback interface: ``lo`` on Linux, ``lo0`` on BSD and macOS."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), "lo")


def _init(device: torch.device, store: dist.Store, rank: int, world: int) -> None:
    # The collectives' sockets on the loopback, never where the host name resolves (module docstring)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback_interface()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world, timeout=CONTROL_TIMEOUT)


def _on_cpu(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: _on_cpu(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_on_cpu(value) for value in state]
    return state
