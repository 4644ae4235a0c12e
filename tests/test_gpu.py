"""GPU tests (marker `gpu`, skipped without CUDA): an executor on a CUDA device serving tenants on
the CPU, on its own GPU and on a peer GPU (skipped with fewer than two GPUs)."""
from __future__ import annotations

import pytest
import torch

from symbiont.base_executor.models import build_builtin
from symbiont import virtualize
from tests.conftest import running_executor
from tests.jobs import gpu_tenant_and_input
from tests.models import ARCHS, assert_backward_matches, ids, lora_grads, lora_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ARCHS)
def test_cuda_executor_cpu_tenant_parity(name):
    """fp32 GEMMs on the GPU sum in another order than on the CPU: equal to rounding, same tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor(name, "--device", "cuda:0") as ex:
        ref = build_builtin(name)
        virt = virtualize(build_builtin(name), ex.url)
        x = ids(2, 13)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        ref_l, virt_l = lora_model(name), virtualize(lora_model(name), ex.url)
        assert_backward_matches(ref_l, virt_l, x, rtol=1e-4)


def test_cuda_executor_bfloat16():
    with running_executor("tiny-llama", "--device", "cuda:0", "--dtype", "bfloat16") as ex:
        ref = build_builtin("tiny-llama", torch.bfloat16)
        virt = virtualize(build_builtin("tiny-llama", torch.bfloat16), ex.url)
        x = ids(1, 9)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits.float(), ref(x).logits.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-gemma2", "tiny-phi3"])
def test_same_gpu_tenant_parity(name):
    """Tenant on the executor's GPU: CUDA IPC mailboxes, event-ordered, same kernels as unsplit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor(name, "--device", "cuda:0") as ex:
        ref = build_builtin(name).cuda()
        virt = virtualize(build_builtin(name).cuda(), ex.url)
        x = ids(2, 13).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(x[:1], **kw), virt.generate(x[:1], **kw))
        ref_l, virt_l = lora_model(name, base=build_builtin(name).cuda()), virtualize(lora_model(name, base=build_builtin(name).cuda()), ex.url)
        assert_backward_matches(ref_l, virt_l, x, rtol=1e-5)
        big = ids(4, 200).cuda()  # forces the device mailbox to grow
        with torch.no_grad():
            torch.testing.assert_close(virt(big).logits, ref(big).logits, rtol=1e-5, atol=1e-5)
        assert "CUDA IPC" in ex.log()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_gpu_tenant_with_layer_spans(dtype):
    """`serve --layer-spans` on a GPU: a same-GPU tenant with LoRA on q, k, v and o decodes with
    one call a layer (graph replays and native lanes included) and gets the unsplit model's
    greedy tokens; its logits within float rounding (bitwise in float32 where the GEMMs' shapes
    are the unsplit model's)."""
    from peft import LoraConfig, get_peft_model

    torch.backends.cuda.matmul.allow_tf32 = False
    dt = getattr(torch, dtype)

    def make():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            return get_peft_model(build_builtin("tiny-llama", dt).cuda(), LoraConfig(
                r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    with running_executor("tiny-llama", "--device", "cuda:0", "--dtype", dtype, "--layer-spans") as ex:
        from symbiont import connect

        ref, virt = make().eval(), virtualize(make().eval(), ex.url)
        x = ids(1, 9).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5 if dtype == "float32" else 2e-2,
                                       atol=1e-5 if dtype == "float32" else 2e-2)
        with connect(ex.url) as observer:
            first = observer.stats()
            before = {u.unit: u.calls for u in first.units}
            kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
            for seed in range(3):
                x = ids(1, 9, seed=seed).cuda()
                assert torch.equal(ref.generate(input_ids=x, **kw), virt.generate(input_ids=x, **kw)), seed
            now = observer.stats()
            spans = sum(u.calls - before.get(u.unit, 0) for u in now.units if u.unit.endswith(".span"))
        assert spans == 3 * 24 * 2, spans
        # (span calls are captured and replayed as graphs by the tenant's native lane, as others)
        assert now.graph_replays - first.graph_replays > spans // 2, (now.graph_replays, first.graph_replays)


def test_same_gpu_calls_that_wait_for_their_replies():
    """The same GPU with each call waiting for its reply (return_early off): same results."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        from symbiont import connect

        conn = connect(ex.url)
        conn.transport.return_early = False
        ref = build_builtin("tiny-llama").cuda()
        virt = virtualize(build_builtin("tiny-llama").cuda(), conn)
        x = ids(2, 13).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        assert not conn.transport._unanswered.busy
        conn.close()


def test_two_same_gpu_tenants_of_one_process_wait_for_their_replies():
    """Two tenants of one process on the executor's GPU, each on a thread and stream of its own:
    while both are attached their calls wait for their replies (a call returned early could wait
    for ever behind the other's: client/transports/local.py), so none takes the native lane, which
    serves only calls that return early; both decode the unsplit model's tokens; once one detaches
    the other returns early again, and its lane serves."""
    import threading

    from symbiont import connect

    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        ref = build_builtin("tiny-llama").cuda()
        conns = [connect(ex.url, name=f"t{i}") for i in range(2)]
        try:
            virts = [virtualize(build_builtin("tiny-llama").cuda(), c) for c in conns]
            assert not any(c.transport._early() for c in conns)
            kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
            prompts = [ids(1, 9 + i, seed=i).cuda() for i in range(2)]
            want = [ref.generate(p, **kw) for p in prompts]
            got, errors = [None, None], []

            def decode(i):
                try:
                    with torch.cuda.stream(torch.cuda.Stream()):
                        for _ in range(3):
                            got[i] = virts[i].generate(prompts[i], **kw)
                        torch.cuda.current_stream().synchronize()
                except Exception as e:
                    errors.append(e)

            threads = [threading.Thread(target=decode, args=(i,), daemon=True) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), "two tenants of one process did not finish decoding"
            assert not errors, errors
            for i in range(2):
                assert torch.equal(got[i], want[i])
            assert conns[0].stats().native_calls == 0  # (the executor's count: no call of either took the lane)
            conns[1].close()
            assert conns[0].transport._early()
            assert torch.equal(virts[0].generate(prompts[0], **kw), want[0])
            assert conns[0].stats().native_calls > 0
        finally:
            for c in conns:
                c.close()


def test_native_call_path_equals_the_python_one():
    """Same GPU: a call's steps in one native call (proto._stream_ops.Lane) and the same steps from
    Python give bitwise the same logits, tokens and LoRA gradients; the native path is taken."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        from symbiont import connect

        conn = connect(ex.url)
        t = conn.transport
        x = ids(2, 13).cuda()
        virt = virtualize(build_builtin("tiny-llama").cuda(), conn)
        lora = virtualize(lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda()), conn)
        assert t._lane is not None, "the same-GPU mailbox got no native call path"
        native = []
        send = t._send
        t._send = lambda *a: native.append(1) or send(*a)
        got = {}
        for t.native_calls in (True, False):
            n = len(native)
            with torch.no_grad():
                logits = virt(x).logits
            tokens = virt.generate(x[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)
            lora.zero_grad()
            lora(input_ids=x, labels=x).loss.backward()
            got[t.native_calls] = (logits, tokens, lora_grads(lora), len(native) - n)
        assert got[True][3] > 0 and got[False][3] == 0 and got[True][2]
        assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
        for name, g in got[True][2].items():
            assert torch.equal(g, got[False][2][name]), name
        conn.close()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-phi3", "tiny-gpt2"])
def test_graph_replays_equal_eager_calls(model):
    """Same GPU: an executor that replays CUDA graphs of repeated calls and serves their repeats
    natively (the default) gives bitwise the logits, greedy tokens and LoRA gradients of one that
    serves every call from Python (--no-native-serve) and of one that runs every call eagerly
    (--graph-tokens 0), and replays most calls (MLP units' forward and backward included)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    got, stats = {}, {}
    for flags in ((), ("--no-native-serve",), ("--graph-tokens", "0")):
        with running_executor(model, "--device", "cuda:0", *flags) as ex:
            from symbiont import connect

            conn = connect(ex.url)
            x = ids(2, 13).cuda()
            virt = virtualize(build_builtin(model).cuda(), conn)
            lora = virtualize(lora_model(model, base=build_builtin(model).cuda()), conn)
            with torch.no_grad():
                logits = [virt(x).logits for _ in range(3)]
            tokens = virt.generate(x[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)
            grads = []
            for _ in range(3):
                lora.zero_grad()
                lora(input_ids=x, labels=x).loss.backward()
                grads.append(lora_grads(lora))
            conn.transport.confirm()
            got[flags], stats[flags] = (logits, tokens, grads), conn.stats()
            conn.close()
    (native, graphed, eager) = got.values()
    s = stats[()]
    assert s.graph_captures > 0 and s.graph_replays > s.calls // 2 and s.native_calls > s.calls // 4, s
    assert stats[("--no-native-serve",)].native_calls == 0 and stats[("--no-native-serve",)].graph_replays > s.calls // 2
    assert stats[("--graph-tokens", "0")].graph_replays == 0 and stats[("--graph-tokens", "0")].native_calls == 0
    assert s.calls == stats[("--graph-tokens", "0")].calls  # (native calls are counted)
    for other in (graphed, eager):
        for a, b in zip(native[0] + [native[1]], other[0] + [other[1]]):
            assert torch.equal(a, b)
        for ga, gb in zip(native[2], other[2]):
            assert ga and ga.keys() == gb.keys()
            for name in ga:
                assert torch.equal(ga[name], gb[name]), name


def test_two_placements_at_once():
    """A CPU tenant and a same-GPU tenant of one executor, concurrently, both exact."""
    import threading

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        cpu_ref, gpu_ref = build_builtin("tiny-llama"), build_builtin("tiny-llama").cuda()
        cpu_virt = virtualize(build_builtin("tiny-llama"), ex.url)
        gpu_virt = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
        errors = []

        def loop(ref, virt, device):
            try:
                for i in range(20):
                    x = ids(2, 5 + i, seed=i).to(device)
                    with torch.no_grad():
                        torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=loop, args=a) for a in ((cpu_ref, cpu_virt, "cpu"), (gpu_ref, gpu_virt, "cuda"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_same_gpu_tenant_killed_mid_call():
    _killed_mid_call("cuda:0")


def _killed_mid_call(device: str) -> None:
    """A GPU tenant SIGKILLed mid-call: the executor detaches it, frees its device mailbox (its
    process is gone) and keeps serving."""
    import os
    import subprocess
    import sys
    import time

    from symbiont import connect
    from tests.conftest import REPO

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        victim = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "jobs", "gpu_loop_job.py"), ex.url, device],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert victim.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        with connect(ex.url) as observer:
            before = observer.stats()
            assert before.tenants == 1 and before.mailbox_bytes > 0
            victim.kill()
            victim.wait()
            deadline = time.monotonic() + 10
            while (observer.stats().tenants != 0 or observer.stats().mailbox_bytes != 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            after = observer.stats()
        assert after.tenants == 0 and after.mailbox_bytes == 0
        assert "is gone" in ex.log()
        _serves_exactly(ex.url, device)  # the executor keeps serving


def test_cpu_tenant_of_gpu_executor_gets_page_locked_mailbox():
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        ref = build_builtin("tiny-llama")
        virt = virtualize(build_builtin("tiny-llama"), ex.url)
        x = ids(2, 300)  # grows the mailbox: the new one is page-locked too
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
        assert "page-locked" in ex.log()


def _serves_exactly(url: str, device: str = "cuda") -> None:
    """A new tenant on `device` gets the unsplit model's logits from the executor at `url`."""
    ref = build_builtin("tiny-llama").to(device)
    virt = virtualize(build_builtin("tiny-llama").to(device), url)
    x = ids(2, 9).to(device)
    with torch.no_grad():
        torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)


def test_stalled_input_copy_does_not_stall_other_tenants():
    """A same-GPU tenant whose input copy sits behind a long kernel: the executor holds that
    call (or queues it behind a GPU wait on the tenant's own stream) and keeps serving everyone
    else meanwhile."""
    import threading
    import time

    from symbiont import connect
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        slow, x = gpu_tenant_and_input(ex.url, unit)
        expected = connect(ex.url)
        expected.ensure_attached("cuda:0")
        want = expected.transport.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
        bystander = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
        ref = build_builtin("tiny-llama").cuda()
        probe = ids(1, 5).cuda()
        with torch.no_grad():
            want_logits = ref(probe).logits
            # (also loads the comparison's kernels: a first launch, CUDA lazy loading, synchronises
            # our GPU, which would wait behind the sleep below)
            torch.testing.assert_close(bystander(probe).logits, want_logits, rtol=1e-5, atol=1e-5)
        side = torch.cuda.Stream()
        got = {}

        def stalled():
            with torch.cuda.stream(side):
                torch.cuda._sleep(10_000_000_000)  # ~5 s of GPU time ahead of the input copy
                got["y"] = slow.transport.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
                side.synchronize()

        th = threading.Thread(target=stalled)
        th.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        with torch.no_grad():
            logits = bystander(probe).logits
        torch.cuda.current_stream().synchronize()
        served_in = time.monotonic() - t0
        stalled_still = th.is_alive()
        th.join(60)
        assert served_in < 1.0, f"the bystander waited {served_in:.2f} s behind a stalled tenant"
        assert stalled_still, f"the stalled call should still wait for its input copy (the bystander took {served_in:.2f} s)"
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["y"], want)


