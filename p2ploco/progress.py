"""What a node prints of its run: how to join it, a line per round, and a summary at the end."""

from __future__ import annotations

from collections.abc import Sequence

from p2ploco.config import Config
from p2ploco.metrics import RoundSummary, format_table, human_bytes
from p2ploco.roles import HUB


def join_command(run_id: str, addresses: Sequence[str]) -> str:
    """The command that starts a peer of run ``run_id`` from another machine, through ``addresses``."""
    return f"p2ploco node start --run-id {run_id} " + " ".join(f"--initial-peers {a}" for a in addresses)


def join_instructions(config: Config, addresses: Sequence[str]) -> list[str]:
    """How to join this node's run from another machine, through ``addresses``, and what that does not bring: files
    the run's config names, which a joiner names its own copies of."""
    lines = ["To join this swarm from another machine, run:", f"  {join_command(config.run_id, addresses)}"]
    d = config.data
    for key, path in (("data.prepared", d.prepared), ("data.tokenizer", d.tokenizer)):
        if path:
            lines.append(f"  (the run's config comes from its peers; its {key.split('.')[1]} {path} does not: add "
                         f"--set {key}=PATH, your copy of it)")
    return lines


def progress_line(peer_id: str, r: RoundSummary) -> str:
    evaluated = f"{r.eval_loss:.3f}" if r.eval_loss is not None else "-"
    rate = r.tokens / r.inner_seconds if r.inner_seconds else 0.0
    notes = (" | sat out: its step outlasts the round, its work goes into the next" if r.sat_out and r.tokens else
             " | sat out idle: a step's work would land past its last round" if r.sat_out else
             "" if r.applied else " | NOT APPLIED")
    if not r.inner_steps and r.contributed_tokens and not r.sat_out:
        notes += " | no step of its own: it contributed the work it kept from the round it sat out"
    notes += f" | dropped {len(r.dropped_peers)}" if r.dropped_peers else ""
    notes += f" | clipped {len(r.clipped_peers)}" if r.clipped_peers else ""
    notes += f" | left out {len(r.opposed_peers)} opposed" if r.opposed_peers else ""
    notes += " | redone" if r.attempts > 1 else ""
    if r.role == HUB:  # it trains nothing: what it did is the rounds it held, and the bytes it reduced and served
        return (f"[{peer_id[-8:]}] round {r.round:>4} | hub | group {r.peers} | reduced "
                f"{human_bytes(r.bytes_received)} | served {human_bytes(r.bytes_sent)} | comm {r.comm_seconds:.1f}s"
                f"{notes} | {r.params_digest[:10]}")
    traffic = r.bytes_sent + r.bytes_received
    saving = f", {r.dense_fp32_bytes / traffic:.0f}x under dense fp32" if traffic else ""
    # a round that trained no step has no loss (``InnerStats``: NaN), and says so
    loss = f"{r.loss:.3f}" if r.inner_steps else "-"
    return (f"[{peer_id[-8:]}] round {r.round:>4} | peers {r.peers} | loss {loss} | eval {evaluated} | "
            f"{rate / 1e3:.1f}k tok/s | sent {human_bytes(r.bytes_sent)} recv {human_bytes(r.bytes_received)} "
            f"({r.bits_per_param:.3f} bits/param{saving}) | inner {r.inner_seconds:.1f}s comm {r.comm_seconds:.1f}s"
            f"{notes} | {r.params_digest[:10]}")


def summary(summaries: Sequence[RoundSummary], seconds: float) -> str:
    if not summaries:
        return f"no round completed ({seconds:.1f} s)"
    evals = [r.eval_loss for r in summaries if r.eval_loss is not None]
    rounds = ("rounds", f"{len(summaries)} ({summaries[0].round} to {summaries[-1].round}, "
                        f"{sum(not r.applied for r in summaries)} not applied)")
    group = ("mean group size", f"{sum(r.peers for r in summaries) / len(summaries):.1f}")
    digest = ("final params digest", summaries[-1].params_digest[:16])
    if summaries[-1].role == HUB:
        return format_table(("summary", "value"), [
            rounds, group,
            ("bytes per round (reduced / served)",
             f"{human_bytes(sum(r.bytes_received for r in summaries) / len(summaries))} / "
             f"{human_bytes(sum(r.bytes_sent for r in summaries) / len(summaries))}"),
            ("time (comm / total)", f"{sum(r.comm_seconds for r in summaries):.1f} s / {seconds:.1f} s"), digest])
    return format_table(("summary", "value"), [
        rounds,
        ("eval loss first -> last", f"{evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "-"),
        group,
        ("bytes per round (sent + received)",
         human_bytes(sum(r.bytes_sent + r.bytes_received for r in summaries) / len(summaries))),
        ("tokens trained", f"{sum(r.tokens for r in summaries):,}"),
        ("time (inner / comm / total)", f"{sum(r.inner_seconds for r in summaries):.1f} s / "
                                        f"{sum(r.comm_seconds for r in summaries):.1f} s / {seconds:.1f} s"),
        digest])
