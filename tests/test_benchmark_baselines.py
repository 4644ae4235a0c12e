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
