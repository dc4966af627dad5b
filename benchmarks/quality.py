"""Same token budget, K replicas in one process on the embedded corpus: AdamW DDP (gradients averaged
every step), DiLoCo and SparseLoCo (every H steps). Prints the eval loss along the way, the final
eval loss and the bytes each replica sent + received in total.

The outer algorithms run the same code as real nodes (inner trainer, outer algorithm, exchange),
with the in-process communicator instead of hivemind.

    python benchmarks/quality.py                          # tiny model, K=4, 40 rounds of H=10
    python benchmarks/quality.py --rounds 5 --replicas 2  # a quick look
    python benchmarks/quality.py --methods diloco "sparseloco:topk=128,error_decay=0.9"   # variants
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from p2ploco.collective.dense import DenseMean
from p2ploco.collective.inprocess import InProcessGroup
from p2ploco.config import Config, load_config
from p2ploco.data import ShardSampler, eval_batches, load_training_data
from p2ploco.inner import InnerTrainer, autocast_for, evaluate
from p2ploco.metrics import format_table, human_bytes
from p2ploco.model import Transformer
from p2ploco.outer import build_outer

CPU = torch.device("cpu")
# Besides each method's reference settings, one variant each found by a small sweep on this benchmark:
# DiLoCo's momentum 0.9 is too much for 40 rounds; SparseLoCo gains from ~3% density, a shorter error
# memory and a slightly larger outer step.
DEFAULT_METHODS = ["ddp", "diloco", "diloco:momentum=0.5", "sparseloco", "sparseloco:topk=128,error_decay=0.9,lr=1.2"]


def run_in_threads(replicas: int, work) -> None:
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            work(rank)
        except BaseException as e:  # surfaced after the join
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class Setup:
    def __init__(self, config: Config, replicas: int, rounds: int):
        self.config, self.replicas, self.rounds = config, replicas, rounds
        self.data = load_training_data(config)
        self.eval = eval_batches(self.data.eval, config.data.seq_len, config.data.eval_sequences)
        self.horizon = rounds * config.inner.steps
        self.eval_every = max(1, rounds // 8)

    def replica(self, rank: int) -> tuple[torch.nn.Module, InnerTrainer]:
        c = self.config
        model = Transformer(c.model, c.training.seed)
        sampler = ShardSampler(self.data.train, c.data.seq_len, c.inner.batch_size, c.run_id, f"replica-{rank}")
        return model, InnerTrainer(model, c.inner, sampler, CPU, self.horizon)


def run_outer(setup: Setup, config: Config) -> tuple[list[tuple[int, float]], int]:
    """DiLoCo or SparseLoCo: the eval-loss curve (at outer rounds) and bytes per replica."""
    group = InProcessGroup(setup.replicas)
    curve: list[tuple[int, float]] = []
    traffic = [0] * setup.replicas

    def replica(rank: int) -> None:
        model, inner = setup.replica(rank)
        outer = build_outer(config.outer, list(model.parameters()))
        for r in range(setup.rounds):
            inner.run_round(r)
            stats = outer.sync(list(model.parameters()), group.communicator(rank), r)
            traffic[rank] += stats.bytes_sent + stats.bytes_received
            with torch.no_grad():
                for param, value in zip(model.parameters(), outer.params):
                    param.copy_(value)
            if rank == 0 and ((r + 1) % setup.eval_every == 0 or r + 1 == setup.rounds):
                curve.append(((r + 1) * config.inner.steps, evaluate(model, setup.eval, CPU)))

    run_in_threads(setup.replicas, replica)
    return curve, sum(traffic) // setup.replicas


def run_ddp(setup: Setup) -> tuple[list[tuple[int, float]], int]:
    """AdamW with gradients averaged over the replicas at every step (replicas stay identical)."""
    c = setup.config
    group = InProcessGroup(setup.replicas)
    steps = setup.rounds * c.inner.steps
    curve: list[tuple[int, float]] = []
    traffic = [0] * setup.replicas
    eval_every = setup.eval_every * c.inner.steps

    def replica(rank: int) -> None:
        model, inner = setup.replica(rank)
        for step in range(steps):
            for group_ in inner.optimizer.param_groups:
                group_["lr"] = inner.lr_at(step)
            inner.optimizer.zero_grad(set_to_none=True)
            for micro in range(c.inner.grad_accum):
                inputs, targets = inner.sampler.batch(step * c.inner.grad_accum + micro)
                with autocast_for(CPU):
                    (model(inputs, targets) / c.inner.grad_accum).backward()
            exchange = DenseMean([p.grad for p in model.parameters()])
            stats = group.communicator(rank).all_reduce(exchange, step, "grads")
            traffic[rank] += stats.bytes_sent + stats.bytes_received
            for p, g in zip(model.parameters(), exchange.mean()):
                p.grad.copy_(g)
            if c.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), c.inner.grad_clip)
            inner.optimizer.step()
            if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
                curve.append((step + 1, evaluate(model, setup.eval, CPU)))

    run_in_threads(setup.replicas, replica)
    return curve, sum(traffic) // setup.replicas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40, help="outer rounds; DDP runs rounds * H steps")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                        help='ddp, diloco, sparseloco, or a variant such as "sparseloco:topk=128,lr=1.2"')
    args = parser.parse_args()
    torch.set_num_threads(1)  # the replicas' threads share the cores

    config = load_config(args.config, args.overrides)
    setup = Setup(config, args.replicas, args.rounds)
    tokens = args.replicas * args.rounds * config.inner.steps * config.inner.grad_accum * config.inner.batch_size \
        * config.data.seq_len
    print(f"{args.replicas} replicas, {args.rounds} rounds x H={config.inner.steps} inner steps, "
          f"{tokens / 1e6:.2f}M tokens per method, model {args.config}")
    results = {}
    for method in args.methods:
        started = time.perf_counter()
        if method == "ddp":
            results[method] = run_ddp(setup)
        else:
            algorithm, _, settings = method.partition(":")
            overrides = [f"outer.algorithm={algorithm}"]
            overrides += [f"outer.{algorithm}.{setting}" for setting in settings.split(",") if setting]
            results[method] = run_outer(setup, load_config(args.config, args.overrides + overrides))
        print(f"  {method}: {time.perf_counter() - started:.0f} s")

    steps = [s for s, _ in next(iter(results.values()))[0]]
    print()
    print("Eval loss by inner step")
    print(format_table(["step", *results], [
        [step, *(f"{dict(curve)[step]:.3f}" for curve, _ in results.values())] for step in steps]))
    print()
    final = {m: curve[-1][1] for m, (curve, _) in results.items()}
    reference = final.get("ddp")
    rows = [(m, f"{final[m]:.3f}", f"{100 * (final[m] / reference - 1):+.1f}%" if reference else "-",
             human_bytes(traffic)) for m, (_, traffic) in results.items()]
    print(format_table(("method", "final eval loss", "vs DDP", "bytes per replica (sent + received)"), rows))


if __name__ == "__main__":
    main()
