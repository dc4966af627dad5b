"""Reachability at start (``swarm/reachability.py``): a verdict takes two helpers that agree, and the dial-back
service dials no private host from the Internet and a bounded number of askers. The rules as pure functions, then
over real p2p daemons: honest helpers (the real ``DialBack``), and helpers that lie, or hang."""

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers import LOOPBACK
from hivemind.p2p import P2P

from p2ploco.errors import PayloadError
from p2ploco.swarm import reachability, wire
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.reachability import Admission, DialBack, detect, judge, may_dial, parse_dial_back
from p2ploco.swarm.records import Reachability

A, B, C, D, E = (f"12D3KooW{name * 44}" for name in "ABCDE")  # peer ids; logs show their last 8 characters


@pytest.mark.parametrize("reached, unreached, named, public, why", [
    ([A, B], [], [], True, None),
    ([], [A, B], [], False, None),
    ([A, B], [C], [], True, "the helpers disagree"),  # one liar among three is outvoted, either way
    ([C], [A, B], [], False, "the helpers disagree"),
    ([], [C], [], True, "no two helpers agree"),  # a lone "not reached" decides nothing
    ([C], [], [], True, "no two helpers agree"),
    ([C], [A], [], True, "no two helpers agree"),
    ([], [A], [A], False, "the bootstrap peers you named decide"),  # where no two settle it, the named ones do
    ([C], [A], [A], False, "the bootstrap peers you named decide"),
    ([A], [C], [A], True, "the bootstrap peers you named decide"),
    ([C, D], [A, B], [A], False, "the bootstrap peers you named decide"),  # a tie of two against two
    ([C, D], [A, B], [], True, "nor do the bootstrap peers you named"),
    ([A], [B], [A, B], True, "nor do the bootstrap peers you named"),  # the named ones disagree
    ([A, B, C], [D, E], [D, E], True, "the helpers disagree"),  # two voices and a majority outweigh them
    ([], [], [A], True, "no helper answered"),
])
def test_a_verdict_takes_two_helpers_that_agree_and_more_for_it_than_against(reached, unreached, named, public,
                                                                              why):
    decided, doubt = judge(reached, unreached, named)
    assert decided is public
    if why is None:
        assert doubt is None
    else:
        assert why in doubt


@pytest.mark.parametrize("host, from_the_internet, from_a_lan", [
    ("8.8.8.8", True, True),
    ("2606:4700::1111", True, True),
    ("::ffff:8.8.8.8", True, True),
    ("10.0.0.1", False, True),
    ("172.16.5.4", False, True),
    ("192.168.1.20", False, True),
    ("127.0.0.1", False, True),
    ("169.254.1.1", False, True),
    ("100.64.0.1", False, True),  # carrier-grade NAT space
    ("::1", False, True),
    ("fd12:3456::1", False, True),  # unique local
    ("fe80::1", False, True),
    ("::ffff:10.0.0.1", False, True),
    ("224.0.0.1", False, False),
    ("ff02::1", False, False),
    ("0.0.0.0", False, False),
    ("::", False, False),
    ("240.0.0.1", False, False),
])
def test_a_helper_on_the_internet_dials_back_global_addresses_only(host, from_the_internet, from_a_lan):
    assert may_dial(host, local=False) is from_the_internet
    assert may_dial(host, local=True) is from_a_lan


@pytest.mark.parametrize("addresses, local", [
    (["/ip4/127.0.0.1/tcp/4001/p2p/" + A], True),  # a local swarm on loopback (tests, the demo)
    (["/ip4/10.77.0.254/tcp/4001", "/ip4/127.0.0.1/tcp/4001"], True),  # network namespaces (benchmarks/wan.py)
    (["/ip4/127.0.0.1/tcp/4001", "/ip4/203.0.114.7/tcp/4001"], False),  # also on a public address
    (["/ip6/::1/tcp/4001", "/ip6/2a01:4f8::1/tcp/4001"], False),
    (["/dns4/bootstrap.example.org/tcp/4001"], False),  # announced by name: meant to be reached from anywhere
    (["/ip4/10.0.0.2/tcp/4001", f"/ip4/8.8.8.8/tcp/4001/p2p/{B}/p2p-circuit/p2p/{A}"], True),  # a relay's address
])
def test_a_helper_is_local_where_none_of_its_own_addresses_is_on_the_internet(addresses, local):
    assert Admission(addresses).local is local


