"""Hosted adapters (issue 21): LoRA adapters the executor holds and adds to the calls that name
them. Parity against the same adapter held privately (the unsplit PEFT model), the provider's
shared adapters, batches mixing adapters, and the registry's typed errors."""
from __future__ import annotations

import pathlib

import pytest
import torch

from symbiont import connect, virtualize
from symbiont.base_executor.catalog import UnitTable
from symbiont.base_executor.core import ExecutorCore
from symbiont.base_executor.models import build_builtin
from symbiont.base_executor.scheduler import Call, SchedulerConfig
from symbiont.client.transport import adapted_unit
from symbiont.client.errors import InvalidCallError, ResourceExhaustedError, ShapeMismatchError, UnknownUnitError
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.adapters import peft_weights
from symbiont.proto.codec import dtype_enum
from tests.conftest import running_executor
from tests.models import ids, lora_model

NAME = "tiny-llama"


def test_a_hosted_adapter_computes_what_the_private_adapter_computes(executor):
    ref = lora_model(NAME, seed=3)
    ref.eval()
    with connect(executor.url) as conn:
        info = conn.host_adapter("mine", ref)
        assert not info.shared and info.id > 0
        assert sorted(info.units) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj"))
        virt = virtualize(build_builtin(NAME), conn, adapter="mine")
        assert not any("lora" in n for n, _ in virt.named_parameters()), "the tenant's model holds no adapter code"
        x = ids(2, 11)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-6, atol=1e-6)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(virt.generate(x[:1], **kw), ref.generate(x[:1], **kw))
        stats = conn.stats()
        assert stats.hosted_adapters >= 1 and stats.adapter_bytes > 0 and stats.adapter_calls >= 2 * 9  # (a fused q/k/v call per layer and forward)
        # without the adapter the same executor serves the base model
        plain = virtualize(build_builtin(NAME), conn)
        with torch.no_grad():
            torch.testing.assert_close(plain(x).logits, build_builtin(NAME)(x).logits)
        conn.remove_adapter("mine")  # then a call naming it is refused
        with pytest.raises(InvalidCallError, match="no adapter with id"), torch.no_grad():
            virt(x)


