"""The scheduler's policies (opportunistic, lockstep, no-lockstep), priority between the latency
classes without starvation, per-tenant quotas and the saturated executor's typed retry status, and
the per-class statistics. The pure core: no sockets, no processes."""
from __future__ import annotations

import pytest
import torch

from symbiont.base_executor.core import CallError, batch_bucket
from symbiont.base_executor.scheduler import SchedulerConfig
from symbiont.proto import executor_pb2 as pb
from tests.test_scheduler import K, Q, call, core_for, model  # noqa: F401 - the module's model fixture

V = "model.layers.0.self_attn.v_proj"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy must be one of opportunistic, lockstep, no-lockstep"):
        SchedulerConfig(policy="greedy")


def test_no_lockstep_runs_each_call_at_once(model):
    core = core_for(model, policy="no-lockstep", max_wait_us=10_000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    assert [r.call.tenant for r in core.step(now=0.0, attached=2)] == [1]  # no wait for tenant 2
    # calls already queued together still share the batch
    core.submit(call(core, 1, Q, 3, t=1.0))
    core.submit(call(core, 2, Q, 3, t=1.0, seed=1))
    assert [r.call.tenant for r in core.step(now=1.0, attached=2)] == [1, 2]


def test_lockstep_waits_for_every_attached_tenant(model):
    core = core_for(model, policy="lockstep", max_wait_us=0)
    core.submit(call(core, 1, Q, 3, t=0.0))
    core.submit(call(core, 2, Q, 3, t=0.0, seed=1))
    assert core.step(now=0.05, attached=3) == []  # tenant 3 has not come
    core.submit(call(core, 3, Q, 3, t=0.05, seed=2))
    assert sorted(r.call.tenant for r in core.step(now=0.05, attached=3)) == [1, 2, 3]


def test_lockstep_waits_for_a_missing_tenant_no_longer_than_its_bound(model):
    """A tenant whose next input its GPU holds back (behind another tenant's queued call, on a
    shared hardware queue) must not stall everyone: the queue runs once it waited lockstep_wait_us."""
    core = core_for(model, policy="lockstep", lockstep_wait_us=100_000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    core.submit(call(core, 2, Q, 3, t=0.0, seed=1))
    assert core.step(now=0.099, attached=3) == []
    assert core.scheduler.next_deadline() == pytest.approx(0.1)
    assert sorted(r.call.tenant for r in core.step(now=0.1, attached=3)) == [1, 2]


def test_lockstep_never_deadlocks_when_every_tenant_waits_elsewhere(model):
    core = core_for(model, policy="lockstep")
    core.submit(call(core, 1, Q, 3, t=0.0))
    core.submit(call(core, 2, K, 3, t=0.1, seed=1))
    # both tenants wait, at different units: nothing can join either queue, so the oldest runs
    results = core.step(now=0.2, can_grow=False, attached=2)
    assert [(r.call.tenant, r.call.unit.id) for r in results] == [(1, Q)]


def test_opportunistic_batches_calls_that_arrive_within_the_wait(model):
    core = core_for(model, max_wait_us=1000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    assert core.step(now=0.0004, attached=2) == []
    core.submit(call(core, 2, Q, 3, t=0.0004, seed=1))
    assert core.step(now=0.0009, attached=2) != []  # every attached tenant waits: run now (can_grow from the caller)
    assert core.counters.classes[pb.TRAINING].batch_calls[batch_bucket(2)] == 1


def test_inference_goes_first_but_training_does_not_starve(model):
    core = core_for(model, max_wait_us=0, inference_wait_us=0, starve_us=10_000)
    core.submit(call(core, 1, Q, 3, t=0.0))  # training
    core.submit(call(core, 2, K, 3, t=0.001, latency=pb.INFERENCE, seed=1))
    assert [r.call.tenant for r in core.step(now=0.002)] == [2]  # inference first
    # a steady inference load: each new inference call is younger than the training call
    for i in range(3):
        core.submit(call(core, 2, K, 3, t=0.003 + i * 0.001, latency=pb.INFERENCE, seed=2 + i))
        assert [r.call.tenant for r in core.step(now=0.004 + i * 0.001)] == [2]
    core.submit(call(core, 2, K, 3, t=0.0105, latency=pb.INFERENCE, seed=9))
    # the training call has waited past starve_us: it goes before the younger inference call
    assert [r.call.tenant for r in core.step(now=0.011)] == [1]
    assert [r.call.tenant for r in core.step(now=0.011)] == [2]


def test_tenant_over_its_call_quota_gets_retry_later_and_others_carry_on(model):
    core = core_for(model, max_tenant_calls=2, max_wait_us=10_000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    core.submit(call(core, 1, K, 3, t=0.0, seed=1))
    with pytest.raises(CallError) as e:
        core.submit(call(core, 1, V, 3, t=0.0, seed=2))
    assert e.value.code == pb.RETRY_LATER and "quota 2" in e.value.message
    assert e.value.status().retry_after_us > 0
    core.submit(call(core, 2, V, 3, t=0.0, seed=3))  # another tenant is not refused
    assert core.counters.refused == 1 and core.counters.per_tenant_refused[1] == 1
    assert core.scheduler.queued(1) == 2 and core.scheduler.queued(2) == 1
    while core.step(now=1.0, can_grow=False):
        pass
    core.submit(call(core, 1, V, 3, t=1.0, seed=4))  # room again once its calls ran


def test_tenant_token_quota_and_a_saturated_executor(model):
    core = core_for(model, max_tenant_tokens=10, max_queued_tokens=16, max_wait_us=10_000)
    core.submit(call(core, 1, Q, 8, t=0.0))
    with pytest.raises(CallError, match="quota of 10") as e:
        core.submit(call(core, 1, K, 3, t=0.0, seed=1))
    assert e.value.code == pb.RETRY_LATER
    core.submit(call(core, 2, K, 8, t=0.0, seed=2))
    with pytest.raises(CallError, match="saturated: 16 tokens queued") as e:
        core.submit(call(core, 3, V, 1, t=0.0, seed=3))
    assert e.value.code == pb.RETRY_LATER and 0 < e.value.retry_after_s <= 1.0
    assert core.scheduler.queued_tokens == 16


def test_stats_per_class_batches_and_waits(model):
    core = core_for(model, max_wait_us=0, inference_wait_us=0)
    for i in range(5):
        core.submit(call(core, i, Q, 2, t=0.0, seed=i))
    core.step(now=0.001)  # one training batch of 5 calls, each waited 1000 us
    core.submit(call(core, 9, K, 2, t=0.001, latency=pb.INFERENCE, seed=9))
    core.step(now=0.001)
    train, infer = core.counters.classes[pb.TRAINING], core.counters.classes[pb.INFERENCE]
    assert train.batch_calls == [0, 0, 0, 1, 0, 0, 0] and train.calls == 5 and train.tokens == 10
    assert infer.batch_calls == [1, 0, 0, 0, 0, 0, 0]
    assert list(core.scheduler.waits_us[pb.TRAINING]) == pytest.approx([1000.0] * 5)
    unit = core.table.get(Q)
    assert core.counters.flops == pytest.approx(2 * 10 * unit.in_features * unit.out_features + 2 * 2 * 64 * core.table.get(K).out_features)
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 500)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert torch.float32  # (the core's dtype in these tests)


@pytest.mark.parametrize("policy", ["lockstep", "opportunistic", "no-lockstep"])
def test_a_tenants_calls_run_in_the_order_it_sent_them(model, policy):
    # tenant 1 sent a call at Q, then (its host running ahead of its GPU) one at K whose input may be
    # computed from the first one's output; tenant 2 waits at K. K holds both tenants, but tenant 1's
    # call there may not run before its call at Q: that would wait for an input never computed.
    core = core_for(model, policy=policy, max_wait_us=0)
    core.submit(call(core, 2, K, 3, t=0.0, seed=2))  # K's queue is the older one
    core.submit(call(core, 1, Q, 3, t=0.05))
    core.submit(call(core, 1, K, 3, t=0.1, seed=1))
    first = core.step(now=0.2, can_grow=False, attached=2)
    assert (1, K) not in [(r.call.tenant, r.call.unit.id) for r in first]
    ran = [(r.call.tenant, r.call.unit.id) for r in first]
    while core.scheduler.pending():
        ran += [(r.call.tenant, r.call.unit.id) for r in core.step(now=0.3, can_grow=False, attached=2)]
    assert ran.index((1, Q)) < ran.index((1, K)) and sorted(ran) == [(1, K), (1, Q), (2, K)]



def test_a_call_that_would_wait_past_its_budget_is_refused_at_once(model):
    core = core_for(model, max_wait_us=5000)
    for t in (0.0, 1.0, 2.0):  # calls of the training class wait 5 ms for a batch
        core.submit(call(core, 1, Q, 8, t=t))
        assert core.step(now=t + 0.006, attached=2)
    core.submit(call(core, 2, K, 8, t=3.0))  # something queued
    tight, loose, none = (call(core, 3, V, 1, t=3.0, seed=s) for s in (3, 4, 5))
    tight.budget_s, loose.budget_s = 0.001, 0.1
    with pytest.raises(CallError, match="budget of 1.000 ms") as e:
        core.submit(tight)
    assert e.value.code == pb.OVER_BUDGET and 0 < e.value.retry_after_s <= 1.0
    core.submit(loose)
    core.submit(none)
    assert core.scheduler.pending() == 3 and core.counters.refused == 1
    core.step(now=3.01, can_grow=False, attached=4)
    while core.scheduler.pending():
        core.step(now=3.02, can_grow=False, attached=4)
    tight.budget_s = 0.001
    core.submit(tight)  # nothing queued: it runs as soon as its batch forms
    assert core.scheduler.pending() == 1


def test_a_queue_stuck_before_any_call_ran_refuses_a_call_over_its_budget(model):
    """The expected wait counts the oldest call of the class queued now, not only the waits of calls
    that ran: nothing has run yet (no wait measured), but a call queued 0.5 s ago says calls wait."""
    core = core_for(model, max_wait_us=10_000_000)
    core.submit(call(core, 1, Q, 8, t=0.0))
    tight, other_class = call(core, 2, K, 1, t=0.5, seed=1), call(core, 3, K, 1, t=0.5, latency=pb.INFERENCE, seed=2)
    tight.budget_s = other_class.budget_s = 0.001
    with pytest.raises(CallError, match="budget") as e:
        core.submit(tight)
    assert e.value.code == pb.OVER_BUDGET
    core.submit(other_class)  # (no inference call is queued: its class waits for nothing)
    assert core.scheduler.pending() == 2


def test_lockstep_never_refuses_a_call_for_its_budget(model):
    """Under lockstep the queues wait for tenants: refusing one for its budget would refuse the very
    call the others wait for."""
    core = core_for(model, policy="lockstep")
    core.submit(call(core, 1, Q, 3, t=0.0))
    late = call(core, 2, Q, 3, t=9.0, seed=1)
    late.budget_s = 1e-6
    core.submit(late)
    assert sorted(r.call.tenant for r in core.step(now=9.0, attached=2)) == [1, 2]
