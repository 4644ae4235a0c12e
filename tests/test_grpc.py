"""Tenants over gRPC (grpc://HOST:PORT), over loopback with a real executor process: exactness as
a local tenant's, both listeners on one executor, mutual TLS with per-tenant credentials, and
every refusal typed while the other tenants carry on."""
from __future__ import annotations

import datetime
import os
import pathlib
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch

from symbiont import connect, virtualize
from symbiont.base_executor import certs
from symbiont.base_executor.models import build_builtin
from symbiont.errors import (
    AuthenticationError,
    ExecutorUnavailableError,
    InvalidCallError,
    NotAttachedError,
    ResourceExhaustedError,
    ShapeMismatchError,
)
from symbiont.proto import executor_pb2 as pb
from tests.conftest import REPO, running_executor
from tests.models import assert_backward_matches, ids, lora_model


def free_port() -> int:
    return free_ports(1)


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (a sharded executor's rank r listens on PORT + r),
    below Linux's ephemeral range, so no other process's outgoing connection takes one of them
    between this look and the executor's bind (CI, 2026-11-27: rank 1's port was taken)."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        try:
            held = []
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> pathlib.Path:
    """A provider's folder: CA, server certificate for 127.0.0.1, tenants alice and bob."""
    d = tmp_path_factory.mktemp("tls")
    ca = certs.make_ca(d)
    certs.make_server(d, ca, ["localhost", "127.0.0.1"])
    for name in ("alice", "bob"):
        certs.make_tenant(d, ca, name)
    return d


@pytest.fixture(scope="module")
def insecure():
    """An executor serving local:// and insecure grpc:// at once (no credentials asked)."""
    port = free_port()
    with running_executor("tiny-llama", "--listen", f"grpc://127.0.0.1:{port}", "--insecure") as ex:
        ex.grpc = f"grpc://127.0.0.1:{port}"
        yield ex


@pytest.fixture(scope="module")
def secure(tls):
    port = free_port()
    with running_executor("tiny-llama", "--listen", f"grpc://127.0.0.1:{port}", "--tls-dir", str(tls)) as ex:
        ex.grpc = f"grpc://127.0.0.1:{port}"
        yield ex


def test_grpc_tenant_is_exact_beside_a_local_tenant(insecure):
    """Logits bitwise, greedy tokens equal, adapter gradients within 1e-5: as a local:// tenant
    gets, while one is attached over local:// at the same time."""
    with connect(insecure.url) as observer:
        before = observer.stats()
    ref = build_builtin("tiny-llama")
    remote = virtualize(build_builtin("tiny-llama"), connect(insecure.grpc))
    local = virtualize(build_builtin("tiny-llama"), insecure.url)
    x = ids(2, 13)
    with torch.no_grad():
        want = ref(x).logits
        assert torch.equal(remote(x).logits, want)
        assert torch.equal(local(x).logits, want)
    prompt = ids(1, 5, seed=3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(remote.generate(prompt, **kw), ref.generate(prompt, **kw))
    lref, lrem = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), connect(insecure.grpc))
    assert_backward_matches(lref, lrem, x)
    with connect(insecure.url) as observer:
        s = observer.stats()
        placements = sorted(t.placement for t in s.tenant_stats)
    assert placements.count("remote") == 2 and "cpu" in placements
    # how the calls made meanwhile were taken: the remote tenants' as remote, the local one's from its host mailbox
    earlier = {t.tenant_id: t.calls for t in before.tenant_stats}
    made = {p: sum(t.calls - earlier.get(t.tenant_id, 0) for t in s.tenant_stats if t.placement == p) for p in ("remote", "cpu")}
    assert s.call_paths["remote"] - before.call_paths.get("remote", 0) == made["remote"] > 0, (before, s)
    assert s.call_paths["host mailbox"] - before.call_paths.get("host mailbox", 0) == made["cpu"] > 0, (before, s)


def test_large_calls_travel_in_chunks(insecure):
    """An input and a result of ~5 MB each cross in several messages (4 MiB chunks) and are exact."""
    unit = build_builtin("tiny-llama").model.layers[0].mlp.down_proj
    with connect(insecure.grpc) as conn:
        conn.ensure_attached()
        x = torch.randn(20000, unit.in_features)
        assert x.numel() * 4 > 4 << 20
        y = conn.transport.call("model.layers.0.mlp.down_proj", pb.FORWARD, x, (20000, unit.out_features), torch.float32, pb.TRAINING)
        torch.testing.assert_close(y, x @ unit.weight.T, rtol=1e-5, atol=1e-5)