def test_gradients_flow_through_a_hosted_adapter(executor):
    """BACKWARD adds the adapter's input-gradient term: a private adapter trained under a hosted one
    gets the gradients it gets with both held privately."""
    from peft import LoraConfig

    hosted = lora_model(NAME, seed=5)
    ref = lora_model(NAME, seed=5)
    extra = LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"], init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(7)
    ref.add_adapter("private", extra)
    ref.base_model.set_adapter(["default", "private"])
    for n, p in ref.named_parameters():
        p.requires_grad_("lora_" in n and ".private." in n)
    with connect(executor.url) as conn:
        conn.host_adapter("hosted", hosted)
        from peft import get_peft_model

        virt = virtualize(build_builtin(NAME), conn, adapter="hosted")
        torch.manual_seed(7)
        virt = get_peft_model(virt, extra, adapter_name="private")
        x = ids(2, 9)
        ref(input_ids=x, labels=x).loss.backward()
        virt(input_ids=x, labels=x).loss.backward()
        got = {n.split("base_model.model.")[-1]: p.grad for n, p in virt.named_parameters() if p.requires_grad}
        want = {n.split("base_model.model.")[-1]: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        assert got.keys() == want.keys() and got
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_the_providers_adapters_are_shared_and_a_tenants_are_its_own(tmp_path):
    shared = lora_model(NAME, seed=11)
    shared.save_pretrained(tmp_path / "support-bot")
    with running_executor(NAME, "--adapters", str(tmp_path)) as ex:
        a, b = connect(ex.url, name="a"), connect(ex.url, name="b")
        try:
            listed = a.adapters()
            assert [(i.name, i.shared) for i in listed] == [("support-bot", True)]
            virt = virtualize(build_builtin(NAME), a, adapter="support-bot")
            x = ids(1, 7)
            shared.eval()
            with torch.no_grad():
                torch.testing.assert_close(virt(x).logits, shared(x).logits, rtol=1e-6, atol=1e-6)
            b.host_adapter("b-only", lora_model(NAME, seed=12))
            assert {i.name for i in b.adapters()} == {"support-bot", "b-only"}
            assert {i.name for i in a.adapters()} == {"support-bot"}, "a tenant sees no other tenant's adapter"
            with pytest.raises(InvalidCallError, match="b-only"):
                a.adapters("b-only")
            with pytest.raises(InvalidCallError, match="provider"):
                a.remove_adapter("support-bot")
            b_id = b.adapters("b-only")[0].id
            # a call naming another tenant's adapter by its id is refused; the tenant carries on
            q = "model.layers.0.self_attn.q_proj"
            with pytest.raises(InvalidCallError, match=f"id {b_id}"):
                a.transport.call(adapted_unit(q, b_id), pb.FORWARD, torch.randn(3, 64), (3, 64), torch.float32, pb.INFERENCE)
            with torch.no_grad():
                torch.testing.assert_close(virt(x).logits, shared(x).logits, rtol=1e-6, atol=1e-6)
            b.remove_adapter("b-only")
            assert {i.name for i in b.adapters()} == {"support-bot"}
        finally:
            a.close()
            b.close()


def test_a_tenants_adapters_leave_with_it(executor):
    with connect(executor.url, name="leaver") as conn:
        conn.host_adapter("temporary", lora_model(NAME, seed=2))
    with connect(executor.url, name="next") as conn:
        with pytest.raises(InvalidCallError, match="temporary"):
            conn.adapters("temporary")
        conn.host_adapter("temporary", lora_model(NAME, seed=2))  # (the name is free again)
        with pytest.raises(InvalidCallError, match="already hosted"):
            conn.host_adapter("temporary", lora_model(NAME, seed=2))


def test_adapters_that_do_not_fit_the_base_are_refused_with_typed_errors(executor):
    with connect(executor.url) as conn:
        conn.ensure_attached()
        weights = peft_weights(lora_model(NAME).state_dict(), {"lora_alpha": 8})
        narrow = pb.AdapterWeight()
        narrow.CopyFrom(weights[0])
        narrow.a = narrow.a[: len(narrow.a) // 2]  # A of another base's width
        with pytest.raises(ShapeMismatchError, match="A must be"):
            conn.transport.control("host_adapter", pb.HostAdapterRequest(name="narrow", weights=[narrow]))
        with pytest.raises(UnknownUnitError):  # another architecture's modules
            conn.host_adapter("gpt2", lora_model("tiny-gpt2"))
        bad = pb.HostAdapterRequest(name="nowhere", weights=[pb.AdapterWeight(
            unit="model.layers.9.mlp.up_proj", rank=1, dtype=weights[0].dtype, a=weights[0].a, b=weights[0].b, scale=1.0)])
        with pytest.raises(UnknownUnitError):
            conn.transport.control("host_adapter", bad)
        emb = pb.HostAdapterRequest(name="emb", weights=[pb.AdapterWeight(
            unit="model.embed_tokens", rank=1, dtype=weights[0].dtype, a=b"", b=b"", scale=1.0)])
        with pytest.raises(InvalidCallError, match="linear"):
            conn.transport.control("host_adapter", emb)
        with pytest.raises(InvalidCallError, match="no adapter named"):
            virtualize(build_builtin(NAME), conn, adapter="never-hosted")
        with pytest.raises(ValueError, match="plain LoRA"):
            peft_weights({}, {"peft_type": "LORA", "use_dora": True})
        # after all of that the tenant carries on
        conn.host_adapter("ok", lora_model(NAME))
        virt = virtualize(build_builtin(NAME), conn, adapter="ok")
        with torch.no_grad():
            assert virt(ids(1, 5)).logits.isfinite().all()


def test_one_batch_gives_each_call_its_own_adapter():
    """The core alone: calls of four tenants batched into one GEMM: two name the provider's adapter
    (rank 4; their rows apart in the batch), one its own (rank 8), one none; forward and backward;
    each equals its call alone."""
    from symbiont.base_executor.adapters import PROVIDER

    model = build_builtin(NAME)
    core = ExecutorCore(UnitTable(model), torch.float32, torch.device("cpu"), SchedulerConfig(max_wait_us=10**9))
    unit = "model.layers.1.self_attn.v_proj"
    w = model.get_submodule(unit).weight.detach()
    hosted = {}
    for owner, r in ((PROVIDER, 4), (2, 8)):
        g = torch.Generator().manual_seed(owner + 1)
        a, b = torch.randn(r, w.shape[1], generator=g), torch.randn(w.shape[0], r, generator=g)
        weight = pb.AdapterWeight(unit=unit, rank=r, dtype=dtype_enum(torch.float32), a=a.numpy().tobytes(), b=b.numpy().tobytes(), scale=0.5)
        hosted[owner] = (core.adapters.host(owner, pb.HostAdapterRequest(name=f"a{owner}", weights=[weight])).id, a, b)
    uses = {1: PROVIDER, 2: 2, 4: PROVIDER}  # tenant -> whose adapter it names (tenant 3: none)

    def calls(op):
        out = []
        for tenant, tokens in ((1, 3), (2, 5), (3, 2), (4, 4)):
            u, in_shape, out_shape, _ = core.check(unit, op, dtype_enum(torch.float32), [tokens, w.shape[1 if op == pb.FORWARD else 0]])
            x = torch.randn(in_shape, generator=torch.Generator().manual_seed(10 + tenant))
            adapter = hosted[uses[tenant]][0] if tenant in uses else 0
            u, delta, _ = core.adapted(tenant, adapter, u)
            out.append(Call(tenant=tenant, call_id=tenant, unit=u, op=op, x=x, out_shape=out_shape, latency=pb.TRAINING,
                            arrived=0.0, adapter=delta, adapter_id=adapter))
        return out

    for op in (pb.FORWARD, pb.BACKWARD):
        for c in calls(op):
            core.submit(c)
        results = core.step(now=1e9, can_grow=False)
        assert [r.call.tenant for r in results] == [1, 2, 3, 4], "one batch of the four"
        for r in results:
            x = r.call.x
            want = x @ w.t() if op == pb.FORWARD else x @ w
            if r.call.tenant in uses:
                _, a, b = hosted[uses[r.call.tenant]]
                want = want + ((x @ a.t()) @ b.t() * 0.5 if op == pb.FORWARD else (x * 0.5) @ b @ a)
            torch.testing.assert_close(r.y, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="id"):
        core.adapted(3, hosted[2][0], core.table.get(unit))  # tenant 3 may not use tenant 2's


def test_a_grpc_tenant_hosts_and_names_its_adapter():
    from tests.test_grpc import free_port

    port = free_port()
    ref = lora_model(NAME, seed=21)
    ref.eval()
    with running_executor(NAME, "--listen", f"grpc://127.0.0.1:{port}", "--insecure") as ex:
        with connect(f"grpc://127.0.0.1:{port}") as conn:
            assert conn.host_adapter("remote-one", ref).units
            virt = virtualize(build_builtin(NAME), conn, adapter="remote-one")
            x = ids(2, 6)
            with torch.no_grad():
                torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-6, atol=1e-6)
        with connect(ex.url) as local:  # a local tenant does not see the remote tenant's adapter, gone with it anyway
            assert [a.name for a in local.adapters()] == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_same_gpu_tenant_with_a_hosted_adapter(dtype):
    """A tenant on the executor's GPU (CUDA IPC mailboxes, calls returning before their replies, its
    calls taken on its own stream): a hosted adapter gives the private adapter's logits and tokens,
    and its calls beside a plain tenant's graph replays leave those exact."""
    torch.backends.cuda.matmul.allow_tf32 = False
    flags = ("--device", "cuda:0") + (("--dtype", "bfloat16") if dtype == torch.bfloat16 else ())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with running_executor(NAME, *flags) as ex:
        ref = lora_model(NAME, seed=4, base=build_builtin(NAME, dtype).cuda())
        ref.eval()
        plain_ref = build_builtin(NAME, dtype).cuda()
        with connect(ex.url) as conn, connect(ex.url) as other:
            conn.host_adapter("gpu-one", ref, device="cuda:0")
            virt = virtualize(build_builtin(NAME, dtype).cuda(), conn, adapter="gpu-one")
            plain = virtualize(build_builtin(NAME, dtype).cuda(), other)
            x = ids(2, 13).cuda()
            with torch.no_grad():
                for _ in range(3):  # (plain calls become graph replays meanwhile)
                    torch.testing.assert_close(virt(x).logits.float(), ref(x).logits.float(), **tol)
                    torch.testing.assert_close(plain(x).logits, plain_ref(x).logits, rtol=1e-5, atol=1e-5)
            kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
            if dtype == torch.float32:
                assert torch.equal(virt.generate(x[:1], **kw), ref.generate(x[:1], **kw))
            stats = conn.stats()
            assert stats.adapter_calls > 0 and stats.graph_replays > 0
            # removed, its calls are refused, native lane or not; the other tenant carries on
            conn.remove_adapter("gpu-one")
            with pytest.raises(InvalidCallError, match="no adapter with id"):
                with torch.no_grad():
                    virt(x)
            with torch.no_grad():
                torch.testing.assert_close(plain(x).logits, plain_ref(x).logits, rtol=1e-5, atol=1e-5)


def test_a_tenant_over_its_adapter_memory_is_refused_and_carries_on():
    with running_executor(NAME, "--max-tenant-adapter-mb", "0.01") as ex:  # 10 KiB: one adapter of these, not two
        with connect(ex.url) as conn:
            assert conn.host_adapter("first", lora_model(NAME, seed=1)).bytes == 7168
            with pytest.raises(ResourceExhaustedError, match="--max-tenant-adapter-mb"):
                conn.host_adapter("second", lora_model(NAME, seed=2))
            assert [a.name for a in conn.adapters()] == ["first"]
            virt = virtualize(build_builtin(NAME), conn, adapter="first")
            with torch.no_grad():
                assert virt(ids(1, 5)).logits.isfinite().all()
        with connect(ex.url) as other:  # the limit is each tenant's own
            other.host_adapter("mine", lora_model(NAME, seed=3))


def _host_qv(core, owner, name, seed, rank=4, scale=0.5):
    """An adapter on every layer's q_proj and v_proj (members of the q,k,v group)."""
    weights, want = [], {}
    g = torch.Generator().manual_seed(seed)
    for uid, unit in core.table.units.items():
        if uid.endswith(("q_proj", "v_proj")) and unit.group:
            a = torch.randn(rank, unit.in_features, generator=g) * 0.1
            b = torch.randn(unit.out_features, rank, generator=g) * 0.1
            weights.append(pb.AdapterWeight(unit=uid, rank=rank, dtype=dtype_enum(torch.float32), a=a.numpy().tobytes(),
                                            b=b.numpy().tobytes(), scale=scale))
            want[uid] = (a, b)
    return core.adapters.host(owner, pb.HostAdapterRequest(name=name, weights=weights)), want


def test_merged_copies_serve_their_adapter_and_change_no_one_else():
    """Merged mode on the core: the merged adapter's calls at the q,k,v group (and at q_proj called
    alone) compute on its merged copy, equal to the per-call delta within float32 rounding; a
    private call and another adapter's call batched with them are bitwise what they were before the
    merge (batch-invariant mode: without it any batch's rows move with its size); the served weights
    are never written; unmerging goes back to per-call deltas."""
    model = build_builtin(NAME)
    core = ExecutorCore(UnitTable(model), torch.float32, torch.device("cpu"), SchedulerConfig(max_wait_us=10**9, exact=True))
    hot, _ = _host_qv(core, 1, "hot", seed=1)
    other, _ = _host_qv(core, 2, "other", seed=2, rank=8)
    group = next(u for u in core.table.units.values() if u.members and u.id.endswith("{q_proj,k_proj,v_proj}"))
    q = group.members[0]
    served = {uid: u.weight.clone() for uid, u in core.table.units.items() if u.weight is not None}

    def batch(unit, op, tenants):
        calls = []
        for tenant, adapter in tenants:
            width = unit.in_features if op == pb.FORWARD else unit.out_features
            x = torch.randn(3, width, generator=torch.Generator().manual_seed(tenant))
            u, delta, epoch = core.adapted(tenant, adapter, unit)
            calls.append(Call(tenant=tenant, call_id=tenant, unit=u, op=op, x=x, out_shape=(3, unit.out_features if op == pb.FORWARD else unit.in_features),
                              latency=pb.INFERENCE, arrived=0.0, adapter=delta, adapter_id=adapter, merge_epoch=epoch))
            core.submit(calls[-1])
        results = core.step(now=1e9, can_grow=False)
        assert sorted(r.call.tenant for r in results) == sorted(t for t, _ in tenants)
        return {r.call.tenant: r.y.clone() for r in results}

    tenants = [(1, hot.id), (2, other.id), (3, 0)]
    before = {(u.id, op): batch(u, op, tenants) for u in (group, q) for op in (pb.FORWARD, pb.BACKWARD)}
    merged = core.adapters.merge(hot.id)
    assert merged.nbytes == sum(u.weight.numel() * 4 for u in core.table.units.values() if u.members and "q_proj" in u.id and u.kind == "linear")
    assert core.adapted(1, hot.id, group)[2] == merged.epoch and core.adapted(1, hot.id, q)[1] is None
    for (uid, op), want in before.items():
        got = batch(core.table.get(uid), op, tenants)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # the merged copy
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])  # everyone else: bitwise
    assert all(torch.equal(core.table.get(uid).weight, w) for uid, w in served.items())
    core.adapters.unmerge()
    assert core.adapted(1, hot.id, group)[2] == 0
    for (uid, op), want in before.items():
        got = batch(core.table.get(uid), op, tenants)
        assert all(torch.equal(got[t], want[t]) for t in (1, 2, 3))
    core.adapters.merge(hot.id)
    core.adapters.remove(1, "hot")  # a merged adapter removed is unmerged with it
    assert core.adapters.merged is None


