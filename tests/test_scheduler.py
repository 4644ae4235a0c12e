"""The executor's pure core without sockets: batching rules, priorities, no lockstep, isolation."""
from __future__ import annotations

import pytest
import torch

from symbiont.base_executor.catalog import UnitTable
from symbiont.base_executor.core import CallError, ExecutorCore
from symbiont.base_executor.models import build_builtin
from symbiont.base_executor.scheduler import MAX_SUCCESSORS, Call, Scheduler, SchedulerConfig
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.codec import dtype_enum

Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"


@pytest.fixture(scope="module")
def model():
    return build_builtin("tiny-llama")


def core_for(model, **cfg) -> ExecutorCore:
    return ExecutorCore(UnitTable(model), torch.float32, torch.device("cpu"), SchedulerConfig(**cfg))


def call(core, tenant, unit, tokens, t, latency=pb.TRAINING, op=pb.FORWARD, seed=0):
    u, in_shape, out_shape, _ = core.check(unit, op, dtype_enum(torch.float32), [tokens, 64])
    x = torch.randn(in_shape, generator=torch.Generator().manual_seed(seed))
    return Call(tenant=tenant, call_id=seed, unit=u, op=op, x=x, out_shape=out_shape, latency=latency, arrived=t)


def test_waits_for_max_wait_then_batches_all_tenants(model):
    core = core_for(model, max_wait_us=1000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    core.submit(call(core, 2, Q, 5, t=0.0002, seed=1))
    assert core.step(now=0.0005) == []  # oldest waited 500 us < 1000 us
    results = core.step(now=0.0011)
    assert [r.call.tenant for r in results] == [1, 2]
    assert [tuple(r.y.shape) for r in results] == [(3, 64), (5, 64)]
    assert core.counters.batches == 1 and core.counters.calls == 2


def test_batched_rows_match_each_call_alone(model):
    core = core_for(model, max_wait_us=0)
    calls = [call(core, i, Q, n, t=0.0, seed=i) for i, n in enumerate([1, 4, 9])]
    for c in calls:
        core.submit(c)
    results = core.step(now=1.0)
    unit = core.table.get(Q)
    for r in results:
        torch.testing.assert_close(r.y, torch.nn.functional.linear(r.call.x, unit.weight, unit.bias), rtol=1e-6, atol=1e-6)


def test_exact_mode_is_bitwise_per_call(model):
    core = core_for(model, max_wait_us=0, exact=True)
    calls = [call(core, i, Q, n, t=0.0, seed=i) for i, n in enumerate([1, 4, 9, 33])]
    for c in calls:
        core.submit(c)
    unit = core.table.get(Q)
    for r in core.step(now=1.0):
        assert torch.equal(r.y, torch.nn.functional.linear(r.call.x, unit.weight, unit.bias))
    assert core.counters.batches == 1 and core.counters.calls == 4


def test_max_batch_tokens_runs_at_once_and_caps_the_batch(model):
    core = core_for(model, max_wait_us=10_000_000, max_batch_tokens=8)
    core.submit(call(core, 1, Q, 5, t=0.0))
    assert core.step(now=0.001) == []
    core.submit(call(core, 2, Q, 5, t=0.0))
    first = core.step(now=0.001)  # 10 tokens queued >= 8: due, but a batch holds at most 8
    assert [r.call.tenant for r in first] == [1]
    assert core.scheduler.pending() == 1


def test_inference_waits_less_and_goes_first(model):
    core = core_for(model, max_wait_us=1000, inference_wait_us=10)
    core.submit(call(core, 1, Q, 4, t=0.0))
    core.submit(call(core, 2, K, 4, t=0.0001, latency=pb.INFERENCE))
    results = core.step(now=0.0002)  # only the inference queue is due
    assert [r.call.tenant for r in results] == [2]
    core.submit(call(core, 3, K, 4, t=0.0, latency=pb.INFERENCE))
    results = core.step(now=0.01)  # both due: inference first although the training call is older
    assert [r.call.tenant for r in results] == [3]


def test_no_waiting_when_no_other_call_can_arrive(model):
    core = core_for(model, max_wait_us=10_000_000)
    core.submit(call(core, 1, Q, 2, t=0.0))
    assert core.step(now=0.0, can_grow=True) == []
    assert len(core.step(now=0.0, can_grow=False)) == 1


def test_no_lockstep_between_units(model):
    """Tenants batched at q_proj are free at k_proj: each is served as soon as its own call is due."""
    core = core_for(model, max_wait_us=100)
    core.submit(call(core, 1, Q, 2, t=0.0))
    core.submit(call(core, 2, Q, 2, t=0.0))
    assert len(core.step(now=0.001)) == 2
    core.submit(call(core, 1, K, 2, t=0.002))  # tenant 2 is elsewhere (attention, ...)
    results = core.step(now=0.0022)
    assert [r.call.tenant for r in results] == [1]


def test_backward_is_input_gradient(model):
    core = core_for(model, max_wait_us=0)
    u, in_shape, out_shape, _ = core.check(Q, pb.BACKWARD, dtype_enum(torch.float32), [2, 3, 64])
    assert in_shape == (6, 64) and out_shape == (2, 3, 64)
    g = torch.randn(in_shape)
    core.submit(Call(tenant=1, call_id=1, unit=u, op=pb.BACKWARD, x=g, out_shape=out_shape, latency=0, arrived=0.0))
    (r,) = core.step(now=1.0)
    torch.testing.assert_close(r.y, (g @ u.weight).view(out_shape))


@pytest.mark.parametrize(
    "unit,op,dtype,shape,code",
    [
        ("model.nope", pb.FORWARD, torch.float32, [1, 64], pb.UNKNOWN_UNIT),
        (Q, pb.FORWARD, torch.float32, [1, 63], pb.SHAPE_MISMATCH),
        (Q, pb.FORWARD, torch.bfloat16, [1, 64], pb.DTYPE_MISMATCH),
        (Q, 42, torch.float32, [1, 64], pb.INVALID_ARGUMENT),
        (Q, pb.FORWARD, torch.float32, [], pb.INVALID_ARGUMENT),
        ("model.embed_tokens", pb.BACKWARD, torch.int64, [4], pb.INVALID_ARGUMENT),
        ("model.embed_tokens", pb.FORWARD, torch.float32, [4], pb.DTYPE_MISMATCH),
    ],
)
def test_check_rejects_with_typed_code(model, unit, op, dtype, shape, code):
    core = core_for(model)
    with pytest.raises(CallError) as e:
        core.check(unit, op, dtype_enum(dtype), shape)
    assert e.value.code == code


def test_drop_forgets_matching_calls(model):
    core = core_for(model, max_wait_us=0)
    core.submit(call(core, 1, Q, 2, t=0.0))
    core.submit(call(core, 2, Q, 2, t=0.0))
    assert core.scheduler.drop(lambda c: c.tenant == 1) == 1
    assert [r.call.tenant for r in core.step(now=1.0)] == [2]
    assert core.scheduler.pending() == 0 and core.scheduler.waiting_tenants() == 0


def test_config_validation():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="waits"):
        Scheduler(SchedulerConfig(max_wait_us=-1))