def test_bad_calls_get_typed_errors_and_the_stream_goes_on(insecure):
    with connect(insecure.grpc) as conn:
        conn.ensure_attached()
        t = conn.transport
        with pytest.raises(ShapeMismatchError):
            t.call("model.layers.0.mlp.down_proj", pb.FORWARD, torch.randn(3, 7), (3, 7), torch.float32, pb.TRAINING)
        with pytest.raises(InvalidCallError):
            t.call("no.such.unit", pb.FORWARD, torch.randn(3, 7), (3, 7), torch.float32, pb.TRAINING)
        # a payload that does not match its header, and bytes that are no CallRequest, on the raw stream
        d = build_builtin("tiny-llama").config.hidden_size
        bad = pb.CallRequest(call_id=99, unit="model.layers.0.self_attn.o_proj", op=pb.FORWARD, dtype=pb.FLOAT32,
                             shape=[2, d], payload=b"\0" * 12)
        t._requests.put(bad.SerializeToString())
        reply = pb.CallReply.FromString(next(t._replies))
        assert reply.call_id == 99 and reply.status.code == pb.INVALID_ARGUMENT and "payload" in reply.status.message
        t._requests.put(b"\xff\xff\xff garbage")
        assert pb.CallReply.FromString(next(t._replies)).status.code == pb.MALFORMED
        x = torch.randn(2, d)
        y = t.call("model.layers.0.self_attn.o_proj", pb.FORWARD, x, (2, d), torch.float32, pb.TRAINING)
        assert y.shape == (2, d)


def test_malformed_control_bytes_and_another_tenants_session(insecure):
    with grpc.insecure_channel(insecure.grpc.split("//")[1]) as ch:
        raw = ch.unary_unary("/symbiont.Executor/Control")
        reply = pb.ControlReply.FromString(raw(b"\xff\xff\xff garbage", timeout=10))
        assert reply.status.code == pb.MALFORMED
    with connect(insecure.grpc) as a, connect(insecure.grpc) as b:
        a.ensure_attached()
        b.ensure_attached()
        b.transport.token = a.transport.token  # b claims a's session with its own id: refused
        with pytest.raises(NotAttachedError):
            b.transport.control("detach", pb.DetachRequest())
        b.transport.tenant_id, b.transport.token = a.transport.tenant_id, "0" * 32
        with pytest.raises(NotAttachedError):
            b.transport.control("detach", pb.DetachRequest())
        x = ids(1, 4)
        a.transport.call("model.embed_tokens", pb.FORWARD, x, (1, 4, 64), torch.float32, pb.TRAINING)  # a is untouched


