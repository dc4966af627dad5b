"""The benchmark scripts still run and print their tables (on tiny settings; timings are not checked)."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from p2ploco.demo import scratch_folder


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_benchmark_run_folder_is_removed_once_read_and_kept_when_the_run_failed():
    with scratch_folder("p2ploco-test-") as read:
        (read / "node0.log").write_text("trained")
    assert not read.exists()
    with pytest.raises(SystemExit, match="the run failed"), scratch_folder("p2ploco-test-") as failed:
        (failed / "node0.log").write_text("error: something")
        raise SystemExit("the run failed")
    assert (failed / "node0.log").read_text() == "error: something"  # its logs, for the person reading the failure
    shutil.rmtree(failed)


@pytest.mark.timeout(260)
def test_comm_benchmark_prints_bytes_and_speed():
    out = run("benchmarks/comm.py", "--config", "configs/tiny.yaml", "--peers", "2", "3", "--topk", "64")
    assert "Bytes per peer per round" in out and "Codec speed, GB/s" in out and "LoCo: bytes per peer" in out
    rows = [line.split() for line in out.split("Codec speed")[1].splitlines() if line.strip().startswith("1/64")]
    speed = [row for row in rows if row[2] == "cpu"]  # (and a CUDA row per group size where there is one)
    assert [row[1] for row in speed] == ["2", "3"]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in speed)  # compress, decode+aggregate GB/s
    peak = out.split("Peak bandwidth")[1].split("Codec speed")[0]
    two = [line.split() for line in peak.splitlines() if re.match(r"\s*2\s+Streaming E3M0\s+2\s", line)]
    assert len(two) == 1 and float(two[0][6]) > 1.5  # round / peak: two fragments halve the peak (tiny: 2 layers)


@pytest.mark.timeout(120)
def test_streams_benchmark_times_many_streams_against_one_between_real_daemons():
    out = run("benchmarks/streams.py", "--megabytes", "0.02", "--peers", "2", "9", "--repeats", "1")
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s", line)]
    assert [(row[0], row[1], row[2]) for row in rows] == [("2", "1", "20000"), ("9", "8", "2500")]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)


def test_comm_benchmark_sizes_exact_and_resparsified_results_per_peer():
    out = run("benchmarks/comm.py", "--config", "configs/tiny.yaml", "--json", "--scale-peers", "2", "8", "32",
              "--real-up-to", "8", "--replicas", "4")
    rows = {(row["peers"], row["design"]): row for row in map(json.loads, out.splitlines())}
    assert set(rows) == {(n, d) for n in (2, 8, 32) for d in ("butterfly", "resparsified")}
    assert rows[(32, "butterfly")]["extrapolated"] and not rows[(32, "resparsified")]["extrapolated"]
    exact = [rows[(n, "butterfly")]["bytes_received_per_peer"] for n in (2, 8, 32)]
    bounded = [rows[(n, "resparsified")]["bytes_received_per_peer"] for n in (2, 8, 32)]
    assert exact[2] > 10 * exact[0]  # every other peer's selection reaches every peer
    # a result holds what 2 peers selected (128 values per chunk) or, from 4 on, its cap (256): then flat in N
    assert bounded[0] < bounded[1] and bounded[2] < 1.5 * bounded[1]
    assert all(rows[(n, "resparsified")]["dense_fp32_bytes_per_peer"] > 50 * rows[(n, "resparsified")][
        "bytes_sent_per_peer"] for n in (2, 8, 32))


@pytest.mark.slow  # quality.py is in the default run through the next test
@pytest.mark.timeout(260)
def test_quality_benchmark_compares_the_methods():
    out = run("benchmarks/quality.py", "--rounds", "2", "--replicas", "2", "--set", "inner.steps=2")
    for method in ("ddp", "diloco", "sparseloco", "loco"):
        assert f"{method} " in out
    assert "final eval loss" in out


@pytest.mark.timeout(260)
def test_quality_benchmark_trains_every_method_on_the_same_steps_whatever_its_h():
    out = run("benchmarks/quality.py", "--steps", "4", "--replicas", "2", "--set", "inner.steps=2", "--json",
              "--methods", "ddp", "diloco:H=2", "diloco:H=4")
    ddp, every_two, every_four = json.loads(out)
    assert ddp["inner_steps"] == every_two["inner_steps"] == every_four["inner_steps"] == 4
    # dense rounds of the same size: H = 4 syncs once in 4 steps, H = 2 twice
    assert every_two["all_reduce_bytes_per_replica"] == 2 * every_four["all_reduce_bytes_per_replica"]
    assert every_two["final_eval_loss"] != every_four["final_eval_loss"]


@pytest.mark.slow  # Streaming DiLoCo is in the default run through test_streaming.py
@pytest.mark.timeout(260)
def test_quality_benchmark_runs_the_streaming_suite():
    out = run("benchmarks/quality.py", "--suite", "streaming", "--rounds", "2", "--replicas", "2",
              "--methods", "diloco", "streaming:fragments=4,delay=1")
    final = {line.split()[0]: line.split() for line in out.split("final eval loss")[-1].splitlines()[2:] if line}
    assert set(final) == {"diloco", "streaming:fragments=4,delay=1"}
    assert 0 < float(final["streaming:fragments=4,delay=1"][1]) < 10  # a finite loss, 4 fragments of 4 layers


@pytest.mark.slow  # a group next to a replica is in the default run through test_pipeline_swarm.py
@pytest.mark.timeout(260)
def test_quality_benchmark_runs_heterogeneous_replicas():
    out = run("benchmarks/quality.py", "--suite", "heterogeneous", "--rounds", "2", "--replicas", "2",
              "--set", "inner.steps=2", "--methods", "sparseloco", "selective:ratio=16", "uniform:ratio=16")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-3:]}
    assert rows["sparseloco"][-3:] == ["kB", "-", "-"]  # no pipelines: no stage-boundary traffic, no U
    assert rows["selective:ratio=16"][-2] == "kB" and rows["uniform:ratio=16"][-2] == "kB"
    assert all(0 < float(rows[m][-1]) < 1 for m in ("selective:ratio=16", "uniform:ratio=16"))  # a share


@pytest.mark.slow  # slow peers are in the default run through test_reach_and_pace.py
@pytest.mark.timeout(260)
def test_quality_benchmark_runs_slow_replicas_for_the_same_rounds():
    out = run("benchmarks/quality.py", "--suite", "pace", "--rounds", "1", "--set", "inner.steps=3", "--json",
              "--methods", "sparseloco+speeds:1,3", "sparseloco+speeds:1,3,unweighted")
    weighted, unweighted = json.loads(out)
    for figures in (weighted, unweighted):  # H = 3: the replica 3x slower trains one step
        assert figures["replicas"] == 2 and figures["steps_per_replica"] == [3, 1]
        assert figures["tokens_per_replica"] == [3 * 8 * 128, 8 * 128] and figures["slow_tokens_share"] == 0.25
    assert weighted["slow_weight_share"] == 0.25 and unweighted["slow_weight_share"] == 0.5
    assert weighted["final_eval_loss"] != unweighted["final_eval_loss"]


@pytest.mark.timeout(260)
def test_pipeline_benchmark_reports_the_boundary_ratio_as_json():
    figures = json.loads(run("benchmarks/pipeline.py", "--json"))
    assert {"boundary_bytes_per_token", "dense_bf16_bytes_per_token", "ratio", "stage_param_bytes",
            "full_param_bytes"} <= set(figures)
    # tiny-pipeline: 8 bf16 values and a uint16 id per token (+ the window's one extra target id per sequence)
    assert figures["boundary_bytes_per_token"] == pytest.approx(2 * 8 + 2 * 129 / 128)
    assert figures["ratio"] >= 8
    assert figures["stage_param_bytes"] < 0.6 * figures["full_param_bytes"]


@pytest.mark.slow  # a group next to a replica is in the default run through test_pipeline_swarm.py
@pytest.mark.timeout(260)
def test_pipeline_swarm_benchmark_measures_a_real_group_next_to_a_replica():
    figures = json.loads(run("benchmarks/pipeline_swarm.py", "--rounds", "2", "--json").splitlines()[-1])
    # tiny-pipeline: rank 8 in bf16 each way, 129 uint16 token ids per 128-token window, and per inner step of
    # 2 x 4 windows one sum message (3 float64s: the loss, the squared gradient norm and the stop vote) to the other
    # stage
    assert figures["boundary_bytes_per_token"] == pytest.approx(2 * 8 * 2 + 2 * 129 / 128 + 24 / (8 * 128))
    assert figures["uncompressed_boundary_bytes_per_token"] == pytest.approx(2 * 128 * 2 + 2 * 129 / 128)
    assert figures["rounds"] == 1 and figures["group_tokens_per_second"] > 0 < figures["replica_tokens_per_second"]
    assert 0 < figures["pipeline_round"]["stage_transfers"] < figures["pipeline_round"]["inner"]


@pytest.mark.slow  # a joiner fetching state from real donors is in the default run through test_elastic.py
@pytest.mark.timeout(260)
def test_catchup_benchmark_fetches_from_real_donors():
    out = run("benchmarks/catchup.py", "--config", "configs/tiny.yaml", "--donors", "2", "--repeats", "2")
    assert "Catch-up" in out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("configs/tiny.yaml "))
    assert row.split()[1:5] == ["0.5M", "1.8", "MB", "2"]


@pytest.mark.timeout(120)
def test_catchup_benchmark_measures_the_rounds_updates_against_the_state():
    """At tiny.yaml a SparseLoCo round of two replicas changes 6.7% of the state: 1 and 3 missed rounds are fetched
    as updates, 10 (more than the quarter of the state peers keep) as the state; every chain applied gives the swarm's
    state (the benchmark raises otherwise)."""
    rows = [json.loads(line) for line in run("benchmarks/catchup.py", "--updates", "--config", "configs/tiny.yaml",
                                             "--missed", "1", "3", "10", "--json").splitlines()]
    assert [(r["missed_rounds"], r["fetched"]) for r in rows] == [(1, "updates"), (3, "updates"), (10, "state")]
    assert rows[0]["update_bytes"] < rows[0]["state_bytes"] / 10
    assert [r["update_bytes"] for r in rows] == sorted(r["update_bytes"] for r in rows)
    assert rows[2]["fetched_bytes"] == rows[2]["state_bytes"]


@pytest.mark.slow  # nodes on a prepared corpus are in the default run through test_data_nodes.py
@pytest.mark.timeout(260)
def test_data_benchmark_prepares_and_measures_nodes():
    out = run("benchmarks/data.py", "--size-mb", "20", "--small-mb", "2", "--bpe-mb", "1", "--rounds", "1")
    assert "Prepare" in out and "peak RSS" in out
    assert out.count("prepared  ") == 2 and out.count("data.paths (in memory)  ") == 2
    assert "(target: within ~100 MB)" in out


@pytest.mark.timeout(260)
def test_fuzzing_every_decoder_raises_only_project_errors():
    out = run("benchmarks/fuzz.py", "--cases", "1500")
    assert "sparse relay result" in out and "state blob" in out and "signed DHT record" in out
    assert "status answer" in out
    assert out.rstrip().endswith("0 non-project exceptions")


@pytest.mark.slow  # kills and restarts are in the default run through test_elastic.py
@pytest.mark.timeout(260)
def test_chaos_benchmark_kills_and_restarts_nodes_and_rounds_stay_all_or_nothing():
    out = run("benchmarks/chaos.py", "--nodes", "3", "--rounds", "10", "--kill-every", "2", "--rejoin-rounds", "5",
              "--no-calm", "--json")
    assert "Chaos run, round by round" in out and "longest stall" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["kills"] >= 1 and summary["rounds_completed"] == 10
    assert summary["rounds_with_differing_hashes"] == 0
    assert set(summary["exit_codes"].values()) == {0}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_six_nodes_under_chaos_agree_on_every_round():
    out = subprocess.run([sys.executable, "benchmarks/chaos.py", "--nodes", "6", "--rounds", "18", "--kill-every", "3",
                          "--rejoin-rounds", "6", "--no-calm", "--json"], capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["kills"] >= 4 and summary["rounds_completed"] == 18 and summary["rounds_dropped"] == 0
    assert summary["rounds_with_differing_hashes"] == 0 and set(summary["exit_codes"].values()) == {0}


@pytest.mark.slow  # a benchmark's smoke test of 35 s: the default run keeps to its time
@pytest.mark.timeout(200)
def test_throughput_benchmark_times_the_node_against_a_bare_loop_and_whole_runs():
    rows = json.loads(run("benchmarks/throughput.py", "--models", "tiny", "--repeat", "1", "--steps", "2",
                          "--rounds", "4", "--parts", "inner", "outer", "runs", "--whole-runs", "1@3", "2@3+overlap",
                          "--json", "--set", "training.threads=1"))
    inner, alone, pair, *runs = rows
    for row, peers in ((alone, 1), (pair, 2)):
        assert row["part"] == "outer" and row["peers"] == peers and row["rounds"] == 4
        assert list(row["seconds"]) == ["contribute", "reduce", "receive", "prepare", "take", "hash", "load"]
        assert min(row["seconds"].values()) >= 0 and row["seconds"]["contribute"] > 0
    assert inner["part"] == "inner" and inner["threads"] == 1 and inner["device"] == "cpu" and "mfu" not in inner
    assert inner["bare_tokens_per_second"] > 0 and inner["node_tokens_per_second"] > 0
    assert inner["node_vs_bare"] == round(inner["node_tokens_per_second"] / inner["bare_tokens_per_second"], 4)
    assert [(r["nodes"], r["H"], r["overlap"]) for r in runs] == [(1, 3, False), (2, 3, True)]
    for row in runs:
        assert row["params_agree"] and row["tokens_per_second_per_node"] > 0 and "vs_bare" in row
        assert row["round_seconds"] >= row["inner_seconds"] > 0
