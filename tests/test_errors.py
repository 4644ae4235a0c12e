"""Errors and isolation, against real `base-executor` processes.

Every offence — a bad call, abusive bytes in a ring or on the control socket, a tenant that
dies mid-call or never reads its replies, an executor that dies under its tenants, a model
that is not the served one — must end with the offender getting a typed error or being
detached (its mailbox reclaimed), while the executor keeps serving and a well-behaved tenant
running alongside keeps getting logits bitwise equal to the unsplit model.

Offences the public API refuses to commit are crafted with the local transport's internals:
CallRequest bytes pushed straight into the tenant's request ring, raw frames on the control
socket, scribbles over the ring indices in the shared mailbox.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from symbiont.base_executor.models import BUILTINS, build_builtin
from symbiont import (
    DTypeMismatchError,
    ExecutorUnavailableError,
    InvalidCallError,
    MalformedMessageError,
    ModelMismatchError,
    NotAttachedError,
    ResourceExhaustedError,
    ShapeMismatchError,
    SymbiontError,
    UnknownUnitError,
    VirtLayer,
    connect,
    virtualize,
)
from symbiont.client.errors import raise_for_status
from symbiont.proto import codec, mailbox, urls
from symbiont.proto import executor_pb2 as pb
from tests.conftest import REPO, Executor, running_executor

MODEL = "tiny-llama"
Q = "model.layers.0.self_attn.q_proj"  # 64 -> 64
UP = "model.layers.1.mlp.up_proj"  # 64 -> 128
EMBED = "model.embed_tokens"  # 256 ids -> 64
# --exact: a tenant's results do not depend on whose calls it was batched with, so the
# well-behaved tenant can be checked bitwise while offenders send valid calls too.
EXACT = "--exact"
CALL_LOOP = os.path.join(REPO, "tests", "tenants", "call_loop.py")


# ---- helpers ----------------------------------------------------------------------------


class WellBehavedTenant:
    """A tenant that runs inference on a virtualized tiny-llama in a thread for as long as a
    test abuses the executor, checking every logit bitwise against the unsplit model."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.conn = connect(ex.url, name="well-behaved")
        self.model = virtualize(build_builtin(MODEL), self.conn)
        ref = build_builtin(MODEL)
        g = torch.Generator().manual_seed(0)
        self.inputs = [torch.randint(0, 256, shape, generator=g) for shape in ((1, 5), (2, 9), (3, 16))]
        with torch.no_grad():
            self.expected = [ref(x).logits for x in self.inputs]
        self.steps = 0
        self.mismatches: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="well-behaved", daemon=True)

    def _run(self) -> None:
        try:
            with torch.no_grad():
                while not self._stop.is_set():
                    i = self.steps % len(self.inputs)
                    got = self.model(self.inputs[i]).logits
                    if not torch.equal(got, self.expected[i]):
                        self.mismatches.append(f"step {self.steps}: max |diff| {(got - self.expected[i]).abs().max().item():.3e}")
                    self.steps += 1
        except BaseException as e:  # reported by check()
            self.error = e

    def __enter__(self) -> "WellBehavedTenant":
        self._thread.start()
        self.carries_on(1)
        return self

    def __exit__(self, *exc) -> None:
        executor_alive = self.ex.alive()  # (reaps a dead executor, so the thread's next wait sees it gone)
        self._stop.set()
        self._thread.join(10)
        if not executor_alive:
            self.conn.transport.tenant_id = 0  # nobody left to detach from
        self.conn.close()
        if exc[0] is None:
            self.check()

    def check(self) -> None:
        assert self.error is None, f"the well-behaved tenant failed: {self.error!r}"
        assert not self.mismatches, f"the well-behaved tenant got wrong logits: {self.mismatches[:3]}"
        assert self.steps > 0

    def carries_on(self, more: int = 3, timeout_s: float = 30) -> None:
        """Waits until the tenant has finished `more` further forwards, all of them correct."""
        target = self.steps + more
        deadline = time.monotonic() + timeout_s
        while self.steps < target and self.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.check()
        assert self.steps >= target, f"the well-behaved tenant stalled at {self.steps} forwards (waited {timeout_s} s)"


_raw_ids = itertools.count(1 << 40)  # far from the ids the transport itself hands out


def push_raw(tr, message: bytes) -> None:
    """Puts `message` into the tenant's request ring as if it were a call, and wakes the executor."""
    assert tr._box.requests.push(message), "request ring full"
    tr._wake.ring()


def wait_reply(tr, call_ids: set[int], timeout_s: float = 10) -> pb.CallReply:
    box = tr._box
    deadline = time.monotonic() + timeout_s
    while True:
        seq = box.reply_bell.seq()
        raw = box.replies.pop()
        if raw is not None:
            reply = pb.CallReply.FromString(raw)
            if reply.call_id in call_ids:
                return reply
            continue
        left = deadline - time.monotonic()
        assert left > 0, f"no reply to calls {sorted(call_ids)} within {timeout_s} s"
        box.reply_bell.wait(seq, 20, int(min(left, 0.1) * 1e6))