def test_a_tenant_that_drops_its_stream_is_detached(insecure):
    code = (
        "import os, sys, torch\n"
        "from symbiont import connect, virtualize\n"
        "from symbiont.base_executor.models import build_builtin\n"
        f"m = virtualize(build_builtin('tiny-llama'), connect('{insecure.grpc}', name='doomed'))\n"
        "m(torch.ones(1, 4, dtype=torch.long))\n"
        "print('attached', flush=True)\n"
        "os._exit(0)\n"  # no detach, no goodbye
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "attached" in out.stdout, out.stderr
    deadline = time.monotonic() + 10
    with connect(insecure.url) as observer:
        while any(t.name == "doomed" for t in observer.stats().tenant_stats):
            assert time.monotonic() < deadline, "the tenant that dropped its stream is still attached"
            time.sleep(0.1)
    assert "doomed" in insecure.log() and "its call stream ended" in insecure.log()


def test_grpc_listener_needs_tls_or_an_explicit_insecure():
    out = subprocess.run(
        [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", "tiny-llama", "--listen",
         f"grpc://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert out.returncode != 0 and "--tls-dir" in out.stderr and "--insecure" in out.stderr


def test_mutual_tls_tenant_is_exact(secure, tls):
    ref = build_builtin("tiny-llama")
    virt = virtualize(build_builtin("tiny-llama"), connect(secure.grpc, tls_dir=str(tls), tenant="alice"))
    x = ids(2, 9)
    with torch.no_grad():
        assert torch.equal(virt(x).logits, ref(x).logits)
    with connect(secure.grpc, tls_dir=str(tls), tenant="bob") as bob:
        rows = bob.stats().tenant_stats  # over gRPC a tenant sees no one's row but its own
        assert rows == [] or all(r.name == "bob" for r in rows)


def test_wrong_credentials_are_refused_and_logged(secure, tls):
    alice_token = (tls / "alice.token").read_text().strip()
    with pytest.raises(AuthenticationError):
        connect(secure.grpc, tls_dir=str(tls), tenant="alice", token="not-a-token").ensure_attached()
    with pytest.raises(AuthenticationError):  # alice's token with bob's certificate
        connect(secure.grpc, tls_dir=str(tls), tenant="bob", token=alice_token).ensure_attached()
    assert "unknown credential" in secure.log() and "came with the certificate of" in secure.log()
    with pytest.raises(ExecutorUnavailableError):  # no TLS at all
        connect(secure.grpc, token=alice_token).catalog()


def test_certificates_of_another_ca_or_expired_never_get_in(secure, tls, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    ca = certs.make_ca(other)
    certs.make_tenant(other, ca, "alice")
    (other / "ca.pem").write_bytes((tls / "ca.pem").read_bytes())  # trusts the real server, shows a foreign cert
    with pytest.raises(ExecutorUnavailableError):
        connect(secure.grpc, tls_dir=str(other), tenant="alice").catalog()
    expired = tmp_path / "expired"
    expired.mkdir()
    for f in ("ca.pem", "ca.key"):
        (expired / f).write_bytes((tls / f).read_bytes())
    long_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=30)
    certs.make_tenant(expired, certs.load_ca(expired), "alice", days=1, not_before=long_ago)
    os.replace(expired / "alice.token", expired / "unused.token")
    with pytest.raises(ExecutorUnavailableError):
        connect(secure.grpc, tls_dir=str(expired), tenant="alice", token=(tls / "alice.token").read_text().strip()).catalog()
    # meanwhile the real alice is served
    with connect(secure.grpc, tls_dir=str(tls), tenant="alice") as conn:
        assert conn.catalog().model == "tiny-llama"
    assert "Handshake failed" in secure.log()  # (gRPC's core logs the refused handshakes)


def _train_beside_unsplit(url: str, steps: int, between=None, inside=None) -> None:
    """SGD steps of a LoRA tenant at url beside the unsplit model; between(step) runs before a
    step, inside(step), if it returns a function, runs it as a forward pre-hook of the second layer
    during that step (after the first layer's calls). The adapters must end alike."""
    ref, virt = lora_model("tiny-llama"), virtualize(lora_model("tiny-llama"), connect(url))
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in (ref, virt)]
    layer = virt.get_base_model().model.layers[1]
    with pytest.warns(RuntimeWarning, match="attached again"):
        for step in range(steps):
            x = ids(2, 9, seed=step)
            if between is not None:
                between(step)
            hook_fn = inside(step) if inside is not None else None
            hook = layer.register_forward_pre_hook(hook_fn) if hook_fn is not None else None
            for m, opt in zip((ref, virt), opts):
                opt.zero_grad()
                m(input_ids=x, labels=x).loss.backward()
                opt.step()
            if hook is not None:
                hook.remove()
    want, got = dict(ref.named_parameters()), dict(virt.named_parameters())
    for name, p in want.items():
        if p.requires_grad:
            torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_a_tenant_finishes_its_training_step_across_an_executor_restart():
    """The executor is stopped and started again on the same port between two training steps, and
    in the middle of one (between the first and second layer's calls of a forward): the tenant's
    calls wait, it attaches anew and its adapter ends where an unsplit run's does (every call
    counted once: the executor keeps no state of a call)."""
    from tests.conftest import Executor

    port = free_port()
    flags = ("--listen", f"grpc://127.0.0.1:{port}", "--insecure")
    executors = [Executor("tiny-llama", *flags)]

    def restart(*_):
        assert executors[-1].stop() == 0
        executors.append(Executor("tiny-llama", *flags))

    try:
        _train_beside_unsplit(f"grpc://127.0.0.1:{port}", 4, between=lambda step: restart() if step == 1 else None,
                              inside=lambda step: restart if step == 2 else None)
        assert len(executors) == 3
    finally:
        for ex in executors:
            ex.stop()


def test_a_call_in_flight_when_the_executor_dies_is_made_again():
    """The executor is frozen (SIGSTOP) inside a forward, so the tenant's next call is sent and
    gets no reply; then it is killed (SIGKILL, no shutdown) and started again. The call in flight
    is made again on the new executor, and the adapter ends where an unsplit run's does (every
    call counted once in effect: the executor keeps no state of a call)."""
    import signal
    import threading

    from tests.conftest import Executor

    port = free_port()
    flags = ("--listen", f"grpc://127.0.0.1:{port}", "--insecure")
    executors = [Executor("tiny-llama", *flags)]
    frozen, threads = threading.Event(), []

    def freeze_then_kill(*_):
        old = executors[-1]
        os.kill(old.pid, signal.SIGSTOP)

        def later():
            time.sleep(0.5)  # (the tenant's next call is sent by now, and waits)
            frozen.set()
            old.proc.kill()
            old.proc.wait()
            executors.append(Executor("tiny-llama", *flags))

        threads.append(threading.Thread(target=later, daemon=True))
        threads[-1].start()

    try:
        _train_beside_unsplit(f"grpc://127.0.0.1:{port}", 3, inside=lambda step: freeze_then_kill if step == 1 else None)
        threads[0].join(60)  # (it appends the new executor once that one has said it is up)
        assert frozen.is_set() and len(executors) == 2
    finally:
        for ex in executors:
            if ex.alive():
                os.kill(ex.pid, signal.SIGCONT)
            ex.stop()


def test_dora_over_grpc(insecure):
    """DoRA's norms reach a tenant over gRPC as over local:// (the `norms` control request)."""
    from tests.test_parity import _dora

    ref = _dora(build_builtin("tiny-llama"))
    virt = _dora(virtualize(build_builtin("tiny-llama"), insecure.grpc))
    x = ids(2, 7, seed=4)
    assert_backward_matches(ref, virt, x)


def test_hf_trainer_over_grpc_with_masking(insecure, tmp_path):
    """The HF Trainer fine-tunes a LoRA tenant over gRPC, its calls noise-masked: the adapter ends
    where the unsplit run's does."""
    from symbiont.client.privacy import NoiseMask
    from tests.test_training import _train

    start = {n: p.detach().clone() for n, p in lora_model("tiny-llama").named_parameters() if p.requires_grad}
    ref = _train(lora_model("tiny-llama"), tmp_path / "ref")
    mask = NoiseMask(scale=1.0, rank=8, weights=build_builtin("tiny-llama").state_dict())
    got = _train(virtualize(lora_model("tiny-llama"), connect(insecure.grpc), mask=mask), tmp_path / "virt")
    assert ref.keys() == got.keys() and ref
    for n in ref:  # (the noise is fresh each run: AdamW's steps differ by up to 2e-5 of their size, seen)
        moved = (ref[n] - start[n]).norm().item()
        assert moved > 0 and (got[n] - ref[n]).norm().item() <= 1e-4 * moved, n


def test_an_oversized_message_ends_only_its_own_stream(insecure):
    """A message past the executor's limit (a chunk plus 1 MiB) is refused with RESOURCE_EXHAUSTED
    on that stream; the same executor keeps serving another tenant."""
    d = build_builtin("tiny-llama").config.hidden_size
    with connect(insecure.grpc) as rogue, connect(insecure.grpc) as other:
        rogue.ensure_attached()
        other.ensure_attached()
        big = pb.CallRequest(call_id=1, unit="model.layers.0.self_attn.o_proj", op=pb.FORWARD, dtype=pb.FLOAT32,
                             shape=[6 << 20 >> 8, d], payload=b"\0" * (6 << 20))
        rogue.transport._requests.put(big.SerializeToString())
        with pytest.raises(grpc.RpcError) as info:
            next(rogue.transport._replies)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        x = torch.randn(3, d)
        y = other.transport.call("model.layers.0.self_attn.o_proj", pb.FORWARD, x, (3, d), torch.float32, pb.TRAINING)
        with torch.no_grad():
            torch.testing.assert_close(y, build_builtin("tiny-llama").model.layers[0].self_attn.o_proj(x))


def test_max_tenants_counts_the_tenants_of_every_transport():
    """`serve --max-tenants 2`: a local and a remote tenant fill it; a third is refused over either
    transport with ResourceExhaustedError, the two attached carry on, and a place freed is taken."""
    port = free_port()
    grpc_url = f"grpc://127.0.0.1:{port}"
    with running_executor("tiny-llama", "--listen", grpc_url, "--insecure", "--max-tenants", "2") as ex:
        ref = build_builtin("tiny-llama")
        x = ids(1, 7)
        local = connect(ex.url)
        remote = connect(grpc_url)
        local_model = virtualize(build_builtin("tiny-llama"), local)
        remote_model = virtualize(build_builtin("tiny-llama"), remote)
        with torch.no_grad():
            want = ref(x).logits
            assert torch.equal(local_model(x).logits, want) and torch.equal(remote_model(x).logits, want)
            for url in (ex.url, grpc_url):
                with pytest.raises(ResourceExhaustedError, match=r"executor full: 2 tenants.*max 2, --max-tenants"):
                    connect(url).ensure_attached()
            assert torch.equal(local_model(x).logits, want) and torch.equal(remote_model(x).logits, want)
            remote.close()
            with connect(grpc_url) as again:  # (the remote tenant's place)
                assert torch.equal(virtualize(build_builtin("tiny-llama"), again)(x).logits, want)
            local.close()
            with connect(ex.url) as again:
                assert torch.equal(virtualize(build_builtin("tiny-llama"), again)(x).logits, want)