@pytest.mark.parametrize("served_by", ["python", "native lane"])
def test_call_taken_before_its_input_is_in_waits_on_the_gpu(served_by):
    """A lone same-GPU tenant's call whose input copy sits behind a long kernel is taken at once:
    the executor's GPU waits for the input on the tenant's own stream (the reply comes before
    the input is there), the result is still right, and another tenant arriving meanwhile is
    served at once. The call is the second of its kind (served from Python, which must not
    capture a graph on the waiting stream), or one its tenant's native lane knows (a graph
    replay queued behind the wait)."""
    import time

    from symbiont import connect
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        slow, x = gpu_tenant_and_input(ex.url, unit)
        # (returning early beside the bystander below, another tenant of this process, as a tenant
        # alone in its process would: their calls are made one at a time, on this thread. With the
        # default, the bystander waiting for its replies, the native-lane case failed once on an
        # H100, session 44 call 6; its traceback was lost to the call's time limit)
        slow.transport.return_early = True
        # once at least: the executor's first launch of a GEMM kernel loads it, which (CUDA lazy
        # loading) synchronises the executor's GPU work, and so waits for a waiting stream (README)
        for _ in range(1 if served_by == "python" else 40):
            slow.transport.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
            slow.transport.confirm()
            torch.cuda.synchronize()
            if served_by == "python" or slow.stats().native_calls:
                break
        native_before = slow.stats().native_calls
        assert (native_before > 0) == (served_by == "native lane"), native_before
        bystander_conn = connect(ex.url)
        bystander_conn.transport.return_early = True  # (as slow's: each as alone in its process)
        bystander = virtualize(build_builtin("tiny-llama").cuda(), bystander_conn)
        ref = build_builtin("tiny-llama").cuda()
        probe = ids(1, 5).cuda()
        side = torch.cuda.Stream()  # the bystander's work must not queue behind our sleep
        with torch.no_grad(), torch.cuda.stream(side):
            bystander(probe)
        torch.cuda.synchronize()
        time.sleep(0.05)  # the bystander's last call is older than the scheduler's longest wait
        t0 = time.monotonic()
        torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU time ahead of the input copy
        y = slow.transport.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
        slow.transport.confirm()  # (the call returned at once; its reply says the executor took it)
        replied_in = time.monotonic() - t0
        assert not torch.cuda.current_stream().query(), f"the sleep should still run (the reply took {replied_in:.2f} s)"
        assert (slow.stats().native_calls > native_before) == (served_by == "native lane")
        with torch.no_grad(), torch.cuda.stream(side):
            t1 = time.monotonic()
            got = bystander(probe).logits
            side.synchronize()
            served_in = time.monotonic() - t1
            want = ref(probe).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert replied_in < 1.0, f"the reply took {replied_in:.2f} s: the call was held for its input"
        assert served_in < 1.0, f"the bystander waited {served_in:.2f} s behind a waiting stream"
        expected = connect(ex.url)
        expected.ensure_attached("cuda:0")
        torch.testing.assert_close(y, expected.transport.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE))