def test_tied_weights_are_one_tensor():
    table = UnitTable(build_builtin("tiny-qwen2"))
    head, embed = table.get("lm_head"), table.get("model.embed_tokens")
    assert head.tied_to == "model.embed_tokens" and head.weight is embed.weight
    assert table.parameter_count() == sum(
        p.numel() for n, p in build_builtin("tiny-qwen2").named_parameters() if n.endswith(("proj.weight", "proj.bias", "embed_tokens.weight"))
    )


def test_convoys_learn_where_each_tenant_calls_next(model):
    core = core_for(model)
    s = core.scheduler
    q, k = (Q, pb.FORWARD), (K, pb.FORWARD)
    assert s.expected(1) is None  # nothing seen yet: may go anywhere
    for key in (q, k, q, k):
        s.note_call(1, key)
    assert s.expected(1) == {q}  # after k came q
    s.note_call(1, q)
    assert s.expected(1) == {k} and s.expected(2) is None  # (per tenant)
    s.lost_track(1)  # calls went by unseen (a native lane): its place is unknown
    assert s.expected(1) is None
    s.note_call(1, q)
    assert s.expected(1) == {k}
    s.note_call(1, q)  # a call split in chunks (or retried) teaches no step from q to q
    assert s.expected(1) == {k}
    others = [(f"u{i}", pb.FORWARD) for i in range(MAX_SUCCESSORS)]
    for o in others[1:]:  # q followed by as many distinct units as are kept: all of them expected
        s.note_call(1, o)
        s.note_call(1, q)
    assert s.expected(1) == {k, *others[1:]}
    s.note_call(1, others[0])  # one more: q predicts nothing, for good
    s.note_call(1, q)
    assert s.expected(1) is None
    s.note_call(1, k)
    s.note_call(1, q)
    assert s.expected(1) is None
    core.submit(call(core, 3, Q, 1, t=0.0))
    s.note_call(3, q)
    s.note_call(3, k)
    s.note_call(3, q)
    s.forget_others({2})  # 1 is gone; 3 is gone too but has a call queued: kept until it runs
    assert s.expected(3) == {k}
    s.note_call(1, k)
    assert s.expected(1) is None  # forgotten: learnt anew