def test_the_orchestrator_merges_a_dominant_adapter_and_lets_it_go():
    from symbiont.base_executor.adapters import MergeOrchestrator

    o = MergeOrchestrator(share=0.5, window_s=1.0, min_tokens=100)
    fits = lambda a: a != 9  # noqa: E731 - adapter 9's copies would not fit
    assert not o.due(0.0) and not o.due(0.5) and o.due(1.0)
    for adapter, n in ((1, 70), (2, 20), (3, 10)):
        o.note(adapter, n)
    assert o.decide(1.0, merged_id=0, fits=fits) == 1  # 70% of the adapted tokens
    o.note(1, 40), o.note(2, 30), o.note(3, 30)
    assert o.decide(2.0, merged_id=1, fits=fits) is None  # 40%: above half the threshold, it stays
    o.note(1, 20), o.note(2, 80)
    assert o.decide(3.0, merged_id=1, fits=fits) == 2  # another took over
    o.note(2, 10), o.note(3, 90)
    assert o.decide(4.0, merged_id=2, fits=fits) == 3
    o.note(3, 20), o.note(1, 40), o.note(2, 40)
    assert o.decide(5.0, merged_id=3, fits=fits) == 0  # no one dominates: unmerge
    o.note(9, 100)
    assert o.decide(6.0, merged_id=0, fits=fits) is None  # too big to merge
    o.note(1, 60)
    assert o.decide(7.0, merged_id=0, fits=fits) is None  # too few tokens to judge
    with pytest.raises(ValueError, match="share"):
        MergeOrchestrator(share=0)


