"""Short human names for peers, derived from their peer ids: logs and ``p2ploco peers`` are read by people, and
``swift-otter-7Kq2`` is easier to follow than a 52-character id. The same peer keeps its name across restarts."""

from __future__ import annotations

from hivemind.dht.routing import DHTID

_ADJECTIVES = ("amber", "bold", "brisk", "calm", "clever", "cosmic", "crisp", "dapper", "eager", "fuzzy",
               "gentle", "golden", "happy", "humble", "jolly", "keen", "lively", "lucky", "mellow", "nimble",
               "noble", "plucky", "quiet", "rapid", "rustic", "silver", "sleek", "sunny", "swift", "tidy",
               "vivid", "witty")
_ANIMALS = ("badger", "beaver", "bison", "crane", "dingo", "eagle", "falcon", "ferret", "gecko", "heron",
            "ibex", "jackal", "koala", "lemur", "lynx", "marmot", "moose", "newt", "ocelot", "otter", "panda",
            "puffin", "quokka", "raven", "salmon", "stoat", "tapir", "toucan", "walrus", "wombat", "yak", "zebra")


def human_name(peer_id: str) -> str:
    """A short name derived from the peer id (the same peer keeps it across restarts), e.g. swift-otter-7Kq2."""
    digest = DHTID.generate(source=peer_id)
    return f"{_ADJECTIVES[digest % 32]}-{_ANIMALS[(digest >> 5) % 32]}-{peer_id[-4:]}"
