"""``p2ploco``: run a bootstrap peer, a training node, or a local demo swarm (``program.main``; each subcommand, or
group of them, is a module here).

Errors a person can fix print as one ``error: ...`` line with a non-zero exit code, never as a
traceback.
"""

import os

# hivemind reads its log level at import: keep its INFO chatter out of a node's progress output.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

from p2ploco.cli.program import main  # noqa: E402

__all__ = ["main"]
