"""Quotas and admission end to end: a real executor with per-tenant limits answers a greedy tenant
RETRY_LATER (a typed RetryLaterError with a hint) while a well-behaved tenant carries on with exact
results; a saturated executor refuses a call too large for its queues and the tenant's model stays
usable. Also the provider's live view: `base-executor stats URL` and the Prometheus endpoint."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

from symbiont import RetryLaterError, connect, virtualize
from symbiont.base_executor.models import build_builtin
from symbiont.client.errors import error_for_status
from symbiont.proto import executor_pb2 as pb
from tests.conftest import REPO, running_executor
from tests.models import ids
from tests.test_errors import EXACT, MODEL, WellBehavedTenant, attached, push_raw, q_call_fields, stats, wait_reply

QUOTA = 4


def test_tenant_over_its_quota_gets_retry_later_and_the_others_carry_on():
    # a long wait keeps the greedy tenant's first calls queued while the rest of its burst arrives
    with running_executor(MODEL, EXACT, "--max-tenant-calls", str(QUOTA), "--max-wait-us", "200000") as ex:
        with WellBehavedTenant(ex) as good, attached(ex, "greedy") as greedy:
            tr = greedy.transport
            reqs = [pb.CallRequest(call_id=1000 + i, **q_call_fields()) for i in range(5 * QUOTA)]
            for r in reqs:  # one burst: the executor drains it in one go
                assert tr._box.requests.push(r.SerializeToString())
            tr._wake.ring()
            got = {}
            while len(got) < len(reqs):  # (refusals come back before the batch runs: any order)
                reply = wait_reply(tr, {r.call_id for r in reqs} - set(got))
                got[reply.call_id] = reply
            replies = [got[r.call_id] for r in reqs]
            codes = [r.status.code for r in replies]
            assert codes.count(pb.OK) >= QUOTA, codes
            refused = [r for r in replies if r.status.code == pb.RETRY_LATER]
            assert len(refused) >= 5 * QUOTA - QUOTA - 1, codes  # (one may have run before the last arrived)
            err = error_for_status(refused[0].status)
            assert isinstance(err, RetryLaterError) and err.retry_after_s > 0 and "quota" in str(err)
            good.carries_on(5)
            s = stats(greedy)
            mine = next(t for t in s.tenant_stats if t.name == "greedy")
            assert mine.refused == len(refused) and s.refused == len(refused)
            assert sum(c.refused for c in s.classes) == len(refused)
            push_raw(tr, pb.CallRequest(call_id=1, **q_call_fields()).SerializeToString())  # served again
            assert wait_reply(tr, {1}).status.code == pb.OK


def test_saturated_executor_refuses_with_a_hint_and_the_model_stays_usable():
    with running_executor(MODEL, "--max-queued-tokens", "8") as ex, connect(ex.url) as conn:
        model = virtualize(build_builtin(MODEL), conn)
        ref = build_builtin(MODEL)
        with torch.no_grad(), pytest.raises(RetryLaterError, match="saturated") as e:
            model(ids(1, 16))  # 16 tokens never fit queues of 8
        assert 0 < e.value.retry_after_s <= 1.0
        x = ids(1, 6)
        with torch.no_grad():
            assert torch.equal(model(x).logits, ref(x).logits)


def test_stats_command_and_prometheus_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running_executor(MODEL, "--metrics-port", str(port)) as ex, connect(ex.url, name="stats-tenant") as conn:
        model = virtualize(build_builtin(MODEL), conn)
        with torch.no_grad():
            model(ids(2, 8))
        out = subprocess.run([sys.executable, "-m", "symbiont.base_executor.cli", "stats", ex.url],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert "policy opportunistic" in out.stdout and "stats-tenant" in out.stdout and "calls/s" in out.stdout
        assert "inference" in out.stdout and "training" in out.stdout
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        calls = next(float(line.split()[-1]) for line in body.splitlines() if line.startswith("symbiont_calls_total"))
        assert calls == conn.stats().calls == 5  # embedding, layer 0's q/k/v, a layer span a layer (2), lm_head
        assert 'symbiont_class_batches_total{calls_per_batch="1",latency="inference"}' in body
        assert 'symbiont_tenant_calls_total{name="stats-tenant"' in body
        # how the calls were taken: a CPU tenant's from its host mailbox; the data loop's rounds and time at work
        s = conn.stats()
        assert dict(s.call_paths) == {"host mailbox": 5}, s.call_paths
        assert s.loop_rounds > 0 and 0 < s.loop_busy_s < s.uptime_s, s
        assert "calls taken since start: host mailbox 100%" in out.stdout and "data loop at work" in out.stdout
        assert 'symbiont_call_paths_total{path="host mailbox"} 5.0' in body
        assert "symbiont_loop_busy_seconds_total" in body and "symbiont_native_late_calls_total 0.0" in body


def test_stats_of_ranks_merged_add_up_the_ways_calls_were_taken():
    from symbiont.base_executor.stats_view import merged, paths_line

    a = pb.StatsReply(calls=10, call_paths={"native lane": 6, "native lane, input in first": 3, "own stream": 4},
                      loop_rounds=5, loop_busy_s=1.0, uptime_s=4.0)
    b = pb.StatsReply(calls=2, call_paths={"host mailbox": 2}, loop_rounds=1, loop_busy_s=0.5, uptime_s=4.0)
    m = merged([a, b])
    assert dict(m.call_paths) == {"native lane": 6, "native lane, input in first": 3, "own stream": 4, "host mailbox": 2}
    assert m.calls == 12 and m.loop_rounds == 6
    assert merged([a, b]).loop_busy_s == 1.0  # (the busiest rank's: its share of the time)
    line = paths_line(a)
    # (the late ones are a part of the native lane's, not a way of their own)
    assert line.startswith("calls taken since start: native lane 60% (50% of them late), own stream 40%"), line
    assert "data loop at work 25% of the time, 5 rounds" in line
    earlier = pb.StatsReply(call_paths={"native lane": 2, "own stream": 4}, loop_rounds=3, loop_busy_s=0.5, uptime_s=3.0)
    assert paths_line(a, earlier).startswith("calls taken: native lane 100% (75% of them late) | data loop at work 50%")
    assert paths_line(a, a).startswith("calls taken since start: native lane 60%")  # (none since: the totals)
    assert paths_line(pb.StatsReply()).startswith("calls taken since start: none yet")
    restarted = pb.StatsReply(call_paths={"native lane": 1, "own stream": 9}, loop_busy_s=0.1, uptime_s=1.0)
    assert paths_line(restarted, a).startswith("calls taken since start: own stream 90%, native lane 10%")
    only_late = pb.StatsReply(call_paths={"native lane": 6, "native lane, input in first": 5, "own stream": 4},
                              loop_busy_s=1.5, uptime_s=5.0)
    assert paths_line(only_late, a).startswith("calls taken since start: native lane 60% (83% of them late)")


def test_a_training_steps_calls_are_training_and_no_grad_calls_inference(executor):
    """The class decides waits and priority: a training forward runs inside autograd Functions
    (grad mode off there) and must still be TRAINING; a no_grad forward is INFERENCE."""
    from tests.models import lora_model

    def by_class(conn):
        return {c.latency: c.calls for c in conn.stats().classes}

    with connect(executor.url) as conn:
        model = virtualize(lora_model(MODEL), conn)
        x = ids(2, 8)
        before = by_class(conn)
        model(input_ids=x, labels=x).loss.backward()
        after = by_class(conn)
        assert after[pb.INFERENCE] == before[pb.INFERENCE] and after[pb.TRAINING] > before[pb.TRAINING]
        with torch.no_grad():
            model(input_ids=x)
        last = by_class(conn)
        # the embedding, layer 0's q/k/v, one layer span a layer (2), the lm_head
        assert last[pb.TRAINING] == after[pb.TRAINING] and last[pb.INFERENCE] - after[pb.INFERENCE] == 5


def test_a_tenant_with_a_latency_budget_is_refused_early_and_the_others_carry_on():
    """A real executor whose calls wait for each other (batching waits of 2 s): while one tenant's
    forward has calls queued, a tenant with a 1 ms latency budget gets OverBudgetError at once (not
    after the wait); the first tenant's forward finishes exact, and the budgeted tenant succeeds once
    the queues are empty. (A third tenant's call just before keeps the first tenant's calls
    waiting: a tenant that got a result lately may call again and join them.)"""
    import threading
    import time

    import torch

    from symbiont import connect, virtualize
    from symbiont.base_executor.models import build_builtin
    from symbiont.client.errors import OverBudgetError, RetryLaterError
    from tests.conftest import running_executor
    from tests.models import ids

    x = ids(1, 5)
    want = build_builtin("tiny-llama")(x).logits.detach()
    with running_executor("tiny-llama", "--max-wait-us", "2000000", "--inference-wait-us", "2000000") as ex:
        with connect(ex.url, name="slow") as a, connect(ex.url, name="hurried", latency_budget_ms=1.0) as b, \
                connect(ex.url, name="lately") as c:
            va, vb, vc = (virtualize(build_builtin("tiny-llama"), conn) for conn in (a, b, c))
            got = {}

            def run():
                with torch.no_grad():
                    got["a"] = va(x).logits

            with torch.no_grad():
                vc(x)  # (no one called before: its calls ran at once)
            worker = threading.Thread(target=run)
            worker.start()
            time.sleep(0.5)  # a's first call waits for c, which got its result lately: it sits in a queue
            t0 = time.monotonic()
            with pytest.raises(OverBudgetError, match="budget") as e, torch.no_grad():
                vb(x)
            assert time.monotonic() - t0 < 0.25 and isinstance(e.value, RetryLaterError)
            worker.join(60)
            torch.testing.assert_close(got["a"], want)
            assert b.stats().refused >= 1
            with torch.no_grad():  # nothing queued ahead now: within budget
                torch.testing.assert_close(vb(x).logits, want)