def test_a_call_held_behind_a_queued_one_goes_back_to_its_tenants_own_stream():
    """A same-GPU tenant whose host runs ahead of its GPU, each round starting with an embedding
    call: that call waits on the executor's host for its ids (they are checked there) and is then
    queued, so the call after it is held for its input too. Once the embedding has run, the held
    call is taken on the tenant's own stream, its input in or not, and the ones after it by the
    tenant's native lane, with the same results (before, a held call found with its input in was
    queued, which held the next call, and so on: compiled tenants had 74% of their calls served
    from Python so)."""
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        conn, x = gpu_tenant_and_input(ex.url, unit)
        tr = conn.transport
        want = tr.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
        tokens = torch.randint(0, 256, (1, 1), device="cuda:0")
        table = build_builtin("tiny-llama").get_input_embeddings().weight.detach().cuda()
        tr.confirm()
        before = conn.stats().native_calls
        outs, rows = [], []
        for _ in range(8):
            torch.cuda._sleep(4_000_000)  # ~2 ms of GPU time: our host runs ahead of our GPU
            rows.append(tr.call("model.embed_tokens", pb.FORWARD, tokens, (1, 1, 64), torch.float32, pb.INFERENCE))
            outs += [tr.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE) for _ in range(10)]
        torch.cuda.synchronize()
        tr.confirm()
        native = conn.stats().native_calls - before
        for y in outs:
            torch.testing.assert_close(y, want, rtol=0, atol=0)
        for row in rows:
            assert torch.equal(row, table[tokens])
        assert native >= 40, f"only {native} of the 80 calls after an embedding were served by the native lane"


def _synchronizes_within(seconds: float) -> bool:
    """Whether torch.cuda.synchronize() returns within `seconds` (it may hang: run on a thread)."""
    import threading

    th = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    th.start()
    th.join(seconds)
    return not th.is_alive()


def test_failed_call_returns_early_and_raises_later():
    """Same GPU: a call returns before its reply. One that fails (an unknown unit) gets no result,
    so the tenant releases its GPU's wait for it itself once the earlier call's result is in:
    confirm() (or the next call) raises the failure, the earlier result is right, no
    synchronise hangs, and the calls after it work."""
    import threading
    import time

    from symbiont.errors import UnknownUnitError
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        conn, x = gpu_tenant_and_input(ex.url, unit)
        t = conn.transport

        def call(name=unit):
            return t.call(name, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)

        want = call().cpu()
        t.confirm()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the calls below are sent before their inputs are in
        y = call()
        call("no.such.unit")
        with pytest.raises(UnknownUnitError, match="no.such.unit"):
            t.confirm()
        assert _synchronizes_within(20), "our GPU still waits for the failed call's result"
        torch.testing.assert_close(y.cpu(), want)
        torch.testing.assert_close(call().cpu(), want)
        call("no.such.unit")
        time.sleep(1.0)  # its reply comes meanwhile
        with pytest.raises(UnknownUnitError, match="no.such.unit"):
            call()
        assert _synchronizes_within(20)
        failures = t._box.failures()
        call("no.such.unit")
        deadline = time.monotonic() + 20
        while t._box.failures() == failures:  # its reply is in: the next call raises it (not 16 calls later)
            assert time.monotonic() < deadline, "no failure reply counted"
            time.sleep(1e-4)
        with pytest.raises(UnknownUnitError, match="no.such.unit"):
            call()
        assert _synchronizes_within(20)
        torch.testing.assert_close(call().cpu(), want)
        t.confirm()
        torch.cuda._sleep(200_000_000)  # closing with calls in flight, one of them failed
        for name in (unit, "no.such.unit", unit, unit):
            call(name)
        closer = threading.Thread(target=conn.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() hung behind a failed call"
        assert _synchronizes_within(20)


def test_a_synchronise_inside_a_call_does_not_wait_for_ever_on_a_failed_call():
    """Same GPU: a call fails at the executor, its reply coming late (the executor holds it until
    its input is in, behind a 0.5 s kernel), and the next call synchronises inside the transport
    (here in its `take`; a lazy kernel load or an allocator's cudaFree does the same) while our
    stream waits for the failed call's result. Only the watchdog can release that wait then: it
    must not need the transport's lock, which the caller holds (session 5's review, finding #3)."""
    import threading

    from symbiont.errors import UnknownUnitError
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        conn, x = gpu_tenant_and_input(ex.url, unit)
        t = conn.transport
        want = t.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE).cpu()
        t.confirm()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s
        t.call("no.such.unit", pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)

        def take(y):
            torch.cuda.synchronize()
            return y.clone()

        got = {}
        second = threading.Thread(
            target=lambda: got.setdefault("y", t.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE, take)),
            daemon=True)
        second.start()
        second.join(30)
        assert not second.is_alive(), "a synchronise inside a call waited for ever on a failed call's release"
        torch.testing.assert_close(got["y"].cpu(), want)
        with pytest.raises(UnknownUnitError, match="no.such.unit"):
            t.confirm()
        assert _synchronizes_within(20)
        conn.close()


