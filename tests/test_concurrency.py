"""Concurrency: eight tenant processes hammer one executor at once, each mixing inference
forwards and LoRA training steps, and each gets exactly what its own unsplit model gives.

The tenants are real processes (tests/tenants/hammer.py) so that the executor sees eight
independent mailboxes and doorbells, not one process's threads. The executor runs with
--exact (batch-invariant GEMMs), so logits can be compared bitwise even when a tenant's call
was batched with the others'.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from symbiont import connect
from tests.conftest import REPO, running_executor

TENANTS = 8
HAMMER_SECONDS = 10
HAMMER = os.path.join(REPO, "tests", "tenants", "hammer.py")


def _start_tenants(url: str, go_file: str) -> list[subprocess.Popen]:
    # Eight processes share the host's cores: idle OpenMP threads must sleep, not spin. (Not
    # torch.set_num_threads(1): a reference computed with another thread count than the
    # executor's is not bitwise comparable — CPU GEMMs split their sums by thread.)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return [
        subprocess.Popen(
            [sys.executable, HAMMER, url, str(seed), go_file, str(HAMMER_SECONDS)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
        )
        for seed in range(TENANTS)
    ]


def _wait_ready(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Blocks until every tenant printed `ready` (it has built its models and attached)."""
    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(procs):
        while True:
            line = p.stdout.readline()
            if line.strip() == "ready":
                break
            if not line and p.poll() is not None:
                raise AssertionError(f"tenant {i} exited with {p.returncode} before it was ready:\n{p.stdout.read()}")
            assert time.monotonic() < deadline, f"tenant {i} not ready after {timeout_s} s"


def test_eight_tenants_hammering_one_executor(tmp_path):
    go_file = str(tmp_path / "go")
    with running_executor("tiny-llama", "--exact") as ex:
        procs = _start_tenants(ex.url, go_file)
        try:
            _wait_ready(procs, timeout_s=150)
            with connect(ex.url) as observer:
                assert observer.stats().tenants == TENANTS
                open(go_file, "w").close()
                outputs = [p.communicate(timeout=HAMMER_SECONDS + 60)[0] for p in procs]
                deadline = time.monotonic() + 5  # (the data loop frees a retired mailbox soon after its detach)
                while (stats := observer.stats()).mailbox_bytes and time.monotonic() < deadline:
                    time.sleep(0.05)
                health = observer.health()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

        reports = []
        for seed, (p, out) in enumerate(zip(procs, outputs)):
            last = out.strip().splitlines()[-1] if out.strip() else ""
            try:
                report = json.loads(last)
            except ValueError:
                raise AssertionError(f"tenant {seed} exited with {p.returncode} without a report:\n{out}") from None
            assert p.returncode == 0 and not report["failures"], f"tenant {seed} failed:\n" + "\n".join(report["failures"])
            reports.append(report)
        print("per tenant (forwards, train steps):", [(r["forwards"], r["train_steps"]) for r in reports])
        print(f"executor: {stats.calls} calls in {stats.batches} batches, {stats.tokens} tokens, {stats.errors} errors")

        assert health.serving
        for r in reports:
            assert r["forwards"] > 0 and r["train_steps"] > 0, f"tenant {r['seed']} did too little: {r}"
        assert stats.errors == 0
        assert stats.calls > stats.batches, "no batch ever held more than one call: the tenants never overlapped"
        # every tenant detached on its way out: nothing attached, no mailbox left
        assert stats.tenants == 0 and stats.mailbox_bytes == 0, stats