def raw_call(tr, x: torch.Tensor | None = None, **fields) -> tuple[pb.CallRequest, pb.CallReply]:
    """Sends a CallRequest built from `fields` (x written at its in_offset) straight into the
    ring, bypassing every check of the client, and returns it with its reply."""
    req = pb.CallRequest(call_id=next(_raw_ids), **fields)
    if x is not None:
        codec.view(tr._box.mem, mailbox.DATA_OFFSET + req.in_offset, x.shape, x.dtype).copy_(x)
    push_raw(tr, req.SerializeToString())
    return req, wait_reply(tr, {req.call_id, 0})


def q_call_fields(tokens: int = 2, **overrides) -> dict:
    """A valid FORWARD of Q with its input at offset 0 and its output right behind it."""
    fields = dict(unit=Q, op=pb.FORWARD, dtype=pb.FLOAT32, shape=[tokens, 64], in_offset=0,
                  out_offset=mailbox.align(tokens * 64 * 4), latency=pb.TRAINING)
    fields.update(overrides)
    return fields


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Polls until predicate() is true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def assert_alive(ex: Executor) -> None:
    assert ex.alive(), f"the executor died (exit {ex.proc.returncode}):\n{ex.log()[-4000:]}"


def assert_serving(ex: Executor) -> None:
    assert_alive(ex)
    with connect(ex.url) as observer:
        assert observer.health().serving


def stats(conn) -> pb.StatsReply:
    return conn.transport.control("stats", pb.StatsRequest(), timeout_s=5).stats


def settled_stats(conn, timeout_s: float = 10.0) -> pb.StatsReply:
    """Stats once the data loop has released the mailboxes of tenants gone (it does so between
    batches, soon after a detach, later on a loaded host): mailbox_bytes unchanged over 0.2 s."""
    import time

    deadline = time.monotonic() + timeout_s
    last = stats(conn)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = stats(conn)
        if now.mailbox_bytes == last.mailbox_bytes:
            return now
        last = now
    return last


@contextlib.contextmanager
def attached(ex: Executor, name: str, **kwargs):
    """A connection attached as tenant `name`; detached on exit if the executor still lives."""
    conn = connect(ex.url, name=name, **kwargs)
    conn.ensure_attached()
    try:
        yield conn
    finally:
        if not ex.alive():
            conn.transport.tenant_id = 0
        conn.close()


@pytest.fixture(scope="module")
def ex():
    """One executor for the offences that must not damage it; tests that may, start their own."""
    with running_executor(MODEL, EXACT) as executor:
        yield executor


@pytest.fixture(scope="module")
def reference():
    return build_builtin(MODEL)


@pytest.fixture
def observer(ex):
    with connect(ex.url) as conn:  # never attaches: stats and health only
        yield conn


# ---- bad calls: a typed error for that call, nothing else ---------------------------------

