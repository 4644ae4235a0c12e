"""The benchmarks' baselines run (not timed here: speed goals live in benchmarks/RESULTS.md). S10's
FSDP job (fleet_worker.py --mode fsdp): two CPU ranks over gloo train one LoRA adapter with the model
fully_shard-ed, stop at the same step, and report their own tokens."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_fsdp_job_of_two_cpu_ranks_trains_and_its_ranks_stop_together(checkpointing):
    import fleet

    port = fleet.free_port()
    workers = [["--mode", "fsdp", "--role", "finetune", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32",
                "--batch", "2", "--seq", "16", "--warmup", "1", "--fsdp-rank", str(r), "--fsdp-world", "2",
                "--fsdp-port", str(port)] + (["--checkpointing"] if checkpointing else []) for r in range(2)]
    results, *_ = fleet.run_fleet(workers, 2.0, timeout_s=300)
    assert [r["mode"] for r in results] == ["fsdp", "fsdp"]
    assert len(results[0]["ends"]) == len(results[1]["ends"]) > 0  # (the job's ranks stop at the same step)
    assert fleet.finetune_figures(results)["tokens_per_s"] > 0


def test_s10_runs_on_cpu_ranks_and_reports_every_rank(tmp_path):
    """S10's runner end to end on CPU processes (its smoke test: the GPU runs cost device time):
    plain processes, an FSDP job of two ranks and tenants of a two-rank executor each give a row;
    the tenants' rows carry both ranks' counters, and both ranks served calls."""
    import json
    import subprocess

    out = tmp_path / "s10"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "s10_multi_gpu.py"), "--cpu", "--model", "tiny-llama", "--gpus", "2",
           "--ks", "1,2", "--max-processes", "1", "--fsdp-jobs", "1", "--batch", "1", "--seq", "16", "--seconds", "2",
           "--warmup", "1", "--out", str(out), "--tag", "smoke"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=os.path.join(REPO, "benchmarks"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "s10_tiny-llama_x2_smoke.json").read_text())["rows"]
    assert [(r["k"], r["who"]) for r in rows] == [(1, "processes"), (1, "fsdp x2"), (1, "symbiont opportunistic x2"),
                                                  (2, "symbiont opportunistic x2")], rows
    assert all(r["tokens_per_s"] > 0 for r in rows)
    for r in rows[2:]:
        assert len(r["batches_per_rank"]) == 2 and all(b["calls"] > 0 for b in r["batches_per_rank"]), r
    assert "adapters trained in the same time" in done.stdout


def test_several_decoding_tenants_in_one_worker_process(executor):
    """fleet_worker --tenants N (S3 beyond MPS's 48 processes a GPU): N tenants of one process, each
    its own connection, adapter and thread, start on one go and give a result each."""
    import fleet

    worker = ["--mode", "symbiont", "--role", "infer", "--url", executor.url, "--model", "tiny-llama", "--device", "cpu",
              "--prompt", "8", "--new-tokens", "4", "--warmup", "1", "--index", "5", "--tenants", "3"]
    results, *_ = fleet.run_fleet([worker], 2.0, timeout_s=300)
    assert sorted(r["index"] for r in results) == [5, 6, 7]
    assert all(r["runs"] and len(r["runs"][0]) == 1 + 4 for r in results), results  # (each run: its start, 4 tokens)
    assert len({r["start"] for r in results}) == 1  # (one go for all)
    assert fleet.infer_figures(results)["tokens_per_s"] > 0


def test_several_tenants_of_one_worker_process_name_hosted_adapters():
    """S9 at N beyond MPS's processes: fleet_worker --tenants 2 --s9-adapters 0,1 --shared, two tenants
    of one process each naming its own of the provider's registered adapters, which the executor
    computes (its adapter calls count them)."""
    import fleet
    import s9_hosted
    from tests.conftest import running_executor

    with running_executor("tiny-llama", "--dtype", "bfloat16") as ex:
        s9_hosted.register(ex.url, "tiny-llama", 2)
        before = fleet.executor_stats(ex.url)
        worker = ["--mode", "symbiont", "--role", "infer", "--url", ex.url, "--model", "tiny-llama", "--device", "cpu",
                  "--prompt", "8", "--new-tokens", "4", "--warmup", "1", "--index", "0", "--tenants", "2",
                  "--s9-adapters", "0,1", "--shared"]
        results, *_ = fleet.run_fleet([worker], 2.0, timeout_s=300)
        after = fleet.executor_stats(ex.url)
        lone = worker[: worker.index("--tenants")] + ["--tenants", "1", "--s9-adapters", "1", "--shared"]
        alone, *_ = fleet.run_fleet([lone], 2.0, timeout_s=300)  # (a process's last chunk of one tenant: s9_hosted)
        last = fleet.executor_stats(ex.url)
    assert sorted(r["index"] for r in results) == [0, 1]
    assert all(r["runs"] and len(r["runs"][0]) == 1 + 4 for r in results), results
    assert int(after.get("adapter_calls", 0)) > int(before.get("adapter_calls", 0)), (before, after)
    assert len(alone) == 1 and int(last.get("adapter_calls", 0)) > int(after.get("adapter_calls", 0)), (after, last)


def test_a_worker_that_dies_before_ready_is_reported_at_once():
    """run_fleet reads every worker's lines as they come: one that ends before `ready` (here argparse
    refusing its mode) fails the fleet at once, not after the others' warm-ups or the timeout."""
    import time

    import fleet

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker 0 ended before it was ready \(exit code 2\)"):
        fleet.run_fleet([["--mode", "nope", "--role", "infer"]], 1.0, timeout_s=120)
    assert time.monotonic() - t0 < 60


