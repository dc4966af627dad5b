"""Errors that reach a person: each carries one line that says what is wrong and how to fix it."""


class P2PLocoError(Exception):
    """Base class; the CLI prints ``error: <message>`` and exits non-zero, never a traceback."""


class ConfigError(P2PLocoError):
    """A config file, a --set override or a CLI argument is malformed or impossible."""


class SwarmError(P2PLocoError):
    """The swarm cannot be reached or joined (bad address, unreachable bootstrap, identity taken)."""


class PayloadError(P2PLocoError):
    """A message from another peer is malformed (it broke the protocol): its sender is dropped from the round,
    and may be banned for it."""


class TransportError(P2PLocoError):
    """The link to another peer failed: it could not be dialled, or a stream broke or ended mid-message. Nobody's
    content was at fault and nobody is banned for it: the peer may have crashed, or its link failed for a moment."""


class TrainingError(P2PLocoError):
    """This node's own training went wrong (e.g. a pseudo-gradient with NaN after divergence)."""


class CheckpointError(P2PLocoError):
    """A checkpoint is missing, corrupt, or belongs to another run or config; nothing is overwritten."""


class PipelineError(P2PLocoError):
    """A pipeline group could not finish a step: a stage did not answer in time or sent a malformed message."""