BAD_CALLS = {
    # case: (unit, op, input, out_shape, exception, message pattern)
    "unknown unit": ("model.layers.7.self_attn.q_proj", pb.FORWARD, torch.randn(2, 64), (2, 64), UnknownUnitError, "not served"),
    "wrong last dim": (Q, pb.FORWARD, torch.randn(2, 65), (2, 64), ShapeMismatchError, "last dimension 64"),
    "wrong grad width": (UP, pb.BACKWARD, torch.randn(2, 64), (2, 64), ShapeMismatchError, "last dimension 128"),
    "float16 into float32": (Q, pb.FORWARD, torch.randn(2, 64).half(), (2, 64), DTypeMismatchError, "float16"),
    "float ids": (EMBED, pb.FORWARD, torch.randn(2, 3), (2, 3, 64), DTypeMismatchError, "int64"),
    "backward of embedding": (EMBED, pb.BACKWARD, torch.tensor([[1, 2]]), (1, 2, 64), InvalidCallError, "FORWARD only"),
    "no-bias forward of embedding": (EMBED, pb.FORWARD_NO_BIAS, torch.tensor([[1, 2]]), (1, 2, 64), InvalidCallError, "FORWARD only"),
    "id beyond vocab": (EMBED, pb.FORWARD, torch.tensor([[1, 256]]), (1, 2, 64), InvalidCallError, r"\[0, 256\)"),
    "negative id": (EMBED, pb.FORWARD, torch.tensor([[-1, 3]]), (1, 2, 64), InvalidCallError, r"\[0, 256\)"),
    "unknown op": (Q, 42, torch.randn(2, 64), (2, 64), InvalidCallError, r"\b42\b"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_call_fails_only_that_call(ex, observer, reference, case):
    unit, op, x, out_shape, error, pattern = BAD_CALLS[case]
    with WellBehavedTenant(ex) as good, attached(ex, "offender") as offender:
        tr = offender.transport
        with pytest.raises(error, match=pattern) as caught:
            tr.call(unit, op, x, out_shape, torch.float32, pb.TRAINING)
        assert caught.type is error, f"expected exactly {error.__name__}, got {caught.type.__name__}: {caught.value}"

        # the same call straight into the ring, past any check the client makes: the executor's answer
        errors_before, failures_before = stats(observer).errors, tr._box.failures()
        req, reply = raw_call(tr, x=x, unit=unit, op=op, dtype=codec.dtype_enum(x.dtype), shape=list(x.shape),
                              in_offset=0, out_offset=mailbox.align(x.numel() * x.element_size()))
        assert reply.call_id == req.call_id
        assert reply.status.code == error.code, f"{pb.Code.Name(reply.status.code)}: {reply.status.message}"
        assert stats(observer).errors == errors_before + 1
        assert tr._box.failures() == failures_before + 1  # (a tenant taking replies in batches looks at it)

        # the offender's next call is served, and served right
        y = torch.randn(3, 64)
        got = tr.call(Q, pb.FORWARD, y, (3, 64), torch.float32, pb.TRAINING)
        with torch.no_grad():
            assert torch.equal(got, reference.get_submodule(Q)(y))
        good.carries_on()


def test_ids_the_executor_did_not_check_are_looked_up_clamped():
    """runner.run's embedding: good ids bitwise F.embedding's rows (written into `out` when given),
    ids outside the table read its first or last row, never memory beyond it (a same-GPU tenant's
    ids reach it unchecked: client/transports/ids.py checks them on the tenant's side)."""
    from symbiont.base_executor import runner
    from symbiont.base_executor.catalog import UnitTable

    model = build_builtin(MODEL)
    unit = UnitTable(model).get(EMBED)
    table = model.get_input_embeddings().weight.detach()
    good = torch.randint(0, 256, (40,))
    out = torch.empty(40, 64)
    y = runner.run(unit, pb.FORWARD, good, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, torch.nn.functional.embedding(good, table))
    bad = torch.tensor([-5, 0, 255, 256, 2**40])
    assert torch.equal(runner.run(unit, pb.FORWARD, bad), table[[0, 0, 255, 255, 255]])


def test_a_tenants_ids_checks():
    """IdsChecks (the tenant's side of ids sent to a GPU data area): ids in host memory raise at
    once with the executor's message; other units and hosted adapters' calls (UNIT@ID) are looked
    up by their unit; units it does not know pass (the executor answers for them)."""
    from symbiont.client.transports.ids import IdsChecks, ids_error

    checks, rows = IdsChecks(), {EMBED: 256}
    checks.check_now(rows, EMBED, torch.tensor([[0, 255]]))
    checks.check_now(rows, EMBED, torch.empty(0, dtype=torch.int64))
    checks.check_now(rows, "model.unknown", torch.tensor([1000]))
    for bad, got in (([[1, 256]], r"\[1, 256\]"), ([[-1, 3]], r"\[-1, 3\]")):
        for unit in (EMBED, EMBED + "@3"):
            with pytest.raises(InvalidCallError, match=r"ids for .*embed_tokens.* must lie in \[0, 256\), got " + got):
                checks.check_now(rows, unit, torch.tensor(bad))
    assert not checks.pending
    assert ids_error(EMBED, 256, 0, 255) is None and isinstance(ids_error(EMBED, 256, 0, 256), InvalidCallError)


RAW_HEADERS = {
    # case: (CallRequest fields over a valid Q call, the codes the executor may answer)
    "negative dim": (dict(shape=[-1, 64]), {pb.INVALID_ARGUMENT}),
    "no dims": (dict(shape=[]), {pb.INVALID_ARGUMENT}),
    "unset op": (dict(op=pb.OP_UNSPECIFIED), {pb.INVALID_ARGUMENT}),
    "unset dtype": (dict(dtype=pb.DTYPE_UNSPECIFIED), {pb.DTYPE_MISMATCH}),
    "unknown dtype enum": (dict(dtype=77), {pb.DTYPE_MISMATCH}),
    "payload on a mailbox transport": (dict(payload=b"\0" * 256), {pb.INVALID_ARGUMENT}),
    "misaligned input": (dict(in_offset=2), {pb.INVALID_ARGUMENT}),
    "misaligned output": (dict(out_offset=1030), {pb.INVALID_ARGUMENT}),
    "input past the data area": (dict(in_offset=16 << 20), {pb.INVALID_ARGUMENT, pb.RESOURCE_EXHAUSTED}),
    "output straddling the end": (dict(out_offset=(16 << 20) - 256), {pb.INVALID_ARGUMENT, pb.RESOURCE_EXHAUSTED}),
    "offset near 2**64": (dict(in_offset=2**64 - 64), {pb.INVALID_ARGUMENT, pb.RESOURCE_EXHAUSTED}),
    "2**40 tokens": (dict(shape=[2**40, 64]), {pb.INVALID_ARGUMENT, pb.RESOURCE_EXHAUSTED}),
}


@pytest.mark.parametrize("case", list(RAW_HEADERS))
def test_bad_call_header_in_ring(ex, reference, case):
    """Headers the client never sends: each is answered with its own call id and a typed status."""
    overrides, codes = RAW_HEADERS[case]
    with WellBehavedTenant(ex) as good, attached(ex, "offender") as offender:
        tr = offender.transport
        assert tr._box.data_bytes == 16 << 20  # the offsets above assume the default mailbox
        x = torch.randn(2, 64)
        codec.view(tr._box.mem, mailbox.DATA_OFFSET, x.shape, x.dtype).copy_(x)
        req, reply = raw_call(tr, **q_call_fields(**overrides))
        assert reply.call_id == req.call_id
        assert reply.status.code in codes, f"{pb.Code.Name(reply.status.code)}: {reply.status.message}"
        assert reply.status.message

        req, reply = raw_call(tr, x=x, **q_call_fields())
        assert reply.status.code == pb.OK, reply.status.message
        out = codec.view(tr._box.mem, mailbox.DATA_OFFSET + req.out_offset, (2, 64), torch.float32)
        with torch.no_grad():
            assert torch.equal(out, reference.get_submodule(Q)(x))
        good.carries_on()


def test_malformed_ring_message(ex, reference):
    with WellBehavedTenant(ex) as good, attached(ex, "offender") as offender:
        tr = offender.transport
        for garbage in (b"\xff" * 16, b"\x12\x7f", bytes(range(200, 256))):
            push_raw(tr, garbage)
            reply = wait_reply(tr, {0})
            assert reply.status.code == pb.MALFORMED, reply
            with pytest.raises(MalformedMessageError):
                raise_for_status(reply.status)
        x = torch.randn(4, 64)
        got = tr.call(Q, pb.FORWARD, x, (4, 64), torch.float32, pb.TRAINING)
        with torch.no_grad():
            assert torch.equal(got, reference.get_submodule(Q)(x))
        good.carries_on()


def test_step_programs_of_a_cpu_tenant_are_refused(ex, reference):
    """Step programs are a same-GPU tenant's (client/step_graphs.py): a CPU tenant's definition of
    one is refused with a typed error, a run naming a program that was never defined, and a
    definition with a malformed call, too; the offender's next call is served right and a
    well-behaved tenant carries on."""
    with WellBehavedTenant(ex) as good, attached(ex, "offender") as offender:
        tr = offender.transport
        header = pb.CallRequest(**q_call_fields()).SerializeToString()
        with pytest.raises(InvalidCallError, match="same-GPU tenant"):
            tr.control("program", pb.ProgramRequest(calls=[header]))
        reply = tr._control(pb.ControlRequest(tenant_id=tr.tenant_id, token=tr.token,
                                              program=pb.ProgramRequest(calls=[b"\xff\xfe"])), 10.0)
        assert reply.status.code in (pb.INVALID_ARGUMENT, pb.MALFORMED), reply
        req, reply = raw_call(tr, program=7, latency=pb.INFERENCE)
        assert reply.call_id == req.call_id and reply.status.code == pb.INVALID_ARGUMENT, reply
        assert "no step program 7" in reply.status.message
        y = torch.randn(3, 64)
        got = tr.call(Q, pb.FORWARD, y, (3, 64), torch.float32, pb.TRAINING)
        with torch.no_grad():
            assert torch.equal(got, reference.get_submodule(Q)(y))
        good.carries_on()


def test_malformed_control_message(ex):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(urls.control_endpoint(urls.parse(ex.url)[1]))

    def ask(*frames: bytes) -> pb.ControlReply:
        sock.send_multipart(list(frames))
        assert sock.poll(10_000), f"no control reply to {frames!r}"
        return pb.ControlReply.FromString(sock.recv())

    try:
        with WellBehavedTenant(ex) as good:
            tenants = stats(good.conn).tenants
            for frames in ([b"\xff\xfe\xfd\xfc"], [b"\x0a\xff\xff\xff\xff\x0f"], [b""], [b"header", b"b"],
                           [pb.ControlRequest(tenant_id=5, token="x").SerializeToString()]):
                reply = ask(*frames)
                assert reply.status.code == pb.MALFORMED, (frames, reply)
                assert reply.WhichOneof("kind") is None
            reply = ask(pb.ControlRequest(attach=pb.AttachRequest(tenant_name="no pid")).SerializeToString())
            assert reply.status.code == pb.INVALID_ARGUMENT, reply
            reply = ask(pb.ControlRequest(attach=pb.AttachRequest(pid=os.getpid(), mailbox_bytes=1 << 62)).SerializeToString())
            assert reply.status.code == pb.RESOURCE_EXHAUSTED, reply
            reply = ask(pb.ControlRequest(health=pb.HealthRequest()).SerializeToString())
            assert reply.status.code == pb.OK and reply.health.serving
            assert reply.health.tenants == tenants  # nothing above attached anyone
            good.carries_on()
    finally:
        sock.close()


# ---- identity: before attach, after detach, someone else's id ------------------------------


def test_autocast_to_another_dtype_than_the_served_one_is_refused_clearly(ex):
    """Under torch.autocast the unsplit model would cast to bfloat16; the virtualized model runs in
    the served dtype, and says so (TypeError naming autocast), never computing in a dtype it was
    not asked for."""
    from symbiont import virtualize

    virt = virtualize(build_builtin(MODEL), ex.url)
    x = torch.randint(0, 256, (1, 5))
    with pytest.raises(TypeError, match="under torch.autocast"), torch.autocast("cpu", dtype=torch.bfloat16):
        virt(x)
    with torch.no_grad():  # (and outside autocast it serves as before)
        assert torch.equal(virt(x).logits, build_builtin(MODEL)(x).logits)


def test_call_before_attach(ex, observer):
    tenants = stats(observer).tenants
    with connect(ex.url, name="not attached") as conn:
        with pytest.raises(NotAttachedError):
            conn.transport.call(Q, pb.FORWARD, torch.randn(2, 64), (2, 64), torch.float32, pb.TRAINING)
        for kind, message in (("grow", pb.GrowRequest(data_bytes=1 << 20)), ("detach", pb.DetachRequest())):
            with pytest.raises(NotAttachedError):
                conn.transport.control(kind, message)
    assert stats(observer).tenants == tenants


def test_someone_elses_tenant_id_without_its_token(ex, observer, reference):
    with connect(ex.url, name="victim") as victim, connect(ex.url, name="impostor") as impostor:
        victim.ensure_attached()
        tenants = stats(observer).tenants
        impostor.transport.tenant_id = victim.transport.tenant_id
        for token in ("", "0" * 32, victim.transport.token[:-1] + "x"):
            impostor.transport.token = token
            with pytest.raises(NotAttachedError):
                impostor.transport.control("detach", pb.DetachRequest())
            with pytest.raises(NotAttachedError):
                impostor.transport.control("grow", pb.GrowRequest(data_bytes=64 << 20))
        impostor.transport.tenant_id, impostor.transport.token = 0, ""
        assert stats(observer).tenants == tenants
        x = torch.randn(2, 64)
        got = victim.transport.call(Q, pb.FORWARD, x, (2, 64), torch.float32, pb.TRAINING)
        with torch.no_grad():
            assert torch.equal(got, reference.get_submodule(Q)(x))


def test_call_after_detach(ex, observer):
    before = settled_stats(observer)
    conn = connect(ex.url, name="leaver")
    model = virtualize(build_builtin(MODEL), conn)
    ids = torch.randint(0, 256, (1, 4))
    with torch.no_grad():
        model(ids)
    tid, token = conn.transport.tenant_id, conn.transport.token
    assert stats(observer).tenants == before.tenants + 1
    conn.close()
    after = settled_stats(observer)
    assert after.tenants == before.tenants and after.mailbox_bytes == before.mailbox_bytes

    with pytest.raises(NotAttachedError):
        conn.transport.call(Q, pb.FORWARD, torch.randn(2, 64), (2, 64), torch.float32, pb.TRAINING)
    with pytest.raises(NotAttachedError), torch.no_grad():
        model(ids)
    with connect(ex.url) as replay:  # the old identity is dead at the executor too
        replay.transport.tenant_id, replay.transport.token = tid, token
        with pytest.raises(NotAttachedError):
            replay.transport.control("grow", pb.GrowRequest(data_bytes=32 << 20))
        replay.transport.tenant_id, replay.transport.token = 0, ""


# ---- size limits ---------------------------------------------------------------------------


def test_oversized_call():
    limit = 1 << 20
    with running_executor(MODEL, EXACT, "--mailbox-mb", "1", "--max-mailbox-mb", "1") as ex, \
            WellBehavedTenant(ex) as good, attached(ex, "offender") as offender:
        tr = offender.transport
        assert tr._box.data_bytes == limit
        big = torch.randn(4096, 64)  # 1 MiB in + 1 MiB out
        with pytest.raises(ResourceExhaustedError, match="max-mailbox-mb"):
            tr.call(Q, pb.FORWARD, big, (4096, 64), torch.float32, pb.TRAINING)
        with pytest.raises(ResourceExhaustedError):
            tr.control("grow", pb.GrowRequest(data_bytes=2 * limit))
        # the executor checks the size itself, whatever the client believes
        req, reply = raw_call(tr, **q_call_fields(tokens=4096))
        assert reply.call_id == req.call_id and reply.status.code == pb.RESOURCE_EXHAUSTED, reply
        with connect(ex.url, name="greedy", mailbox_mb=2) as greedy, pytest.raises(ResourceExhaustedError):
            greedy.ensure_attached()

        x = torch.randn(1024, 64)  # fits: 256 KiB in + 256 KiB out
        got = tr.call(Q, pb.FORWARD, x, (1024, 64), torch.float32, pb.TRAINING)
        with torch.no_grad():
            assert torch.equal(got, build_builtin(MODEL).get_submodule(Q)(x))
        good.carries_on()
        assert_serving(ex)


def test_max_mailbox_below_the_default_initial_mailbox():
    """--max-mailbox-mb alone (smaller than the default --mailbox-mb 16) must cap the mailbox, not
    stop the executor from starting."""
    with running_executor(MODEL, "--max-mailbox-mb", "1") as ex, connect(ex.url) as conn:
        conn.ensure_attached()
        assert conn.transport._box.data_bytes <= 1 << 20
        conn.transport.call(Q, pb.FORWARD, torch.randn(8, 64), (8, 64), torch.float32, pb.TRAINING)


# ---- offenders the executor detaches --------------------------------------------------------


def _tenant_is_reclaimed(ex: Executor, observer, tenants_before: int, mailbox_before: int, data_bytes: int) -> None:
    def detached() -> bool:
        assert_alive(ex)
        return stats(observer).tenants == tenants_before - 1

    wait_until(detached, 5, "the offender was not detached")
    # (a retired mailbox counts until the data loop frees it)
    wait_until(lambda: stats(observer).mailbox_bytes == mailbox_before - mailbox.Mailbox.total_bytes(data_bytes), 5,
               "its mailbox was not reclaimed")


def _scribbled_ring_detaches_offender(ex, observer, scribble) -> None:
    """`scribble(mem)` corrupts a tenant's request ring: that tenant is detached, others carry on."""
    with WellBehavedTenant(ex) as good, attached(ex, "scribbler") as offender:
        tr = offender.transport
        before = stats(observer)
        scribble(tr._box.mem)
        tr._wake.ring()
        _tenant_is_reclaimed(ex, observer, before.tenants, before.mailbox_bytes, tr._box.data_bytes)
        assert re.search(rf"tenant {tr.tenant_id} \(scribbler.*detached: corrupt request ring", ex.log()), ex.log()
        good.carries_on()
        assert_serving(ex)


def test_corrupt_request_ring_detaches_offender(ex, observer):
    def jump_ahead(mem):  # the producer index jumps 1000 slots ahead of the consumer's
        tail = struct.unpack_from("<Q", mem, mailbox.REQUEST_RING_OFFSET + 64)[0]
        struct.pack_into("<Q", mem, mailbox.REQUEST_RING_OFFSET, tail + 1000)

    _scribbled_ring_detaches_offender(ex, observer, jump_ahead)


def test_corrupt_length_prefix_detaches_offender(ex, observer):
    def overlong_message(mem):
        head = struct.unpack_from("<Q", mem, mailbox.REQUEST_RING_OFFSET)[0]
        slot = mailbox.REQUEST_RING_OFFSET + 128 + (head % mailbox.RING_SLOTS) * mailbox.RING_SLOT_SIZE
        struct.pack_into("<I", mem, slot, 0xFFFFFFF0)  # a message longer than any slot
        struct.pack_into("<Q", mem, mailbox.REQUEST_RING_OFFSET, head + 1)

    _scribbled_ring_detaches_offender(ex, observer, overlong_message)


def _flood_without_reading(tr, message: bytes, n: int = 100, timeout_s: float = 5) -> int:
    """Pushes n copies of a call and never pops a reply; returns how many went into the ring."""
    pushed, deadline = 0, time.monotonic() + timeout_s
    while pushed < n and time.monotonic() < deadline:
        if tr._box.requests.push(message):
            pushed += 1
            tr._wake.ring()
        else:
            time.sleep(0.005)
    return pushed


def _deaf_tenant_is_detached(ex: Executor, observer, fields: dict) -> None:
    with WellBehavedTenant(ex) as good, attached(ex, "deaf") as offender:
        tr = offender.transport
        before = stats(observer)
        x = torch.randn(2, 64)
        codec.view(tr._box.mem, mailbox.DATA_OFFSET, x.shape, x.dtype).copy_(x)
        pushed = _flood_without_reading(tr, pb.CallRequest(call_id=next(_raw_ids), **fields).SerializeToString())
        assert pushed > mailbox.RING_SLOTS
        _tenant_is_reclaimed(ex, observer, before.tenants, before.mailbox_bytes, tr._box.data_bytes)
        assert re.search(rf"tenant {tr.tenant_id} \(deaf.*detached: reply ring full", ex.log()), ex.log()
        good.carries_on()
        assert_serving(ex)


def test_tenant_that_never_reads_replies_is_detached(ex, observer):
    _deaf_tenant_is_detached(ex, observer, q_call_fields())


def test_tenant_that_never_reads_its_error_replies_is_detached():
    """The replies that overflow are error statuses, answered while the executor drains the ring
    (its own executor: this is the path most likely to take one down)."""
    with running_executor(MODEL, EXACT) as ex, connect(ex.url) as observer:
        _deaf_tenant_is_detached(ex, observer, q_call_fields(unit="no.such.unit"))


def test_detached_offender_learns_it_on_its_next_call(ex, observer):
    """A tenant the executor detached (here: for not reading its replies) gets NotAttachedError
    from its next call, not a wait for a reply that nobody will ever send."""
    with attached(ex, "deaf") as offender:
        tr = offender.transport
        tenants = stats(observer).tenants
        _flood_without_reading(tr, pb.CallRequest(call_id=next(_raw_ids), **q_call_fields()).SerializeToString())
        wait_until(lambda: stats(observer).tenants == tenants - 1, 5, "the offender was not detached")
        while tr._box.replies.pop() is not None:  # it finally reads, then carries on as if nothing happened
            pass
        outcome: list = []

        def call():
            try:
                outcome.append(tr.call(Q, pb.FORWARD, torch.randn(2, 64), (2, 64), torch.float32, pb.TRAINING))
            except Exception as e:
                outcome.append(e)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(5)
        assert outcome, "the detached tenant's call still waits after 5 s: it will wait forever"
        assert isinstance(outcome[0], NotAttachedError), outcome[0]


def test_tenant_killed_in_the_middle_of_a_call(ex, observer):
    with WellBehavedTenant(ex) as good:
        before = stats(observer)
        loop = subprocess.Popen([sys.executable, CALL_LOOP, ex.url], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO)
        try:
            first = loop.stdout.readline().split()
            assert first[:1] == ["attached"], f"{first} {loop.stdout.read() if loop.poll() is not None else ''}"
            data_bytes = int(first[2])
            calls = 0
            while calls < 6:  # well into its loop
                line = loop.stdout.readline()
                assert line, f"the calling tenant exited with {loop.wait()}"
                calls = int(line.split()[1])
            during = stats(observer)
            assert during.tenants == before.tenants + 1
            assert during.mailbox_bytes == before.mailbox_bytes + mailbox.Mailbox.total_bytes(data_bytes)

            os.kill(loop.pid, signal.SIGKILL)  # not reaped yet: the executor must see through the zombie
            took = wait_until(lambda: stats(observer).tenants == before.tenants, 5, "the killed tenant was not detached")
            wait_until(lambda: stats(observer).mailbox_bytes == before.mailbox_bytes, 5, "the killed tenant's mailbox was not reclaimed")
            print(f"killed tenant detached {took:.2f} s after SIGKILL")
            assert re.search(rf"\(call-loop, pid {loop.pid}\) detached: process {loop.pid} is gone", ex.log()), ex.log()
            good.carries_on()
            assert_serving(ex)
        finally:
            loop.kill()
            loop.wait()
            loop.stdout.close()


def test_detach_with_calls_in_flight():
    """A tenant that detaches (or grows its mailbox) while its calls are queued or running — a
    client interrupted mid-call, then closed — must not take the executor down."""
    rows = 30_000  # 7.3 MiB in, 14.6 MiB out per call: the executor is busy when the detach lands
    with running_executor(MODEL, EXACT) as ex, WellBehavedTenant(ex) as good, connect(ex.url) as observer:
        tenants = stats(observer).tenants
        for round_ in range(12):
            with connect(ex.url, name=f"quitter-{round_}", mailbox_mb=32) as quitter:
                quitter.ensure_attached()
                tr = quitter.transport
                x = torch.randn(rows, 64)
                codec.view(tr._box.mem, mailbox.DATA_OFFSET, x.shape, x.dtype).copy_(x)
                for _ in range(3):
                    req = pb.CallRequest(call_id=next(_raw_ids), unit=UP, op=pb.FORWARD, dtype=pb.FLOAT32,
                                         shape=[rows, 64], in_offset=0, out_offset=mailbox.align(rows * 64 * 4))
                    tr._box.requests.push(req.SerializeToString())
                tr._wake.ring()
                time.sleep(0.001 * (round_ % 4))
                with contextlib.suppress(ExecutorUnavailableError):
                    if round_ % 2:
                        tr.control("grow", pb.GrowRequest(data_bytes=64 << 20), timeout_s=5)
                    tr.control("detach", pb.DetachRequest(), timeout_s=5)
                tr.tenant_id, tr.token = 0, ""
            time.sleep(0.15)  # the dropped calls were running: let a crash show before the next round
            assert ex.alive(), f"the executor died in round {round_} (exit {ex.proc.returncode}):\n{ex.log()[-3000:]}"
        assert stats(observer).tenants == tenants
        good.carries_on()
        assert_serving(ex)


# ---- the executor dies under its tenants ----------------------------------------------------


def _forget(ex: Executor) -> None:
    """Reaps a killed executor and removes the control socket it could not remove itself."""
    ex.stop()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(urls.control_endpoint(urls.parse(ex.url)[1])[len("ipc://") :])


class CallingTenant:
    """A tenant calling UP in a loop in a thread; records the exception that ends it, and when."""

    def __init__(self, url: str):
        self.conn = connect(url, name="calling")
        self.conn.ensure_attached()
        self.calls = 0
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.calls >= 5 or self.error is not None, 30, "the calling tenant did not start")

    def _run(self) -> None:
        x = torch.randn(512, 64)
        try:
            while True:
                self.conn.transport.call(UP, pb.FORWARD, x, (512, 128), torch.float32, pb.TRAINING)
                self.calls += 1
        except BaseException as e:
            self.error, self.ended_at = e, time.monotonic()


def test_executor_killed_under_a_tenant():
    ex = Executor(MODEL)
    try:
        tenant = CallingTenant(ex.url)
        killed_at = time.monotonic()
        ex.proc.kill()
        ex.proc.wait()
        tenant.thread.join(5)
        assert tenant.ended_at is not None, "the tenant still waits 5 s after its executor died"
        assert isinstance(tenant.error, ExecutorUnavailableError), repr(tenant.error)
        print(f"tenant told {tenant.ended_at - killed_at:.2f} s after the executor died")
        assert tenant.ended_at - killed_at < 3
        with pytest.raises(SymbiontError):  # later calls fail at once, too
            tenant.conn.transport.call(UP, pb.FORWARD, torch.randn(2, 64), (2, 128), torch.float32, pb.TRAINING)
    finally:
        _forget(ex)


def test_executor_killed_between_calls():
    """Idle tenants learn it on their next call — including a call that first has to grow the
    mailbox (a control round trip) — within seconds."""
    ex = Executor(MODEL)
    try:
        small, large = connect(ex.url, name="small"), connect(ex.url, name="large")
        for conn in (small, large):
            conn.ensure_attached()
            conn.transport.call(Q, pb.FORWARD, torch.randn(2, 64), (2, 64), torch.float32, pb.TRAINING)
        ex.proc.kill()
        ex.proc.wait()
        killed_at = time.monotonic()
        outcomes: dict[str, tuple] = {}

        def call(name, conn, rows):
            try:
                conn.transport.call(Q, pb.FORWARD, torch.randn(rows, 64), (rows, 64), torch.float32, pb.TRAINING)
                outcomes[name] = (None, time.monotonic())
            except Exception as e:
                outcomes[name] = (e, time.monotonic())

        threads = [threading.Thread(target=call, args=("small", small, 2), daemon=True),
                   threading.Thread(target=call, args=("large", large, 40_000), daemon=True)]  # 20 MiB: needs a grow
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, killed_at + 5 - time.monotonic()))
        for name in ("small", "large"):
            assert name in outcomes, f"the {name} call still waits 5 s after the executor died"
            error, at = outcomes[name]
            assert isinstance(error, ExecutorUnavailableError), f"{name}: {error!r}"
            assert at - killed_at < 3, f"{name}: told after {at - killed_at:.1f} s"
    finally:
        _forget(ex)