def test_a_call_from_a_thread_without_cuda_work():
    """The first CUDA work of a fresh thread (a server's worker, say) may be a call's native copy
    in, a driver call: it makes the device's context current itself, as the runtime would."""
    import threading

    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        conn, x = gpu_tenant_and_input(ex.url, unit)

        def call():
            return conn.transport.call(unit, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)

        want = call().cpu()
        got = {}
        worker = threading.Thread(target=lambda: got.setdefault("y", call().cpu()), daemon=True)
        worker.start()
        worker.join(60)
        torch.testing.assert_close(got["y"], want)
        conn.close()


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_compiled_generate_with_a_static_cache(mode):
    """generate() with a static cache compiles the model's forward itself: in mode
    reduce-overhead (CUDA graphs) unless told otherwise, or in mode default when asked (faster for
    a tenant: benchmarks/RESULTS.md). A graph replay would skip a call's host work, so the unit
    call is tagged cudagraph_unsafe and stays out of the graphs: the tenant's greedy tokens are the
    unsplit model's, token for token, on prompts after the first (replays)."""
    from transformers import CompileConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        ref = build_builtin("tiny-llama").cuda()
        virt = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
        asked = dict(compile_config=CompileConfig(mode=mode))
        torch._dynamo.utils.counters.clear()
        for seed in range(3):
            x = ids(1, 9, seed=seed).cuda()
            want = ref.generate(x, disable_compile=True, **kw)
            assert torch.equal(virt.generate(x, **kw, **asked), want), seed
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # (it did compile)
        assert torch.Tag.cudagraph_unsafe in torch.ops.symbiont.unit_call.default.tags


def test_calls_on_two_streams_keep_their_order():
    """Same GPU: a call made on another CUDA stream than the call before it is ordered after it
    (both use the mailbox's one input area and words): the first call's input copy sits behind
    a long kernel on its stream, the third call goes back to the default stream behind another,
    and every result is still right."""
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        unit = "model.layers.0.mlp.down_proj"
        conn, x = gpu_tenant_and_input(ex.url, unit)
        t = conn.transport

        def call(v):
            return t.call(unit, pb.FORWARD, v, (3, 64), torch.float32, pb.INFERENCE)

        x2 = 2 * x + 1
        want, want2 = call(x).cpu(), call(x2).cpu()
        first, second = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(first):
            torch.cuda._sleep(500_000_000)  # ~0.25 s ahead of the first call's input copy
            y = call(x)
        with torch.cuda.stream(second):
            y2 = call(x2)
            torch.cuda._sleep(500_000_000)  # ahead of nothing of ours: the next call must still wait for it
        y3 = call(x)  # on the default stream, whose handle is 0
        torch.cuda.synchronize()
        t.confirm()
        torch.testing.assert_close(y.cpu(), want)
        torch.testing.assert_close(y2.cpu(), want2)
        torch.testing.assert_close(y3.cpu(), want)
        conn.close()


