"""Two tenants at once — one fine-tuning, one generating, each its own process — get their solo results."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from symbiont import connect
from tests.conftest import REPO, running_executor

JOB = os.path.join(REPO, "tests", "jobs", "solo_job.py")


def _start(url: str, mode: str, out: str, n: int, barrier: str, parties: int) -> subprocess.Popen:
    cmd = [sys.executable, JOB, "--url", url, "--mode", mode, "--n", str(n), "--out", out, "--barrier", barrier,
           "--parties", str(parties)]
    return subprocess.Popen(cmd, cwd=REPO)


def _run(url, jobs, tmp_path, tag) -> dict:
    """Runs the jobs at once; they start their loops together (a barrier after building models)."""
    barrier = tmp_path / f"{tag}-barrier-{len(jobs)}-{jobs[0][0]}"
    barrier.mkdir()
    procs = {mode: _start(url, mode, str(tmp_path / f"{tag}-{mode}.pt"), n, str(barrier), len(jobs)) for mode, n in jobs}
    for mode, p in procs.items():
        assert p.wait(timeout=300) == 0, f"{mode} job failed"
    return {mode: torch.load(tmp_path / f"{tag}-{mode}.pt") for mode in procs}


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "batched"])
def test_training_and_generating_tenants_get_solo_results(tmp_path, exact):
    flags = ["--max-wait-us", "3000"] + (["--exact"] if exact else [])
    jobs = [("train", 8), ("generate", 4)]
    with running_executor("tiny-llama", *flags) as ex:
        solo = {}
        for job in jobs:
            solo.update(_run(ex.url, [job], tmp_path, "solo"))
        with connect(ex.url) as conn:
            before = conn.stats()
        together = _run(ex.url, jobs, tmp_path, "together")
        with connect(ex.url) as conn:
            after = conn.stats()
    calls, batches = after.calls - before.calls, after.batches - before.batches
    assert calls > batches, f"the two tenants were never batched together ({calls} calls in {batches} batches)"
    for mode in ("train", "generate"):
        assert solo[mode].keys() == together[mode].keys()
        for key, a in solo[mode].items():
            b = together[mode][key]
            if exact or key.startswith("tokens"):
                assert torch.equal(a, b), f"{mode} {key} differs from its solo run"
            else:  # batched GEMMs sum in another order: equal to float32 rounding
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{mode} {key}")


@pytest.mark.parametrize("busy_on,idle_on", [("local", "local"), ("grpc", "local"), ("local", "grpc")])
def test_a_tenant_waits_for_no_one_while_the_others_are_idle(busy_on, idle_on):
    """Opportunistic batching waits only for tenants that called lately: with batching waits of 2 s
    and a second tenant attached but idle, the first tenant's calls run at once (its forward is not
    held 2 s a call) and give the unsplit model's logits; tenants over local:// and gRPC alike."""
    import socket
    import time

    from symbiont import virtualize
    from symbiont.base_executor.models import build_builtin
    from tests.models import ids

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    x = ids(1, 5)
    want = build_builtin("tiny-llama")(x).logits.detach()
    with running_executor("tiny-llama", "--max-wait-us", "2000000", "--inference-wait-us", "2000000",
                          "--listen", f"grpc://127.0.0.1:{port}", "--insecure") as ex:
        url = {"local": ex.url, "grpc": f"grpc://127.0.0.1:{port}"}
        with connect(url[busy_on], name="busy") as a, connect(url[idle_on], name="idle") as b:
            va, vb = virtualize(build_builtin("tiny-llama"), a), virtualize(build_builtin("tiny-llama"), b)
            with torch.no_grad():
                vb(x)  # b's calls wait for no one: a never called
            time.sleep(2.5)  # b idles past its window
            with torch.no_grad():
                got = va(x).logits
            waits = [c.wait_p99_us for c in a.stats().classes if c.calls]
    torch.testing.assert_close(got, want)
    assert waits and max(waits) < 1e6, waits  # (each call held 2 s before)