def test_dial_backs_are_limited_per_asker_and_for_all_askers_together():
    admission = Admission(["/ip4/203.0.114.7/tcp/4001"], limit=3)
    assert [admission.refusal(peer, "8.8.8.8", 0.0) for peer in (A, B, C)] == [None] * 3
    assert admission.refusal(D, "8.8.8.8", 1.0) == "3 peers were dialled back in the last 10 s"  # fresh keys too
    assert admission.refusal(A, "8.8.8.8", 5.0) == "it asked less than 10 s ago"
    assert admission.refusal(D, "8.8.8.8", 10.0) is None  # A, B and C's dial-backs are 10 s old
    assert admission.refusal(A, "8.8.8.8", 10.0) is None
    assert admission.refusal(E, "192.168.1.20", 10.0).startswith("it came from 192.168.1.20, which this peer does")
    assert admission.refusal(E, None, 10.0) == "its request came through a relay"
    assert admission.refusal(E, "8.8.8.8", 10.0) is None  # refusals count against no limit


@pytest.mark.parametrize("header, error", [
    ({"dialled": True, "reached": [4001, 4002], "seen_at": "1.2.3.4"}, None),
    ({"dialled": True, "reached": [22], "seen_at": "1.2.3.4"}, "names a port that was not asked"),
    ({"dialled": True, "reached": [4001] * 5, "seen_at": "1.2.3.4"}, "reached: List should have at most 4 items"),
    ({"dialled": "yes", "reached": [], "seen_at": ""}, "dialled: Input should be a valid boolean"),
    ({"dialled": True, "reached": [], "seen_at": "x" * 65}, "seen_at: String should have at most 64 characters"),
])
def test_a_dial_back_answer_names_only_ports_that_were_asked(header, error):
    if error is None:
        assert parse_dial_back(header, [4001, 4002]).reached == [4001, 4002]
    else:
        with pytest.raises(PayloadError, match=error):
            parse_dial_back(header, [4001, 4002])


# ---- over real p2p daemons ----------------------------------------------------------------------------------

