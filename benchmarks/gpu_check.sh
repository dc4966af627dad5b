#!/usr/bin/env bash
# The checks a session runs as they are on a lent GPU machine, in under 8 minutes (from the repository root, after
# the README's test set-up command): the tests that need CUDA, benchmarks/throughput.py at 150m.yaml (the node's
# inner loop against a bare PyTorch loop, with MFU; a round's outer parts timed with the GPU synchronized), and a
# 2-node loopback swarm of 150m.yaml with and without overlap (utilisation: round and inner seconds); with 2 GPUs
# or more, a node on 2 local ranks (NCCL), data parallel and sharded. Each part has a time limit of its own; a part that fails is reported and
# the next one runs; the exit code is the number of parts that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
failed=0

part() {  # part SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    echo "== $what"
    local started=$SECONDS
    if timeout "$limit" "$@"; then
        echo "== $what: done in $((SECONDS - started)) s"
    else
        echo "== $what: FAILED (exit $?) after $((SECONDS - started)) s"
        failed=$((failed + 1))
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
part 90 "tests that need CUDA" "$PY" -m pytest -q -rs -m "not slow" -k "cuda or gpu" tests/
part 90 "inner steps at 150m.yaml against a bare loop (MFU)" \
    "$PY" benchmarks/throughput.py --models 150m --parts inner --repeat 3 --steps 10
part 100 "a round's outer parts at 150m.yaml, the GPU synchronized after each" \
    "$PY" benchmarks/throughput.py --models 150m --parts outer --outer-peers 1 2 --rounds 4
part 200 "2 nodes of 150m.yaml on one GPU, blocking and overlapped" \
    "$PY" benchmarks/throughput.py --models 150m --parts runs --whole-runs 2@3 2@3+overlap --rounds 5
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then  # a node on 2 local ranks (NCCL) beside a 1-rank node: p2ploco.ranks on GPUs
    part 150 "node0 on 2 GPUs (--nproc-per-node 2) and a 1-rank node, tiny.yaml" \
        "$PY" -m p2ploco.cli demo --replicas 2 --nproc-per-node 2 --rounds 4 --set inner.fixed_steps=true
    part 150 "node0 sharded over 2 GPUs (training.shard, FSDP2) and a 1-rank node, tiny.yaml" \
        "$PY" -m p2ploco.cli demo --replicas 2 --nproc-per-node 2 --rounds 4 --set inner.fixed_steps=true \
        --set training.shard=true
else
    echo "== a node on 2 local ranks: skipped, $gpus GPU(s) visible (it needs 2)"
fi
exit $failed