def test_only_queues_in_can_grow_wait_for_company(model):
    core = core_for(model, max_wait_us=1000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    assert core.step(now=0.0001, can_grow={(Q, pb.FORWARD)}) == []  # someone is expected at q: it waits
    assert [r.call.tenant for r in core.step(now=0.0001, can_grow={(K, pb.FORWARD)})] == [1]  # expected elsewhere


def test_company_is_only_the_recent_tenants_expected_at_a_queue(model):
    """LocalServer._company: which queues may still grow, and until when, from the tenants' last
    calls and replies and where the scheduler expects them next."""
    import types

    from symbiont.base_executor.transports.local import LocalServer

    core = core_for(model, max_wait_us=1000, convoys=True)
    s = core.scheduler
    q, k = (Q, pb.FORWARD), (K, pb.FORWARD)
    server = types.SimpleNamespace(core=core)
    tenants = [types.SimpleNamespace(id=i, last_call=0.0, last_reply=0.0) for i in (1, 2, 3)]
    for t in (1, 2):
        for key in (q, k, q):
            s.note_call(t, key)
    core.submit(call(core, 1, K, 3, t=1.0))  # tenant 1 queued at k
    company = lambda now: LocalServer._company(server, tenants, [], now)  # noqa: E731
    tenants[1].last_reply = 1.0  # tenant 2 just got q's result: expected at k next
    assert company(1.0002) == ({k}, pytest.approx(1.001))
    x = ("model.layers.0.mlp", pb.FORWARD)
    s.note_call(2, x)  # it learns q -> x too: expected at k or x, and only k's queue waits for it
    s.note_call(2, q)
    assert s.expected(2) == {k, x}
    assert company(1.0002) == ({k}, pytest.approx(1.001))
    tenants[1].last_reply = 0.0
    assert company(1.0002) == (False, 0.0)  # no one recent
    tenants[2].last_call = 1.0001  # tenant 3, place unknown, called lately: any queue may grow
    assert company(1.0002) == (True, pytest.approx(1.0011))
    assert company(1.0012) == (False, 0.0)  # its window passed
    tenants[2].last_call = 0.0
    tenants[0].last_reply = 1.0001  # tenant 1, whose next call is held for its input at k, ...
    core.scheduler.drop(lambda c: True)
    tenants[0].held = (types.SimpleNamespace(unit=K, op=pb.FORWARD), 1.0001)
    core.submit(call(core, 2, K, 3, t=1.0))
    assert company(1.0002) == ({k}, pytest.approx(1.0011))  # ... is expected there, not after it
    convoys_off = core_for(model, max_wait_us=1000)  # (the default)
    server.core = convoys_off
    convoys_off.submit(call(convoys_off, 1, K, 3, t=1.0))
    tenants[1].last_reply = 1.0  # (expected elsewhere, but without convoys any recent tenant counts)
    assert company(1.0002) == (True, pytest.approx(1.001))


def test_a_set_of_growing_queues_still_runs_when_every_tenant_waits(model):
    core = core_for(model, max_wait_us=1000)
    core.submit(call(core, 1, Q, 3, t=0.0))
    core.submit(call(core, 2, K, 3, t=0.0, seed=1))
    ran = core.step(now=0.0001, can_grow={(Q, pb.FORWARD), (K, pb.FORWARD)}, attached=2)  # no one left to come
    assert len(ran) == 1


def test_may_join_with_convoys_asks_where_the_other_tenant_is_expected(model):
    """LocalServer._may_join: a recent tenant with no call in may join t's next call only where it
    is expected (or anywhere while that is unknown, or with convoys off)."""
    import time
    import types

    from symbiont.base_executor.transports.local import LocalServer

    q, k = (Q, pb.FORWARD), (K, pb.FORWARD)
    for convoys in (True, False):
        core = core_for(model, max_wait_us=10_000_000, convoys=convoys)
        server = types.SimpleNamespace(core=core)
        t, o = (types.SimpleNamespace(id=i, held=None, last_call=time.monotonic()) for i in (1, 2))
        may_join = lambda keys: LocalServer._may_join(server, o, t, keys)  # noqa: E731
        assert may_join({q}) and may_join(None)  # o's place unknown
        for key in (q, k, q):
            core.scheduler.note_call(2, key)  # o is expected at k next
        assert may_join({k}) and may_join(None)
        assert may_join({q}) is (not convoys)
        o.last_call = 0.0  # o did not call lately: it joins no one
        assert not may_join({k})


# ---- catching up: tenants whose later calls are queued ahead of their GPU --------------------


def test_a_queue_waits_for_a_tenant_behind_that_will_reach_it(model):
    """Tenant 1 is at K; tenant 2 has a call at Q, then one at K: the K queue waits while tenant
    2's Q call runs, and then tenants 1 and 2 run K in one batch."""
    core = core_for(model, max_wait_us=0, catch_up_us=1000)
    core.submit(call(core, 1, K, 1, t=0.0))
    core.submit(call(core, 2, Q, 1, t=0.0, seed=1))
    core.submit(call(core, 2, K, 1, t=0.0, seed=2))
    first = core.step(now=0.0001, can_grow=False)
    assert [(r.call.tenant, r.call.unit.id) for r in first] == [(2, Q)]
    second = core.step(now=0.0002, can_grow=False)
    assert sorted((r.call.tenant, r.call.unit.id) for r in second) == [(1, K), (2, K)]
    assert core.scheduler.pending() == 0


def test_catching_up_is_bounded_and_counts_from_when_a_call_could_run(model):
    core = core_for(model, max_wait_us=0, catch_up_us=1000)
    core.submit(call(core, 1, K, 1, t=0.0))
    core.submit(call(core, 2, Q, 1, t=0.0, seed=1))
    core.submit(call(core, 2, Q, 1, t=0.0, seed=2))
    core.submit(call(core, 2, K, 1, t=0.0, seed=3))
    core.submit(call(core, 3, K, 1, t=0.0, seed=4))  # (two tenants at K: the queue still waits for the third)
    assert [r.call.tenant for r in core.step(now=0.0001, can_grow=False)] == [2]  # Q first: K waits
    # the K queue's oldest calls could run since t=0: at 1 ms it runs without tenant 2
    ran = core.step(now=0.0011, can_grow=False)
    assert sorted((r.call.tenant, r.call.unit.id) for r in ran) == [(1, K), (3, K)]
    # tenant 2's second Q call could run only from its first's pop at 0.1 ms: it has waited 1.0 ms
    # at 1.1 ms, no one is behind it, and max_wait_us is 0: it runs; then its K alone
    assert [(r.call.tenant, r.call.unit.id) for r in core.step(now=0.0012, can_grow=False)] == [(2, Q)]
    assert [(r.call.tenant, r.call.unit.id) for r in core.step(now=0.0013, can_grow=False)] == [(2, K)]


def test_a_tenants_own_later_calls_are_not_waited_for(model):
    core = core_for(model, max_wait_us=0, catch_up_us=1000)
    core.submit(call(core, 1, K, 1, t=0.0))
    core.submit(call(core, 1, Q, 1, t=0.0, seed=1))
    core.submit(call(core, 1, K, 1, t=0.0, seed=2))
    assert [r.call.unit.id for r in core.step(now=0.0, can_grow=False)] == [K]
    assert [r.call.unit.id for r in core.step(now=0.0, can_grow=False)] == [Q]
    assert [r.call.unit.id for r in core.step(now=0.0, can_grow=False)] == [K]


def test_waits_count_from_when_a_call_became_its_tenants_oldest(model):
    """With catching up on, a call queued behind its tenant's earlier one waits its class's wait
    from that one's run (off: from its arrival, as always)."""
    core = core_for(model, max_wait_us=1000, catch_up_us=1000)
    core.submit(call(core, 1, Q, 1, t=0.0))
    core.submit(call(core, 1, K, 1, t=0.0, seed=1))
    assert [r.call.unit.id for r in core.step(now=0.0010)] == [Q]
    assert core.step(now=0.0015) == []  # K could run only from 1.0 ms
    assert core.scheduler.next_deadline() == pytest.approx(0.0020)
    assert [r.call.unit.id for r in core.step(now=0.0020)] == [K]


def test_catch_up_off_and_other_policies_never_wait_for_tenants_behind(model):
    for cfg in (dict(catch_up_us=0), dict(policy="no-lockstep")):
        core = core_for(model, max_wait_us=0, **cfg)
        core.submit(call(core, 1, K, 1, t=0.0))
        core.submit(call(core, 2, Q, 1, t=0.0, seed=1))
        core.submit(call(core, 2, K, 1, t=0.0, seed=2))
        assert {r.call.tenant for r in core.step(now=0.0001, can_grow=False)} == {1}  # (K's queue came first)


def test_a_call_waiting_on_the_gpu_is_batched_only_with_others_of_its_kind(model):
    core = core_for(model, max_wait_us=0)
    waited = []
    gpu = call(core, 1, Q, 1, t=0.0)
    gpu.before = lambda: waited.append(1)
    core.submit(gpu)
    core.submit(call(core, 2, Q, 1, t=0.0, seed=1))
    first = core.step(now=0.0, can_grow=False)
    assert [r.call.tenant for r in first] == [1] and waited == [1]
    assert [r.call.tenant for r in core.step(now=0.0, can_grow=False)] == [2]