def test_tenant_killed_while_the_gpu_waits_for_its_input():
    """The executor's stream waits for a tenant's input word when the tenant is killed: the
    executor releases the wait, detaches the tenant, frees its memory and keeps serving."""
    import os
    import subprocess
    import sys
    import time

    from symbiont import connect
    from tests.conftest import REPO

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        victim = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "jobs", "gpu_stall_job.py"), ex.url],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert victim.stdout.readline().strip() == "called"
        victim.kill()
        victim.wait()
        with connect(ex.url) as observer:
            deadline = time.monotonic() + 20
            while (observer.stats().tenants != 0 or observer.stats().mailbox_bytes != 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            after = observer.stats()
        assert after.tenants == 0 and after.mailbox_bytes == 0
        _serves_exactly(ex.url)


def test_detached_gpu_mailbox_is_parked_and_reused_by_its_process():
    """A detached same-GPU tenant's region is not freed while its process lives (it may still
    map it); the same process attaching again gets it back instead of a new one."""
    import time

    from symbiont import connect

    with running_executor("tiny-llama", "--device", "cuda:0", "--mailbox-mb", "4") as ex:
        first = connect(ex.url)
        first.ensure_attached("cuda:0")
        with connect(ex.url) as observer:
            held = observer.stats().mailbox_bytes  # its rings on the host, 4 MiB on the GPU
            first.close()
            deadline = time.monotonic() + 5  # retired, it counts whole until the data loop releases it
            while observer.stats().mailbox_bytes != 4 << 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert observer.stats().mailbox_bytes == 4 << 20  # the device region is parked, not freed
            again = connect(ex.url)
            again.ensure_attached("cuda:0")
            assert observer.stats().mailbox_bytes == held  # reused, not a second one
            again.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name,own_streams", [("tiny-llama", True), ("tiny-gpt2", True), ("tiny-llama", False)])
def test_peer_gpu_tenant_parity(name, own_streams):
    """Tenant on another GPU of the host: the executor's device mailbox mapped by CUDA IPC, peer
    copies on the tenant's streams, ordered by the mailbox's words (the native call path), also
    while the current device is the executor's GPU; or (own_streams False, the path where words
    cannot be mapped) ordered on the executor's GPU by the mailbox's events."""
    from symbiont import connect

    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor(name, "--device", "cuda:0") as ex:
        dev = torch.device("cuda:1")
        torch.cuda.set_device(dev)
        ref = build_builtin(name).to(dev)
        conn = connect(ex.url)
        t = conn.transport
        t.peer_streams = own_streams
        virt = virtualize(build_builtin(name).to(dev), conn)
        assert torch.cuda.current_device() == 1  # mapping the executor's GPU left our device alone
        assert t._order.peer == own_streams and (t._order.device == dev) == own_streams and t._lane is not None
        x = ids(2, 13).to(dev)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        want_tokens = ref.generate(x[:1], **kw)
        for current in (1, 0):  # raw stream handles are the current device's: calls must not care
            torch.cuda.set_device(current)
            with torch.no_grad():
                out = virt(x).logits
                assert out.device == dev
                torch.testing.assert_close(out, ref(x).logits, rtol=1e-5, atol=1e-5)
            assert torch.equal(want_tokens, virt.generate(x[:1], **kw))
            assert torch.cuda.current_device() == current
        torch.cuda.set_device(dev)
        ref_l, virt_l = lora_model(name, base=build_builtin(name).to(dev)), virtualize(lora_model(name, base=build_builtin(name).to(dev)), conn)
        assert_backward_matches(ref_l, virt_l, x, rtol=1e-5)
        assert "CUDA IPC" in ex.log()
        conn.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_peer_gpu_tenant_killed_mid_call():
    _killed_mid_call("cuda:1")


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_gpu_executor_mailbox_grows_mid_run(device):
    """Calls larger than the first data area: the tenant's mailbox (device or page-locked host)
    is replaced by a larger one between calls, and results stay exact."""
    from symbiont import connect
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0", "--mailbox-mb", "1") as ex:
        conn = connect(ex.url)
        conn.ensure_attached(device)
        unit = next(u for u in conn.catalog().units if u.id == "model.layers.0.mlp.down_proj")
        ref = build_builtin("tiny-llama").model.layers[0].mlp.down_proj
        for tokens in (4, 3000, 9000, 5):  # 1 MiB holds ~1300 tokens of input and output
            x = torch.randn(tokens, unit.in_features, device=device)
            y = conn.transport.call(unit.id, pb.FORWARD, x, (tokens, unit.out_features), torch.float32, pb.INFERENCE)
            assert y.device == x.device
            torch.testing.assert_close(y.cpu(), ref(x.cpu()).detach(), rtol=1e-4, atol=1e-4)
        conn.close()
        # with split_bytes below the call, the call goes in chunks of rows and the mailbox stays
        with connect(ex.url) as conn:
            conn.transport.split_bytes = 512 << 10
            conn.ensure_attached(device)
            for tokens in (9000, 5, 9000):
                x = torch.randn(3, tokens // 3, unit.in_features, device=device)
                y = conn.transport.call(unit.id, pb.FORWARD, x, (3, tokens // 3, unit.out_features), torch.float32, pb.INFERENCE)
                torch.testing.assert_close(y.cpu(), ref(x.cpu()).detach(), rtol=1e-4, atol=1e-4)
            conn.transport.confirm()
            assert conn.transport._data_bytes == 1 << 20


def test_gpu_tenant_attaching_before_any_cuda_work():
    """A process whose first CUDA work is mapping the executor's mailbox (torch has not touched
    the GPU yet): the mapping must survive torch starting up on that GPU afterwards."""
    import subprocess
    import sys

    from tests.conftest import REPO

    job = """
import sys, torch
from symbiont import connect
from symbiont.proto import executor_pb2 as pb
from symbiont.base_executor.models import build_builtin
conn = connect(sys.argv[1]); conn.ensure_attached("cuda:0")
ref = build_builtin("tiny-llama").model.layers[0].mlp.down_proj
x = torch.randn(5, ref.in_features)
y = conn.transport.call("model.layers.0.mlp.down_proj", pb.FORWARD, x.cuda(), (5, ref.out_features), torch.float32, pb.INFERENCE)
torch.testing.assert_close(y.cpu(), ref(x).detach(), rtol=1e-4, atol=1e-4)
print("exact")
"""
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        out = subprocess.run([sys.executable, "-c", job, ex.url], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "exact", out.stderr[-2000:]


def test_executor_killed_while_our_gpu_waits_for_a_result():
    """Same GPU: the executor is killed while a tenant's stream waits for a result it will never
    write. The tenant's watchdog releases the wait, so a synchronise returns, and the next call
    raises ExecutorUnavailableError. The tenant runs in its own process: its queued read of the
    dead executor's memory may fault its CUDA context, and under MPS no new CUDA process starts
    on the GPU until a faulted one exits (README); after it exits, a new executor serves.
    Under MPS a fault also reaches the other CUDA processes on the GPU, this one included, so
    this test comes last in the file."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, Executor

    ex = Executor("tiny-llama", "--device", "cuda:0")
    try:
        tenant = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "jobs", "executor_killed_job.py"), ex.url],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert tenant.stdout.readline().strip() == "called"
        ex.proc.kill()
        ex.proc.wait()
        out, _ = tenant.communicate("go\n", timeout=90)
    finally:
        ex.stop()
    assert out.split() == ["synchronized", "ExecutorUnavailableError"], out
    with running_executor("tiny-llama", "--device", "cuda:0") as again:
        _serves_exactly(again.url)


def test_same_gpu_tenant_from_the_skeleton_holds_no_unit_weights():
    """connect(url).model(device="cuda:0") of `llama-1b`: torch's allocator peaks at the non-unit
    weights and buffers while the model is built (the mailbox is the executor's allocation), and
    the model is the unsplit one (tiny-llama, logits to rounding)."""
    import json
    import os
    import subprocess
    import sys

    from symbiont import connect
    from tests.conftest import REPO

    with running_executor("llama-1b", "--device", "cuda:0", "--dtype", "bfloat16") as ex:
        out = subprocess.run(
            [sys.executable, os.path.join(REPO, "tests", "tenants", "skeleton_peak.py"), ex.url, "cuda:0"],
            capture_output=True, text=True, timeout=600, cwd=REPO,
        )
        assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"llama-1b same-GPU tenant: allocator peak {r['cuda_peak'] / 2**20:.2f} MiB while building "
          f"(non-unit weights {r['non_unit_bytes'] / 2**20:.2f} MiB, buffers {r['buffer_bytes'] / 2**20:.3f} MiB)")
    assert r["logits_finite"]
    assert r["cuda_peak"] <= r["non_unit_bytes"] + r["buffer_bytes"] + (2 << 20)

    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor("tiny-llama", "--device", "cuda:0") as ex, connect(ex.url) as conn:
        virt = conn.model(device="cuda:0", attn_implementation="eager")
        assert conn.transport.area_device == torch.device("cuda:0")  # the same-GPU plane
        ref = build_builtin("tiny-llama").cuda()
        x = ids(2, 13).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)


def test_big_calls_of_tenants_that_could_batch_run_on_their_own_streams():
    """Two same-GPU tenants whose calls could mostly be joined (a 50 ms batching wait): calls of at
    least --solo-tokens tokens are taken at once on each tenant's own stream (graph replays, the
    native lane), bitwise what they get when every call goes through the batching queues."""
    from symbiont import connect

    torch.backends.cuda.matmul.allow_tf32 = False
    x = ids(2, 160).cuda()  # 320 tokens a call
    got, stats = {}, {}
    for solo in ("256", "0"):
        with running_executor("tiny-llama", "--device", "cuda:0", "--max-wait-us", "50000", "--solo-tokens", solo,
                              "--exact") as ex:
            a, b = connect(ex.url), connect(ex.url)
            # (two tenants of one process, called one at a time on this thread: they return early as
            # each would alone in its process)
            a.transport.return_early = b.transport.return_early = True
            ma = virtualize(lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda()), a)
            mb = virtualize(build_builtin("tiny-llama").cuda(), b)
            out = []
            for _ in range(4):
                with torch.no_grad():
                    out.append(mb(x).logits)
                ma.zero_grad()
                ma(input_ids=x, labels=x).loss.backward()
                out += list(lora_grads(ma).values())
            a.transport.confirm()
            b.transport.confirm()
            got[solo], stats[solo] = out, a.stats()
            a.close()
            b.close()
    assert stats["256"].native_calls + stats["256"].graph_replays > stats["256"].calls // 2, stats["256"]
    # (with --solo-tokens 0 a lane serves only while nothing could join its tenant's calls)
    assert stats["256"].native_calls > stats["0"].native_calls, (stats["256"], stats["0"])
    for p, q in zip(got["256"], got["0"]):
        assert torch.equal(p, q)


def _run_jobs(tmp_path, url: str, mode: str, seeds: list[int], tag: str, extra: tuple = ()) -> dict:
    """tests/jobs/solo_job.py in one same-GPU tenant process per seed, meeting before their loops
    (`extra`: more of its arguments)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    meet = tmp_path / f"{tag}-barrier"
    meet.mkdir()
    job = os.path.join(REPO, "tests", "jobs", "solo_job.py")
    procs = {
        seed: subprocess.Popen(
            [sys.executable, job, "--url", url, "--mode", mode, "--n", "6" if mode == "train" else "3", "--device", "cuda:0",
             "--seed", str(seed), "--out", str(tmp_path / f"{tag}-{seed}.pt"), "--barrier", str(meet),
             "--parties", str(len(seeds)), *extra],
            cwd=REPO,
        )
        for seed in seeds
    }
    for seed, p in procs.items():
        assert p.wait(timeout=300) == 0, f"tenant {seed} failed"
    return {seed: torch.load(tmp_path / f"{tag}-{seed}.pt") for seed in seeds}


def _alone_then_together(tmp_path, url: str, mode: str, tenants: int = 4, extra: tuple = ()) -> tuple:
    """tests/jobs/solo_job.py's `mode` in each of `tenants` processes alone, one after another,
    then in all at once: (their results alone, together, the executor's stats before and after
    the together part)."""
    from symbiont import connect

    solo = {}
    for seed in range(tenants):
        solo.update(_run_jobs(tmp_path, url, mode, [seed], f"solo{seed}", extra))
    with connect(url) as conn:
        before = conn.stats()
    together = _run_jobs(tmp_path, url, mode, list(range(tenants)), "together", extra)
    with connect(url) as conn:
        return solo, together, before, conn.stats()


def test_decoding_tenants_meet_in_gpu_side_batches(tmp_path):
    """Four same-GPU tenant processes decode at once on an executor that batches their calls
    before their inputs are in (--gpu-batches, every call batched that can be: --solo-tokens 0):
    calls meet in batches, and each tenant's greedy tokens equal its run alone on the same
    executor, its logits to the rounding of GEMMs batched with the others'."""
    with running_executor("tiny-llama", "--device", "cuda:0", "--solo-tokens", "0", "--gpu-batches") as ex:
        solo, together, before, stats = _alone_then_together(tmp_path, ex.url, "generate")
    calls, batches = stats.calls - before.calls, stats.batches - before.batches
    print(f"together: {calls} calls in {batches} batches, {stats.native_calls - before.native_calls} native")
    assert stats.errors == 0
    assert calls > batches, f"{calls} calls in {batches} batches: the tenants' calls never met"
    for seed in range(4):
        for key, a in solo[seed].items():
            if key.startswith("tokens:"):
                assert torch.equal(together[seed][key], a), f"tenant {seed}: {key}"
            else:
                torch.testing.assert_close(together[seed][key], a, rtol=1e-4, atol=1e-4, msg=f"tenant {seed}: {key}")


@pytest.mark.parametrize("spans, mode", [("eager", "steps"), ("fused", "steps"), ("fused", "csteps"), ("fused-high", "steps"),
                                         ("fused-spin4", "steps"), ("fused-device-words", "steps")])
def test_step_programs_of_four_tenants_run_in_gangs(tmp_path, spans, mode):
    """Four same-GPU tenant processes decode at once with their steps replayed as CUDA graphs
    (step programs): the executor runs their programs' calls together in gangs (one GEMM per call
    over every tenant's row, transports/gangs.py), and each tenant's greedy tokens equal its run
    alone (no gang: its programs then run on its own stream) and the unsplit model's, its scores to
    the rounding of GEMMs batched with the others'; with the rounds' spans computed with the
    tenant's layer's ops, and fused (serve --gang-spans fused: runner.span_fused); and with the
    tenants' steps compiled (step_graphs="compiled"); and with the gangs' lanes at the highest stream
    priority (serve --gang-priority); and with every word wait four warps (serve --spin-warps,
    graph_words.SPIN_WARPS; one by default); and with the program words in the tenants' device
    regions (serve --device-words: the lone runs' native lane writes both output words)."""
    flags = {"fused-high": ("--gang-spans", "fused", "--gang-priority", "-5"),
             "fused-spin4": ("--gang-spans", "fused", "--spin-warps", "4"),
             "fused-device-words": ("--gang-spans", "fused", "--device-words")}.get(spans, ("--gang-spans", spans))
    extra = ("--spin-warps", "4") if spans == "fused-spin4" else ()
    with running_executor("tiny-llama", "--device", "cuda:0", *flags) as ex:
        solo, together, before, stats = _alone_then_together(tmp_path, ex.url, mode, extra=extra)
    paths = dict(stats.call_paths)
    ganged = paths.get("step program, ganged", 0) - dict(before.call_paths).get("step program, ganged", 0)
    calls, batches = stats.calls - before.calls, stats.batches - before.batches
    print(f"together: {ganged} runs in gangs, {calls} calls in {batches} batches; paths {paths}")
    assert stats.errors == 0
    assert dict(before.call_paths).get("step program, ganged", 0) == 0, "a lone tenant's runs went to a gang"
    assert ganged >= 4 * 3 * 10, f"{ganged} runs in gangs"
    assert calls > 1.5 * batches, f"{calls} calls in {batches} batches: the tenants' calls never met"
    ref = build_builtin("tiny-llama").cuda()
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    for seed in range(4):
        assert together[seed]["replays"] >= 3 * 20, together[seed]["replays"]
        for i in range(3):
            key = f"tokens:{i}"
            assert torch.equal(together[seed][key], solo[seed][key]), f"tenant {seed}: {key}"
            assert torch.equal(ref.generate(together[seed][key][:, :6].cuda(), **kw).cpu(), together[seed][key])
            torch.testing.assert_close(together[seed][f"scores:{i}"], solo[seed][f"scores:{i}"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gang_lora_kernel_adds_each_slots_adapter_on_its_rows(dtype):
    """kernels/gang_lora.py on the GPU, adapters in float32 and bfloat16 (Triton's interpreter on the
    CPU rounds to bfloat16 otherwise): tests/models.py check_gang_lora."""
    from tests.models import check_gang_lora

    check_gang_lora(torch.device("cuda:0"), dtype)


def test_hosted_adapters_of_four_tenants_run_in_gangs(tmp_path):
    """Four same-GPU tenant processes decode with step graphs, each naming its own hosted adapter
    (q, k, v, o; ranks 8 to 64): their programs share a gang, each slot's adapter computed in the
    round (kernels/gang_lora.py, inside the fused spans), and each tenant's greedy tokens equal its
    run alone (its programs on its own stream, the adapter's deltas as torch ops) and the unsplit
    PEFT model's, its scores to the rounding of GEMMs batched with the others'."""
    from tests.jobs.solo_job import hosted_lora

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        solo, together, before, stats = _alone_then_together(tmp_path, ex.url, "hsteps")
    paths = dict(stats.call_paths)
    ganged = paths.get("step program, ganged", 0) - dict(before.call_paths).get("step program, ganged", 0)
    print(f"together: {ganged} runs in gangs; paths {paths}; {stats.adapter_calls} adapter calls")
    assert stats.errors == 0
    assert dict(before.call_paths).get("step program, ganged", 0) == 0, "a lone tenant's runs went to a gang"
    assert ganged >= 4 * 3 * 10, f"{ganged} runs in gangs"
    assert stats.adapter_calls - before.adapter_calls >= ganged * 2
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    for seed in range(4):
        ref = hosted_lora(seed, build_builtin("tiny-llama").cuda()).eval()
        for i in range(3):
            key = f"tokens:{i}"
            assert torch.equal(together[seed][key], solo[seed][key]), f"tenant {seed}: {key}"
            assert torch.equal(ref.generate(together[seed][key][:, :6].cuda(), **kw).cpu(), together[seed][key])
            torch.testing.assert_close(together[seed][f"scores:{i}"], solo[seed][f"scores:{i}"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flags", [(), ("--solo-tokens", "0"), ("--solo-tokens", "0", "--gpu-batches")],
                         ids=["default", "batched", "gpu-batches"])
def test_four_fine_tuning_tenants_together_get_their_solo_adapters(tmp_path, flags):
    """S2 at K = 4 in small: four same-GPU tenant processes (built from the skeleton, LoRA ranks
    8/16/32/64) train at once on one executor (default flags; and with every call batched that
    can be: --solo-tokens 0); each one's adapter
    gradients, weights and losses equal its run alone on the same executor, to the rounding of
    GEMMs that may have been batched with the others'."""
    from symbiont import connect

    def run(url: str, seeds: list[int], tag: str) -> dict:
        return _run_jobs(tmp_path, url, "train", seeds, tag)

    with running_executor("tiny-llama", "--device", "cuda:0", *flags) as ex:
        solo = {}
        for seed in range(4):
            solo.update(run(ex.url, [seed], f"solo{seed}"))
        together = run(ex.url, list(range(4)), "together")
        with connect(ex.url) as conn:
            stats = conn.stats()
    print(f"executor: {stats.calls} calls in {stats.batches} batches, {stats.native_calls} native, "
          f"{stats.graph_replays} graph replays, {stats.errors} errors")
    assert stats.errors == 0
    for seed in range(4):
        assert solo[seed].keys() == together[seed].keys() and any(k.startswith("grad:") for k in solo[seed])
        for key, a in solo[seed].items():
            torch.testing.assert_close(together[seed][key], a, rtol=1e-4, atol=1e-5, msg=f"tenant {seed}: {key}")


def test_gpu_tenant_over_grpc_and_a_gpu_executor():
    """A tenant on a GPU attached over loopback gRPC to a GPU executor: its tensors go through the
    host both ways, and logits and adapter gradients equal the unsplit model's to rounding."""
    import socket

    from symbiont import connect

    torch.backends.cuda.matmul.allow_tf32 = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running_executor("tiny-llama", "--device", "cuda:0", "--listen", f"grpc://127.0.0.1:{port}", "--insecure"):
        url = f"grpc://127.0.0.1:{port}"
        ref = build_builtin("tiny-llama").cuda()
        virt = virtualize(build_builtin("tiny-llama").cuda(), connect(url))
        x = ids(2, 11).cuda()
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        lref = lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda())
        lvirt = virtualize(lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda()), connect(url))
        assert_backward_matches(lref, lvirt, x, rtol=1e-4)


@pytest.mark.parametrize("mode", ["blocking", "yield", "spin"])
def test_host_waits_take_in_a_fresh_process(mode):
    """set_host_waits (the S2/S3 runners' --cuda-waits) in a process whose GPU is not yet in use:
    the primary context takes the mode, and a tenant of a same-GPU executor still computes."""
    import subprocess
    import sys

    from tests.conftest import REPO

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        code = (f"from symbiont.proto.cuda_ipc import set_host_waits; set_host_waits(0, {mode!r})\n"
                "import torch\nfrom symbiont import virtualize\nfrom symbiont.base_executor.models import build_builtin\n"
                "ref = build_builtin('tiny-llama').cuda()\n"
                f"virt = virtualize(build_builtin('tiny-llama').cuda(), {ex.url!r})\n"
                "x = torch.randint(0, 100, (1, 7), device='cuda')\n"
                "with torch.no_grad():\n    torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)\n"
                "torch.cuda.synchronize(); print('ok')\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("where, early, serve", [("cuda:0", False, ()), ("cuda:0", True, ()), ("cpu", True, ()),
                                                 ("cuda:0", True, ("--ids-on-host",))])
def test_embedding_ids_out_of_range_on_a_gpu_executor(where, early, serve):
    """Ids beyond the vocabulary or negative get InvalidCallError, good ids the rows, and the
    executor serves on. A CPU tenant's ids are checked by the executor on its host; a same-GPU
    tenant's are looked up clamped on the executor's GPU and checked by its transport: at once
    for a call that waits for its reply, at confirm() for one that returns early. With
    `serve --ids-on-host` the executor refuses them itself, and the tenant's own check of that
    call is dropped with the refusal (the next calls raise nothing)."""
    from symbiont import connect
    from symbiont.errors import InvalidCallError
    from symbiont.proto import executor_pb2 as pb

    with running_executor("tiny-llama", "--device", "cuda:0", *serve) as ex, connect(ex.url) as conn:
        conn.ensure_attached(where)
        conn.transport.return_early = early
        table = build_builtin("tiny-llama").get_input_embeddings().weight.detach().to(where)
        for bad in ([[1, 256]], [[-1, 3]], [[300, -7]]):
            with pytest.raises(InvalidCallError, match=r"\[0, 256\)"):
                conn.transport.call("model.embed_tokens", pb.FORWARD, torch.tensor(bad, device=where), (1, 2, 64),
                                    torch.float32, pb.INFERENCE)
                conn.transport.confirm()
        for n in (1, 5, 300):  # (each served after the refusals, and a prefill's worth)
            x = torch.randint(0, 256, (1, n), device=where)
            y = conn.transport.call("model.embed_tokens", pb.FORWARD, x, (1, n, 64), torch.float32, pb.INFERENCE)
            conn.transport.confirm()
            torch.cuda.synchronize()
            assert torch.equal(y, table[x])


def test_a_same_gpu_tenants_bad_ids_fail_its_forward_alone():
    """A virtualized model's forward with an id beyond the vocabulary raises InvalidCallError at its
    end (the executor looked the ids up clamped), the next forward is exact, another tenant's
    decode is unaffected, and a lone tenant's embedding calls never went through the executor's
    queues (no host read of their ids)."""
    from symbiont import connect
    from symbiont.errors import InvalidCallError

    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        ref = build_builtin("tiny-llama").cuda()
        virt = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
        x = ids(1, 9).cuda()
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
            with connect(ex.url) as observer:
                paths = dict(observer.stats().call_paths)
            assert not {"queued, input in", "held, then queued"} & set(paths), paths
            bad = x.clone()
            bad[0, 3] = 256
            with pytest.raises(InvalidCallError, match=r"\[0, 256\), got \[\d+, 256\]"):
                virt(bad)
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
            other = virtualize(build_builtin("tiny-llama").cuda(), ex.url)
            torch.testing.assert_close(other.generate(x, max_new_tokens=6, do_sample=False),
                                       ref.generate(x, max_new_tokens=6, do_sample=False))


def test_same_gpu_tenant_trains_after_inference_mode():
    """A same-GPU tenant's first calls under torch.inference_mode() (its device mailbox mapped
    there), then a training step: the mailbox's views are never inference tensors."""
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        ref = lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda())
        virt = virtualize(lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda()), ex.url)
        x = ids(2, 9).cuda()
        with torch.inference_mode():
            got = virt(x).logits
        with torch.no_grad():
            torch.testing.assert_close(got, ref(x).logits, rtol=1e-4, atol=1e-4)
        assert_backward_matches(ref, virt, x, rtol=1e-4)


@pytest.mark.parametrize("dtype, graphs", [("float32", True), ("bfloat16", True), ("float32", "compiled"),
                                          ("bfloat16", "handover"), ("float32", "compiled-prefill")])
def test_step_graphs_decode_as_the_eager_tenant_does(dtype, graphs, monkeypatch):
    """A same-GPU tenant whose decoding steps replay as CUDA graphs with their calls as step
    programs (virtualize(step_graphs=True)) gives bitwise the greedy tokens and scores of the same
    tenant decoding eagerly, over three generate calls of two prompts (later calls' caches adopt the
    graph's tensors), with a LoRA on q,v, and with the LoRA turned off (PEFT's disable_adapter()); the
    tokens are the unsplit model's. Its steps replay, and the executor runs them as programs,
    natively after the first. step_graphs="compiled" (the steps captured from the forward compiled
    by torch.compile): the same tokens, the scores within float32 rounding (inductor's fused
    kernels round otherwise), no capture failing. "handover": step graphs whose calls hand over with
    two kernels each (graph_words.FUSED_HANDOVER: put and take, their system-scope fences), bitwise.
    "compiled-prefill": compiled steps whose prefills run compiled too (StepGraphs.compiled_prefill)."""
    from symbiont import connect
    from symbiont.client.transports import graph_words

    if graphs == "handover":
        monkeypatch.setattr(graph_words, "FUSED_HANDOVER", True)
        graphs = True
    prefill = graphs == "compiled-prefill"
    graphs = "compiled" if prefill else graphs
    torch.backends.cuda.matmul.allow_tf32 = False
    torch_dtype = getattr(torch, dtype)
    with running_executor("tiny-llama", "--device", "cuda:0", "--dtype", dtype) as ex:
        conn = connect(ex.url)

        def make():
            return lora_model("tiny-llama", base=build_builtin("tiny-llama", dtype=torch_dtype).cuda())

        ref = make()
        eager = virtualize(make(), conn)
        graphed = virtualize(make(), conn, step_graphs=graphs)
        steps = graphed.get_base_model().forward
        steps.compiled_prefill = prefill
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True,
                  output_scores=True, return_dict_in_generate=True)

        def same(got, want) -> bool:
            if graphs == "compiled":
                return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got.scores, want.scores))
            return all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))

        for prompt in (ids(1, 13).cuda(), ids(1, 9, seed=3).cuda(), ids(1, 13).cuda()):
            want = eager.generate(prompt, **kw)
            got = graphed.generate(prompt, **kw)
            assert torch.equal(got.sequences, want.sequences) and same(got, want)
            torch.testing.assert_close(ref.generate(prompt, **kw).sequences, got.sequences, rtol=0, atol=0)
        assert not steps.failures and steps.captures >= 1 and steps.replays >= 2 * 9, (
            steps.captures, steps.replays, steps.failures)
        prompt = ids(1, 13).cuda()
        for _ in range(2):  # (PEFT's switch is part of a step's key: a replay keeps no LoRA it turned off)
            with eager.disable_adapter(), graphed.disable_adapter():
                want, got = eager.generate(prompt, **kw), graphed.generate(prompt, **kw)
            assert torch.equal(got.sequences, want.sequences) and same(got, want)
        paths = dict(conn.stats().call_paths)
        assert paths.get("step program", 0) >= 1 and paths.get("native lane", 0) >= steps.replays - paths["step program"], paths
        conn.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_span_is_the_eager_span_to_float_rounding(dtype):
    """runner.span_fused (gangs' rounds with --gang-spans fused) on the GPU's Triton kernels: every
    piece within float rounding of _span's (the norms' sums in another order; bfloat16: a rounding
    of the norm or two carried through the MLP's GEMMs), for every span of a model, the last
    layer's (no q/k/v) among them."""
    from symbiont.base_executor import runner
    from symbiont.base_executor.catalog import SPAN, UnitTable
    from symbiont.proto import executor_pb2 as pb
    from tests.models import span_batch

    model = build_builtin("tiny-llama", dtype)
    table = UnitTable(model)
    assert table.add_spans(model) >= 2
    table.to(torch.device("cuda:0"))  # (as the executor: spans made on the host, then the units moved)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    for unit in (u for u in table.units.values() if u.kind == SPAN):
        x = span_batch(unit, 16, dtype).cuda()
        want = runner.run(unit, pb.FORWARD, x)
        got = runner.span_fused(unit, x, False, torch.empty_like(want))
        torch.testing.assert_close(got, want, **tol)