def test_serve_merge_auto_merges_the_busy_adapter_and_no_one_else_moves():
    """A real executor with `--merge auto`: while one tenant's hosted adapter carries all the adapted
    traffic it is merged (stats say so) and its logits stay within float32 rounding of the private
    PEFT model's; a tenant with a private adapter gets bitwise the logits it got before the merge;
    when the adapter's traffic stops it is unmerged."""
    import time

    ref = lora_model(NAME, seed=3).eval()
    x = ids(2, 11)
    with running_executor(NAME, "--merge", "auto", "--merge-window-s", "0.3") as ex, connect(ex.url) as conn:
        private = virtualize(lora_model(NAME, seed=4), conn)
        with torch.no_grad():
            before = private(x).logits
        conn.host_adapter("hot", ref)
        hot = virtualize(build_builtin(NAME), conn, adapter="hot")
        deadline = time.monotonic() + 30
        with torch.no_grad():
            while conn.stats().merged_adapter != "hot":
                assert time.monotonic() < deadline, f"never merged: {conn.stats()}"
                hot(x)
            torch.testing.assert_close(hot(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
            assert torch.equal(private(x).logits, before)
        s = conn.stats()
        assert s.merge_switches >= 1 and s.merged_bytes > 0 and s.merged_tokens > 0
        while conn.stats().merged_adapter:  # only private calls now: nothing to merge
            assert time.monotonic() < deadline + 30, f"never unmerged: {conn.stats()}"
            with torch.no_grad():
                private(x)
            time.sleep(0.05)
        with torch.no_grad():
            torch.testing.assert_close(hot(x).logits, ref(x).logits, rtol=1e-6, atol=1e-6)


def test_the_provider_adds_lists_and_removes_shared_adapters_while_serving(tmp_path):
    """`base-executor adapters add|list|remove` against a running executor: a tenant names the
    added adapter and gets the PEFT model's logits; removed, its calls are refused; a request with
    a wrong provider token is refused and the executor serves on."""
    from symbiont.base_executor.provider import request
    from symbiont.proto import urls
    from tests.test_cli import cli

    shared = lora_model(NAME, seed=21).eval()
    shared.save_pretrained(tmp_path / "helpdesk")
    with running_executor(NAME) as ex:
        out = cli("adapters", "add", "helpdesk", str(tmp_path / "helpdesk"), "--url", ex.url)
        assert out.returncode == 0 and "hosted 'helpdesk'" in out.stdout, out.stderr
        with connect(ex.url) as conn:
            conn.host_adapter("own", lora_model(NAME, seed=22))
            listed = cli("adapters", "list", "--url", ex.url).stdout
            assert "helpdesk" in listed and "provider" in listed and "own" in listed, listed
            virt = virtualize(build_builtin(NAME), conn, adapter="helpdesk")
            x = ids(1, 6)
            with torch.no_grad():
                torch.testing.assert_close(virt(x).logits, shared(x).logits, rtol=1e-6, atol=1e-6)
            bad = pb.ControlRequest(tenant_id=0, token="0" * 32, remove_adapter=pb.RemoveAdapterRequest(name="helpdesk"))
            with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
                request(ex.url, bad)
            assert cli("adapters", "remove", "nope", "--url", ex.url).returncode == 2
            assert cli("adapters", "remove", "helpdesk", "--url", ex.url).returncode == 0
            with pytest.raises(InvalidCallError, match="adapter"), torch.no_grad():
                virt(x)
            with torch.no_grad():  # the tenant carries on without it
                assert virtualize(build_builtin(NAME), conn, adapter="own")(x).logits.isfinite().all()
        token = pathlib.Path(urls.provider_token_path(ex.url.split("//")[1]))
        assert token.exists() and token.stat().st_mode & 0o777 == 0o600
    assert not token.exists(), "the executor removes its provider token when it stops"


def test_paged_adapters_compute_the_same_and_stay_within_the_pool():
    """The registry with a pool that holds one adapter: calls naming three adapters in turn page
    them in (misses), the least recently used go out between batches (never below the budget's
    worth of work lost), and every call computes bitwise what the unpaged registry computes."""
    model = build_builtin(NAME)
    table = UnitTable(model)
    plain = ExecutorCore(table, torch.float32, torch.device("cpu"), SchedulerConfig())
    paged = ExecutorCore(table, torch.float32, torch.device("cpu"), SchedulerConfig())
    hosted = [_host_qv(plain, 1, f"a{i}", seed=i)[0] for i in range(3)]
    paged.adapters.pool_bytes = hosted[0].nbytes  # one adapter's worth
    for i in range(3):
        _host_qv(paged, 1, f"a{i}", seed=i)
    assert paged.adapters.resident_bytes() == 0 and paged.adapters.bytes() == 3 * hosted[0].nbytes
    group = next(u for u in table.units.values() if u.members and u.id.endswith("{q_proj,k_proj,v_proj}"))
    x = torch.randn(4, group.in_features, generator=torch.Generator().manual_seed(0))
    for turn in (0, 1, 0, 2, 2, 1):
        want = torch.mm(x, group.weight.t())
        plain.adapters.delta(1, hosted[turn].id, group).add_to(pb.FORWARD, x, want)
        got = torch.mm(x, group.weight.t())
        paged.adapters.delta(1, hosted[turn].id, group).add_to(pb.FORWARD, x, got)
        assert torch.equal(got, want)
        if paged.adapters.over_budget():
            evicted = paged.adapters.evict()
            assert evicted and all(a.id != hosted[turn].id for a in evicted), "the one just used stays"
        assert paged.adapters.resident_bytes() <= paged.adapters.pool_bytes
    r = paged.adapters
    assert (r.hits, r.misses, r.evictions) == (1, 5, 4)
    r.prefetch(r.get(hosted[0].id))  # a tenant's model names it: paged in ahead, not counted as a call
    assert (r.hits, r.misses) == (1, 5) and r.get(hosted[0].id).resident is not None


def test_serve_pages_hosted_adapters_through_a_small_pool():
    """A real executor whose pool holds one adapter, two tenants with hosted adapters taking turns:
    each gets its PEFT model's logits every time; the stats show misses, evictions and the pool."""
    refs = [lora_model(NAME, seed=s).eval() for s in (31, 32)]
    x = ids(1, 9)
    with running_executor(NAME, "--adapter-pool-mb", "0.012") as ex:
        conns = [connect(ex.url, name=f"t{i}") for i in range(2)]
        try:
            virts = []
            for i, (conn, ref) in enumerate(zip(conns, refs)):
                conn.host_adapter(f"mine{i}", ref)
                virts.append(virtualize(build_builtin(NAME), conn, adapter=f"mine{i}"))
            with torch.no_grad():
                for _ in range(3):
                    for virt, ref in zip(virts, refs):
                        torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-6, atol=1e-6)
            s = conns[0].stats()
            # (how many turns find the other's adapter paged out depends on when the data loop evicts)
            assert s.adapter_misses >= 2 and s.adapter_evictions >= 1 and s.adapter_hits > 0, s
            assert s.adapter_resident_bytes <= s.adapter_bytes
        finally:
            for c in conns:
                c.close()


@pytest.mark.gpu
def test_same_gpu_tenants_with_merged_and_paged_adapters():
    """On the GPU (graphs, native lanes, GPU input waits): with a pool that holds one adapter and
    `--merge auto`, two same-GPU tenants taking turns, one of them generating much more, get their
    PEFT models' logits and greedy tokens throughout (merged, paged in, evicted, unmerged), and a
    plain tenant's logits stay bitwise the unsplit model's."""
    import time

    torch.backends.cuda.matmul.allow_tf32 = False
    refs = [lora_model(NAME, seed=s, base=build_builtin(NAME).cuda()).eval() for s in (41, 42)]
    plain_ref = build_builtin(NAME).cuda()
    x = ids(1, 9).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with running_executor(NAME, "--device", "cuda:0", "--adapter-pool-mb", "0.012", "--merge", "auto",
                          "--merge-window-s", "0.3") as ex:
        conns = [connect(ex.url, name=f"t{i}") for i in range(3)]
        try:
            virts = []
            for i, ref in enumerate(refs):
                conns[i].host_adapter(f"gpu{i}", ref, device="cuda:0")
                virts.append(virtualize(build_builtin(NAME).cuda(), conns[i], adapter=f"gpu{i}"))
            plain = virtualize(build_builtin(NAME).cuda(), conns[2])
            want = [ref.generate(x, **kw) for ref in refs]
            deadline = time.monotonic() + 60
            with torch.no_grad():
                while time.monotonic() < deadline and not conns[0].stats().merge_switches:
                    assert torch.equal(virts[0].generate(x, **kw), want[0])
                for _ in range(3):
                    for virt, ref, w in zip(virts, refs, want):
                        torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
                        assert torch.equal(virt.generate(x, **kw), w)
                    assert torch.equal(plain(x).logits, plain_ref(x).logits)
            s = conns[0].stats()
            assert s.merge_switches >= 1 and s.adapter_misses >= 2 and s.graph_replays > 0, s
        finally:
            for c in conns:
                c.close()


def test_the_adapter_packing_example_packs_tasks_within_their_targets():
    """examples/adapter_packing.py end to end (its own executor): every adapter it keeps holds tasks
    that meet their target, fewer adapters than tasks when two tasks fit one, and each packed adapter
    hosted by the executor scores its tasks exactly as it did held privately."""
    import re
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "examples/adapter_packing.py", "--tasks", "3", "--steps", "200", "--targets", "0.8"],
                         capture_output=True, text=True, timeout=600, cwd=repo)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout
    private = re.findall(r"^  (adapter\d+): tasks \[([\d, ]+)\], accuracy ([\d., ]+)", text, re.M)
    hosted = re.findall(r"^  packed-(adapter\d+): tasks \[([\d, ]+)\], accuracy ([\d., ]+)", text, re.M)
    assert private and private == hosted, text
    assert sorted(int(t) for _, tasks, _ in private for t in tasks.split(",")) == [0, 1, 2]
    assert all(float(s) >= 0.8 for _, _, scores in private for s in scores.split(",")), text
    assert len(private) < 3, f"at target 0.8 a rank-4 adapter holds two of these tasks:\n{text}"