def test_s9_adapters_on_every_attention_projection_load_into_peft():
    """S9's `--targets q_proj,k_proj,v_proj,o_proj` (S3's adapters): adapter k's weights fit a PEFT
    LoRA of those targets on a GQA model (k and v narrower than q), q and v alone stay the default,
    and a target S9 does not make is refused by name."""
    import fleet_worker
    import s9_adapters

    from tests.models import build_builtin

    config = build_builtin("tiny-llama").config
    assert config.num_key_value_heads < config.num_attention_heads  # (k and v narrower than q and o)
    every = s9_adapters.ATTENTION
    weights = s9_adapters.adapter_weights(config, 3, targets=every)
    assert len(weights) == config.num_hidden_layers * 4
    model = fleet_worker.lora(build_builtin("tiny-llama"), s9_adapters.rank_of(3), list(every))
    s9_adapters.load_into(model, weights)  # (raises on a shape that does not fit, or a layer left out)
    o = model.base_model.model.model.layers[1].self_attn.o_proj
    assert torch.equal(o.lora_B["default"].weight, weights["model.layers.1.self_attn.o_proj"][1])
    default = s9_adapters.adapter_weights(config, 3)
    assert sorted(default) == sorted(u for u in weights if u.endswith(("q_proj", "v_proj")))
    with pytest.raises(ValueError, match="not on gate_proj"):
        s9_adapters.adapter_weights(config, 3, targets=("q_proj", "gate_proj"))


def test_a_fleet_timeline_tells_the_word_waits_from_work():
    """fleet_timeline.summarise: a tenant's one-thread kernel spinning on a mailbox word (named
    `wait`) makes the GPU read busy for the whole window; without the word waits, it was busy only
    while the GEMMs ran (two 10 ms GEMMs of two processes overlapping by 5 ms: 15 of 100 ms)."""
    import fleet_timeline

    ms = 1000  # (spans are in µs)
    parts = {
        "tenant 0": {"spans": [(0, 100 * ms, "wait"), (10 * ms, 20 * ms, "nvjet_gemm")], "units": 10, "wall_s": 1.0, "cpu_s": 0.5},
        "process 0": {"spans": [(0, 1, "fill"), (15 * ms, 25 * ms, "cutlass_gemm"), (100 * ms - 1, 100 * ms, "fill")],
                      "units": 10, "wall_s": 1.0, "cpu_s": 0.5},
    }
    s = fleet_timeline.summarise(parts, 1)
    assert fleet_timeline.kind_of("wait") == "word wait" and fleet_timeline.kind_of("wait_for_it_gemm") == "gemm"
    assert s["gpu_busy_share"] == pytest.approx(1.0)
    assert s["gpu_working_share"] == pytest.approx(0.15, abs=1e-4)
    assert s["working_concurrency"] == pytest.approx(20 / 15, abs=1e-3)
    assert s["launches_per_token"] == pytest.approx(5 / 2)  # (five kernels; each worker's 10 tokens a second over 0.1 s)
    assert "without the word waits: busy 15.0%" in fleet_timeline.report("t", s)
    # (each worker's kernels by name: launches a token, µs a launch; tenant 0's and process 0's reported)
    assert s["processes"]["tenant 0"]["top_kernels"] == [("wait", 0.5, 100 * ms), ("nvjet_gemm", 0.5, 10 * ms)]
    assert "0.5 a token x 10000.0 µs  cutlass_gemm" in fleet_timeline.report("t", s)