def test_executor_killed_before_its_parent_reaps_it():
    """The executor is this process's child (as when a script starts its own executor) and dies:
    until it is reaped it is a zombie, which must not pass for a live executor."""
    ex = Executor(MODEL)
    try:
        tenant = CallingTenant(ex.url)
        killed_at = time.monotonic()
        os.kill(ex.pid, signal.SIGKILL)  # and no wait(): the zombie stays until _forget
        tenant.thread.join(5)
        assert tenant.ended_at is not None, "the tenant still waits 5 s after its executor died"
        assert isinstance(tenant.error, ExecutorUnavailableError), repr(tenant.error)
        assert tenant.ended_at - killed_at < 3
    finally:
        _forget(ex)


# ---- a model that is not the served one -----------------------------------------------------


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "modules": [(n, type(m)) for n, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _assert_unchanged(model: torch.nn.Module, snap: dict) -> None:
    assert [(n, type(m)) for n, m in model.named_modules()] == snap["modules"]
    assert not any(isinstance(m, VirtLayer) for m in model.modules())
    state = model.state_dict()
    assert state.keys() == snap["state"].keys()
    for k, v in snap["state"].items():
        assert torch.equal(state[k], v), f"{k} changed"


def _seeded(seed: int, **config_overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = BUILTINS[MODEL].config()
    for key, value in config_overrides.items():
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


MISMATCHED = {
    # case: (model factory, message pattern)
    "another seed": (lambda: _seeded(1), r"unit '(model\.|lm_head)[\w.]*'.*weights differ"),
    "another architecture": (lambda: build_builtin("tiny-qwen2"), r"config differs from the served model at '\w+'"),
    "another depth": (lambda: _seeded(0, num_hidden_layers=3), r"at 'num_hidden_layers'"),
    "another width": (lambda: _seeded(0, intermediate_size=96), r"at 'intermediate_size'"),
    "another dtype": (lambda: build_builtin(MODEL, torch.bfloat16), r"unit '[\w.]+'.*bfloat16"),
}


@pytest.mark.parametrize("case", list(MISMATCHED))
def test_virtualize_refuses_another_model(ex, observer, case):
    make, pattern = MISMATCHED[case]
    model = make()
    snap = _snapshot(model)
    x = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        logits = model(x).logits
    tenants = stats(observer).tenants
    with pytest.raises(ModelMismatchError, match=pattern):
        virtualize(model, ex.url)
    _assert_unchanged(model, snap)
    with torch.no_grad():
        assert torch.equal(model(x).logits, logits)
    assert stats(observer).tenants == tenants, "a refused virtualize left a tenant attached"