@pytest.mark.parametrize("targets", [["gate_proj"], ["up_proj"], ["down_proj"]])
def test_a_hosted_adapter_of_an_mlp_part_is_computed(executor, targets):
    """A hosted adapter on a part of a gated MLP (gate or up: members of the block's fused group,
    or down) makes the block call its Linears, each with the adapter where it has one: the private
    adapter's logits (a gate/up adapter was once dropped by the whole-block call)."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        ref = get_peft_model(build_builtin(NAME), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                                                             target_modules=targets)).eval()
    with connect(executor.url) as conn:
        conn.host_adapter("mlp-part", ref)
        virt = virtualize(build_builtin(NAME), conn, adapter="mlp-part")
        x = ids(2, 11)
        with torch.no_grad():
            got, want, base = virt(x).logits, ref(x).logits, build_builtin(NAME)(x).logits
        assert (want - base).abs().max() > 1e-3  # (the adapter changes the logits: the test can see it dropped)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_span_calls_of_three_tenants_batch_with_each_its_own_adapter():
    """The core alone: layer spans (proto/layer_span.py) of three tenants in one batch, two naming
    adapters of their own on q and v (the span adds them at the next layer's q/k/v), one none: each
    equals its call run alone. An adapter of the MLP inside a span is refused with a typed error."""
    model = build_builtin(NAME)
    table = UnitTable(model)
    assert table.add_spans(model) == 2
    core = ExecutorCore(table, torch.float32, torch.device("cpu"), SchedulerConfig(max_wait_us=10**9))
    (a1, _), (a2, _) = _host_qv(core, 1, "one", seed=1), _host_qv(core, 2, "two", seed=2)
    span = "model.layers.0.span"

    def call(tenant, adapter, tokens):
        u, in_shape, out_shape, _ = core.check(span, pb.FORWARD, dtype_enum(torch.float32), [tokens, table.get(span).in_features])
        u, delta, _ = core.adapted(tenant, adapter, u)
        x = torch.randn(in_shape, generator=torch.Generator().manual_seed(10 + tenant))
        return Call(tenant=tenant, call_id=tenant, unit=u, op=pb.FORWARD, x=x, out_shape=out_shape, latency=pb.INFERENCE,
                    arrived=0.0, adapter=delta, adapter_id=adapter)

    made = [(1, a1.id, 3), (2, a2.id, 2), (3, 0, 4)]
    alone = {}
    for tenant, adapter, tokens in made:
        core.submit(call(tenant, adapter, tokens))
        (r,) = core.step(now=1e9, can_grow=False)
        alone[tenant] = r.y.clone()
    for tenant, adapter, tokens in made:
        core.submit(call(tenant, adapter, tokens))
    results = core.step(now=1e9, can_grow=False)
    assert [r.call.tenant for r in results] == [1, 2, 3], "one batch of the three"
    for r in results:
        torch.testing.assert_close(r.y, alone[r.call.tenant], rtol=1e-5, atol=1e-5)
    core.submit(call(1, 0, 3))  # (tenant 1's call without its adapter: the adapter must show)
    (plain,) = core.step(now=1e9, can_grow=False)
    assert not torch.allclose(plain.y, alone[1])
    up = "model.layers.0.mlp.up_proj"
    g = torch.Generator().manual_seed(7)
    weight = pb.AdapterWeight(unit=up, rank=2, dtype=dtype_enum(torch.float32), scale=1.0,
                              a=torch.randn(2, table.get(up).in_features, generator=g).numpy().tobytes(),
                              b=torch.randn(table.get(up).out_features, 2, generator=g).numpy().tobytes())
    mlp = core.adapters.host(1, pb.HostAdapterRequest(name="mlp", weights=[weight]))
    with pytest.raises(Exception, match="adapts the MLP inside span"):
        core.adapted(1, mlp.id, table.get(span))


def _host_on(core, owner, name, seed, rank, targets=("q_proj", "v_proj", "o_proj"), scale=0.5):
    """An adapter of `rank` on every layer's `targets`."""
    weights = []
    g = torch.Generator().manual_seed(seed)
    for uid, unit in core.table.units.items():
        if uid.endswith(targets) and not unit.members:
            weights.append(pb.AdapterWeight(
                unit=uid, rank=rank, dtype=dtype_enum(torch.float32), scale=scale,
                a=(torch.randn(rank, unit.in_features, generator=g) * 0.1).numpy().tobytes(),
                b=(torch.randn(unit.out_features, rank, generator=g) * 0.1).numpy().tobytes()))
    return core.adapters.host(owner, pb.HostAdapterRequest(name=name, weights=weights))


def test_a_gang_rounds_hosted_adapters_are_each_slots_own():
    """Hosted adapters in a gang's round (transports/gangs.py, kernels/gang_lora.py in Triton's
    interpreter): three slots of two rows each, two naming adapters of different ranks (one above
    a kernel's rank block), one sitting the round out: at a layer span (eager and fused) and at the
    first layer's q/k/v group, each taking-part slot's rows get its own adapter, within float32
    rounding of the per-call deltas (core.RowSpanDeltas, adapters.Delta.add_to), and the rows of the
    slot sitting out are left as the unit computes them."""
    from symbiont.base_executor import runner
    from symbiont.base_executor.adapters import MAX_RANK
    from symbiont.base_executor.core import RowSpanDeltas
    from symbiont.base_executor.kernels import gang_lora
    from symbiont.base_executor.transports.gangs import _SlotDeltas, adapter_parts, gang_key
    from tests.models import span_batch

    model = build_builtin(NAME)
    table = UnitTable(model)
    assert table.add_spans(model) == 2
    core = ExecutorCore(table, torch.float32, torch.device("cpu"), SchedulerConfig())
    adapters = [_host_on(core, 1, "low", seed=1, rank=3), _host_on(core, 2, "high", seed=2, rank=21)]
    rows, seqs = 2, torch.tensor([1, 0, 5], dtype=torch.int32)  # (slot 1 sits out)
    group = next(u for u in table.units.values() if u.members and u.id.startswith("model.layers.0.") and "q_proj" in u.id)
    span = table.get("model.layers.0.span")
    tol = dict(rtol=1e-5, atol=1e-5)
    for unit in (span, group):
        deltas = [core.adapters.delta(a.owner, a.id, unit) for a in adapters]
        calls = [Call(tenant=s, call_id=s, unit=unit, op=pb.FORWARD, x=torch.zeros(rows, unit.in_features), out_shape=[],
                      latency=pb.INFERENCE, arrived=0.0, adapter=d, adapter_id=1) for s, d in enumerate(deltas)]
        parts = [adapter_parts(c) for c in calls]
        assert [p[:5] for p in parts[0]] == [p[:5] for p in parts[1]] and parts[0], "the two adapters' deltas sit alike"
        entries = [[v for p in ps for v in gang_lora.entry(p[5].a, p[5].b, p[5].scale)] for ps in parts]
        ad_table = torch.tensor([entries[0], entries[1], entries[1]], dtype=torch.int64)  # (slot 1's is not read: it sits out)
        hooks = _SlotDeltas([p[:5] for p in parts[0]], 0, ad_table, seqs, rows, torch.zeros(3 * rows, gang_lora.MAX_PARTS * MAX_RANK))
        row_deltas = [(0, rows, deltas[0]), (2 * rows, 3 * rows, deltas[1])]
        if unit is span:
            x = span_batch(unit, 3 * rows, torch.float32)
            plain = runner.run(unit, pb.FORWARD, x)
            want = runner.run(unit, pb.FORWARD, x, False, None, RowSpanDeltas(row_deltas))
            got = runner.run(unit, pb.FORWARD, x, False, None, hooks)
            fused = runner.span_fused(unit, x, False, torch.empty_like(want), hooks)
            torch.testing.assert_close(fused, want, **tol)
        else:
            x = torch.randn(3 * rows, unit.in_features, generator=torch.Generator().manual_seed(3))
            plain = runner.run(unit, pb.FORWARD, x)
            want = plain.clone()
            for first, end, d in row_deltas:
                d.add_to(pb.FORWARD, x[first:end], want[first:end])
            got = plain.clone()
            hooks.add("y", x, got)
        torch.testing.assert_close(got, want, **tol)
        assert torch.equal(got[rows:2 * rows], plain[rows:2 * rows]), "the slot sitting out got a delta"
        assert not torch.allclose(got[:rows], plain[:rows]) and not torch.allclose(got[2 * rows:], plain[2 * rows:])
    private = Call(tenant=3, call_id=3, unit=span, op=pb.FORWARD, x=torch.zeros(rows, span.in_features), out_shape=[],
                   latency=pb.INFERENCE, arrived=0.0, adapter=None, adapter_id=0)
    hosted = Call(tenant=1, call_id=1, unit=span, op=pb.FORWARD, x=torch.zeros(rows, span.in_features), out_shape=[],
                  latency=pb.INFERENCE, arrived=0.0, adapter=core.adapters.delta(1, adapters[0].id, span), adapter_id=1)
    for c in (private, hosted):
        c.out = torch.zeros(rows, span.out_features)
    assert gang_key([private]) != gang_key([hosted]) and None not in (gang_key([private]), gang_key([hosted]))
    keys = set()
    for targets in (("q_proj", "v_proj", "o_proj"), ("q_proj", "v_proj"), ("o_proj",), ("k_proj", "o_proj")):
        other = _host_on(core, 1, "-".join(targets), seed=4, rank=5, targets=targets)
        hosted.adapter = core.adapters.delta(1, other.id, span)
        keys.add(gang_key([hosted]))
    assert len(keys) == 4 and gang_key([hosted]) is not None, "adapters of other modules share a gang's key"
    hosted.op = pb.BACKWARD
    assert adapter_parts(hosted) is None and gang_key([hosted]) is None


def test_a_gang_lora_kernel_adds_each_slots_adapter_on_its_rows():
    """kernels/gang_lora.py in Triton's interpreter (float32; tests/test_gpu.py: bfloat16 too): each
    taking-part slot's rows get Delta.add_to's term, everything else in y is left (check_gang_lora)."""
    from tests.models import check_gang_lora

    check_gang_lora(torch.device("cpu"), torch.float32)