def test_step_graphs_with_a_hosted_adapter_decode_as_the_eager_tenant_does():
    """A same-GPU tenant whose adapter the executor hosts, its decoding steps replayed as CUDA
    graphs with their calls (the adapter's among them) as step programs: greedy tokens and scores
    bitwise those of the same tenant decoding eagerly, over two generate calls; the unsplit LoRA
    model's tokens."""
    from symbiont import connect

    torch.backends.cuda.matmul.allow_tf32 = False
    with running_executor("tiny-llama", "--device", "cuda:0") as ex:
        conn = connect(ex.url)
        ref = lora_model("tiny-llama", base=build_builtin("tiny-llama").cuda())
        conn.host_adapter("mine", lora_model("tiny-llama"), device="cuda:0")
        eager = virtualize(build_builtin("tiny-llama").cuda(), conn, adapter="mine")
        graphed = virtualize(build_builtin("tiny-llama").cuda(), conn, adapter="mine", step_graphs=True)
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True,
                  output_scores=True, return_dict_in_generate=True)
        for prompt in (ids(1, 13).cuda(), ids(1, 13, seed=5).cuda()):
            want = eager.generate(prompt, **kw)
            got = graphed.generate(prompt, **kw)
            assert torch.equal(got.sequences, want.sequences)
            for a, b in zip(got.scores, want.scores):
                assert torch.equal(a, b)
            assert torch.equal(ref.generate(prompt, **kw).sequences, got.sequences)
        steps = graphed.forward
        assert steps.captures == 1 and steps.replays >= 2 * 10, (steps.captures, steps.replays, steps.failures)
        conn.close()