def lying_helper(reached: str) -> Callable[..., Awaitable[None]]:
    """A helper that dials nothing and answers every request as if it had: ``reached`` "none" or "all" the ports."""
    async def serve(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await wire.read_message(reader, max_payload=0)
            await wire.write_message(writer, {"dialled": True, "reached": header["ports"] if reached == "all" else [],
                                              "seen_at": "203.0.113.9"})
        finally:
            await wire.hang_up(reader, writer, reachability.ASK_TIMEOUT)

    return serve


async def hang(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A helper that reads the request and never answers (until the asker gives up and closes the stream)."""
    await wire.hang_up(reader, writer, reachability.ASK_TIMEOUT)


@pytest.fixture(scope="module")
def helpers():
    """Real p2p daemons on loopback, each serving the dial-back probe its own way, by name."""
    loop = EventLoopThread()
    created: dict[str, P2P] = {}
    try:
        for name in ("h1", "h2", "denier", "claimer", "hanger", "remote", "limited"):
            created[name] = loop.run(P2P.create(host_maddrs=LOOPBACK), 60)
        for name, p2p in created.items():
            addresses = [str(a) for a in loop.run(p2p.get_visible_maddrs(), 30)]
            if name in ("h1", "h2"):
                loop.run(DialBack(p2p, addresses).start(), 30)
            elif name == "remote":  # as if on a public address: it dials back no loopback asker
                loop.run(DialBack(p2p, ["/ip4/203.0.114.7/tcp/4001"]).start(), 30)
            elif name == "limited":
                loop.run(DialBack(p2p, addresses, limit=1).start(), 30)
            else:
                handler = hang if name == "hanger" else lying_helper("none" if name == "denier" else "all")
                loop.run(p2p.add_binary_stream_handler(reachability.HANDLER, handler), 30)
        yield loop, {name: p2p.peer_id.to_base58() for name, p2p in created.items()}, created
    finally:
        for p2p in created.values():
            loop.run(p2p.shutdown(), 30)
        loop.stop()


@pytest.fixture
def askers(helpers):
    """Makes fresh peers connected to every helper (a helper dials one asker back once per 10 s): each call, one
    peer and its addresses."""
    loop, _, created = helpers
    initial = [a for p2p in created.values() for a in loop.run(p2p.get_visible_maddrs(), 30)]
    made: list[P2P] = []

    def new_asker() -> tuple[P2P, list[str]]:
        made.append(loop.run(P2P.create(host_maddrs=LOOPBACK, initial_peers=initial), 60))
        return made[-1], [str(a) for a in loop.run(made[-1].get_visible_maddrs(), 30)]

    try:
        yield new_asker
    finally:
        for p2p in made:
            loop.run(p2p.shutdown(), 30)


def closed_port() -> list[str]:
    """A listening address whose port nothing listens on: a dial-back finds it closed, as a NAT would drop it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return [f"/ip4/127.0.0.1/tcp/{probe.getsockname()[1]}"]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == reachability.__name__ and r.levelno == logging.WARNING]


@pytest.mark.timeout(120)
def test_a_helper_that_says_nobody_was_reached_is_outvoted_by_two_honest_ones(helpers, askers, caplog):
    loop, ids, _ = helpers
    p2p, addresses = askers()
    with caplog.at_level(logging.WARNING, logger=reachability.__name__):
        verdict = loop.run(detect(p2p, [], [ids["denier"], ids["h1"], ids["h2"]], addresses), 60)
    assert verdict is Reachability.PUBLIC
    [warning] = warnings(caplog)
    honest = ", ".join(sorted(ids[h][-8:] for h in ("h1", "h2")))
    assert f"reachability: the helpers disagree ({honest} reached a port; {ids['denier'][-8:]} reached none): the " \
           f"majority decides; taking this peer for public" in warning


@pytest.mark.timeout(120)
def test_a_lone_helper_that_says_nobody_was_reached_decides_nothing(helpers, askers, caplog):
    loop, ids, _ = helpers
    p2p, addresses = askers()
    with caplog.at_level(logging.WARNING, logger=reachability.__name__):
        assert loop.run(detect(p2p, [], [ids["denier"]], addresses), 60) is Reachability.PUBLIC
    [warning] = warnings(caplog)
    assert warning == f"reachability: no two helpers agree ({ids['denier'][-8:]} reached none), nor do the " \
                      f"bootstrap peers you named; taking this peer for public (pass --reachability client if it is " \
                      f"behind a NAT)"


@pytest.mark.timeout(120)
def test_a_peer_behind_a_nat_stays_a_client_whatever_one_liar_and_a_hanging_helper_say(helpers, askers, monkeypatch,
                                                                                     caplog):
    """The bootstrap peer and one other find the port closed; a liar claims it reached it, another helper never
    answers. Four hanging helpers used to make such a peer public: now a hang is no voice, and two honest ones
    outvote the liar."""
    monkeypatch.setattr(reachability, "ASK_TIMEOUT", 2.0)  # how long the hanging helper holds the probe up
    loop, ids, _ = helpers
    p2p, _ = askers()
    closed = closed_port()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=reachability.__name__):
        verdict = loop.run(detect(p2p, [ids["h1"]], [ids["hanger"], ids["claimer"], ids["h2"]], closed), 60)
    assert verdict is Reachability.CLIENT
    assert time.monotonic() - started < 2.0 + 2  # the hang held it up for ASK_TIMEOUT, no longer
    [warning] = warnings(caplog)
    honest = ", ".join(sorted(ids[h][-8:] for h in ("h1", "h2")))
    assert f"({ids['claimer'][-8:]} reached a port; {honest} reached none): the majority decides; this peer could " \
           f"not be dialled back at 127.0.0.1 (ports {closed[0].rpartition('/')[2]}): it is behind a NAT" in warning


@pytest.mark.timeout(120)
def test_the_bootstrap_peer_settles_a_tie_between_itself_and_a_liar(helpers, askers):
    loop, ids, _ = helpers
    p2p, _ = askers()
    assert loop.run(detect(p2p, [ids["h1"]], [ids["claimer"]], closed_port()), 60) is Reachability.CLIENT


@pytest.mark.timeout(120)
def test_a_helper_on_a_public_address_does_not_dial_a_loopback_asker_back(helpers, askers):
    loop, ids, _ = helpers
    p2p, addresses = askers()
    ports = reachability.listening_ports(addresses)
    header, _ = loop.run(wire.call(p2p, ids["remote"], reachability.HANDLER, {"ports": ports}), 30)
    assert header == {"v": wire.PROTOCOL_VERSION, "dialled": False, "reached": [], "seen_at": "127.0.0.1"}
    header, _ = loop.run(wire.call(p2p, ids["h1"], reachability.HANDLER, {"ports": ports}), 30)  # a local one does
    assert header["dialled"] and header["reached"] == ports


@pytest.mark.timeout(120)
def test_a_helper_dials_back_at_most_its_limit_of_askers_per_interval(helpers, askers):
    loop, ids, _ = helpers
    answers = []
    for p2p, addresses in (askers(), askers()):  # two peers within the interval: the second is refused
        ports = reachability.listening_ports(addresses)
        header, _ = loop.run(wire.call(p2p, ids["limited"], reachability.HANDLER, {"ports": ports}), 30)
        answers.append((header["dialled"], header["reached"] == ports))
    assert answers == [(True, True), (False, False)]
