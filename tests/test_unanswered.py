"""The bookkeeping of calls that return before their replies (client/transports/unanswered.py),
on a real mailbox: a failed call's output word is written in call order, only once the previous
call's result is in, and its failure is raised only then."""
from __future__ import annotations

import os

import pytest
import torch

from symbiont.errors import InternalError, UnknownUnitError
from symbiont.client.transports.unanswered import Sent, Unanswered, previous_seq
from symbiont.proto import codec, mailbox
from symbiont.proto import executor_pb2 as pb


@pytest.fixture
def box():
    fd, mem = mailbox.create_region("symbiont-test-unanswered", mailbox.Mailbox.total_bytes(0))
    b = mailbox.Mailbox(mem, 0)
    yield b
    b.close()
    os.close(fd)


def _sent(call_id: int) -> Sent:
    return Sent(call_id, call_id, f"u{call_id}", pb.FORWARD, (3, 4), torch.float32)


def _ok(call_id: int, shape=(3, 4)) -> pb.CallReply:
    return pb.CallReply(call_id=call_id, status=pb.Status(code=pb.OK), dtype=codec.dtype_enum(torch.float32), shape=list(shape))


def _failed(call_id: int) -> pb.CallReply:
    return pb.CallReply(call_id=call_id, status=pb.Status(code=pb.UNKNOWN_UNIT, message="no such unit"))


def test_previous_seq_wraps_past_zero():
    assert previous_seq(2) == 1
    assert previous_seq(1) == 0xFFFFFFFF


def test_failed_calls_are_released_in_call_order_after_the_results_before_them(box):
    u = Unanswered()
    u.bind(box)
    for i in (1, 2, 3, 4):
        u.add(_sent(i))
    assert u.answer(_failed(3)) and u.answer(_failed(2))  # replies may come out of call order
    u.release()
    assert box.output_word() == 0, "call 1's result is not in: nothing may be released yet"
    assert u.take_failure() is None
    assert u.answer(_ok(1))
    box.set_output_word(1)  # what the executor's stream writes once call 1's result is in
    u.release()
    assert box.output_word() == 3 and not u.failed  # 2 then 3, each right after its predecessor
    failure = u.take_failure()
    assert isinstance(failure, UnknownUnitError) and "FORWARD of 'u2'" in str(failure)  # the earliest call's
    assert u.take_failure() is None
    assert len(u) == 1 and u.busy  # call 4 still unanswered
    assert u.answer(_ok(4)) and not u.busy


def test_a_released_word_never_goes_back(box):
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    box.set_output_word(5)  # later calls' results already in
    u.answer(_failed(1))
    u.release()
    assert box.output_word() == 5


def test_wrong_result_shape_is_an_internal_error_and_stale_replies_are_ignored(box):
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    assert not u.answer(_ok(7))  # not one of these calls (an abandoned call's late reply)
    assert u.answer(_ok(1, shape=(3, 5)))
    u.release()
    assert isinstance(u.take_failure(), InternalError)


def test_a_failed_call_that_waited_for_its_reply_keeps_the_order_of_releases(box):
    """A call that waited for its reply and failed raised its own error; its output word is still
    written in call order, so a later failed call's release is not held up for good."""
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    u.add_failed(_sent(2))  # failed, its caller raised
    u.add(_sent(3))
    assert u.answer(_failed(3))
    u.release()
    assert box.output_word() == 0
    assert u.answer(_ok(1))
    box.set_output_word(1)
    u.release()
    assert box.output_word() == 3 and not u.failed
    failure = u.take_failure()
    assert isinstance(failure, UnknownUnitError) and "'u3'" in str(failure)  # call 2's error was its caller's


def test_a_call_run_with_the_wrong_result_is_not_released_by_the_tenant(box):
    """The executor wrote that call's output word itself (it ran): the tenant must not write it,
    or a late write of the executor's could move the word back."""
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    assert u.answer(_ok(1, shape=(9, 9)))
    assert not u.failed
    u.release()
    assert box.output_word() == 0
    assert isinstance(u.take_failure(), InternalError)


def test_collect_takes_the_replies_from_the_ring_and_raises_the_earliest_failure(box):
    u = Unanswered()
    u.bind(box)
    for i in (1, 2, 3):
        u.add(_sent(i))
    pending = [_failed(2), _ok(1), _ok(3)]
    sleeps = []

    def sleep(b, seq, timeout_us):  # what the executor does meanwhile: a reply, a result
        sleeps.append(timeout_us)
        reply = pending.pop(0)
        assert b.replies.push(reply.SerializeToString())
        if reply.status.code == pb.OK:
            b.set_output_word(max(b.output_word(), reply.call_id))

    u.collect(sleep)  # keep=None: takes what came (nothing), never sleeps
    assert sleeps == [] and len(u) == 3
    with pytest.raises(UnknownUnitError, match="'u2'"):
        u.collect(sleep, keep=0)
    assert box.output_word() == 2  # released once call 1's result was in
    assert len(u) == 1 and sleeps[1] < sleeps[0]  # call 3 unanswered; a release polls sooner
    u.collect(sleep, keep=0)
    assert not u.busy and box.output_word() == 3


def test_a_reply_the_caller_waits_for_is_kept_when_the_watchdog_takes_it(box):
    """The watchdog takes replies while the caller may be blocked (finding #3 of the session-5
    review): a reply the caller takes itself must not be lost when the watchdog comes first."""
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    u.await_reply(2)  # call 2 waits for its reply (or was interrupted and is finished later)
    for reply in (_ok(1), _ok(2)):
        assert box.replies.push(reply.SerializeToString())
    box.set_output_word(1)
    assert not u.watch(2, lambda: True)  # the watchdog's look: takes both replies, executor alive
    assert not u.busy
    reply = u.wait_reply(2, lambda *a: pytest.fail("the reply was taken already: no wait"))
    assert reply.call_id == 2 and u.awaited == 0


def test_the_watchdog_releases_every_wait_once_the_executor_is_gone(box):
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    u.add(_sent(2))
    assert not u.watch(2, lambda: True) and box.output_word() == 0  # alive: results may still come
    assert u.watch(2, lambda: False) and box.output_word() == 2  # gone: no result comes any more
    assert not u.watch(2, lambda: False)  # nothing waits any more
    u.bind(None)
    assert not u.watch(3, lambda: False), "an unbound mailbox (closed) is never touched"
    u.bind(box, tag="new")  # a grow's new mailbox: the watchdog's seq of the old one is stale
    u.add(_sent(4))
    assert not u.watch(4, lambda: False, tag="old") and box.output_word() == 2
    assert u.watch(4, lambda: False, tag="new") and box.output_word() == 4


def test_a_call_never_sent_is_forgotten(box):
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))
    u.add(_sent(2))
    u.forget(2)  # announced, then its request could not be pushed
    u.await_reply(3)
    u.forget(3)
    assert [s.call_id for s in u.sent] == [1] and u.awaited == 0
    assert box.replies.push(_ok(3).SerializeToString())  # a stray reply is not kept for anyone
    u.take()
    assert u.awaited_reply is None and len(u) == 1


def test_only_a_processs_one_tenant_of_an_executor_returns_early(box):
    """Which same-GPU transports of one process return early (client/transports/local.py, _early):
    one alone does; two attached to one executor wait for their replies unless told otherwise; one
    of another executor, a detached one, or one collected without closing does not count; a joining
    tenant first waits until its sibling's output word has reached the sibling's last call, one
    deciding as it joins included."""
    import gc
    import threading
    import time
    import types

    from symbiont.client.transports import local

    def transport(pid, mailbox_=None, seq=0):
        t = local.LocalTransport("local://test-early", "test-early")
        t._executor_pid, t._box = pid, mailbox_
        t._order = types.SimpleNamespace(seq=seq) if mailbox_ is not None else None  # (what the join reads of it)
        return t

    a = transport(101, box, seq=5)
    box.set_output_word(3)  # its calls 4 and 5 not answered yet
    a._join_waiters()
    assert a._early()
    threading.Timer(0.3, box.set_output_word, args=(5,)).start()
    t0 = time.monotonic()
    b = transport(101)
    b._join_waiters()
    assert time.monotonic() - t0 >= 0.25, "the join did not wait for the sibling's output word"
    assert not a._early() and not b._early()
    b.return_early = True
    assert b._early() and not a._early()
    other = transport(202)
    other._join_waiters()
    assert other._early()  # (another executor's tenants do not count)
    b._unmap()  # (as closing does)
    assert a._early()
    c = transport(101)
    c._join_waiters()
    assert not a._early()
    del c
    gc.collect()
    assert a._early()
    # a call of a's that looked at _early() (alone) and has not queued its GPU wait yet: a joining
    # tenant waits until it has (and then for its output word), not only for the words a had
    box.set_output_word(a._order.seq)
    a._deciding = True

    def queued():  # (as the call does: its sequence counted, then no longer deciding)
        a._order.seq += 1
        a._deciding = False

    threading.Timer(0.3, queued).start()
    threading.Timer(0.6, box.set_output_word, args=(a._order.seq + 1,)).start()
    t0 = time.monotonic()
    d = transport(101)
    d._join_waiters()
    assert time.monotonic() - t0 >= 0.55, "the join did not wait for a sibling's call deciding as it joined"
    assert not a._early() and not d._early()
    d._unmap()
    with local._WAITERS_LOCK:  # (the box is the fixture's: only the bookkeeping goes)
        for t in (a, other):
            local._WAITERS.pop(id(t), None)


def test_a_join_cut_short_waits_again_at_the_next_call(box, monkeypatch):
    """A tenant whose first join beside a sibling is interrupted (KeyboardInterrupt in its wait)
    stays counted, so the sibling keeps waiting for its replies, and its next call's join waits for
    the sibling's output word again (and starts the watchdog) instead of taking the join as done.
    A sibling's call that will wait for its reply stops deciding at once (a joining tenant need not
    wait it out)."""
    import threading
    import time
    import types

    from symbiont.client.transports import local

    def transport(mailbox_=None, seq=0):
        t = local.LocalTransport("local://test-join-cut", "test-join-cut")
        t._executor_pid, t._box = 303, mailbox_
        t._order = types.SimpleNamespace(seq=seq) if mailbox_ is not None else None
        return t

    a = transport(box, seq=7)
    b = transport()
    try:
        box.set_output_word(5)  # a's calls 6 and 7 not answered yet
        a._join_waiters()
        cut = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: (_ for _ in ()).throw(KeyboardInterrupt()))
        monkeypatch.setattr(local, "time", cut)
        with pytest.raises(KeyboardInterrupt):
            b._join_waiters()
        monkeypatch.setattr(local, "time", time)
        assert not a._early() and not b._settled  # (b is still counted)
        watchdogs = []
        monkeypatch.setattr(local, "start_watchdog", lambda t: watchdogs.append(t) or threading.Thread())
        threading.Timer(0.3, box.set_output_word, args=(7,)).start()
        t0 = time.monotonic()
        b._settle()  # (as its next call does, seeing the join unsettled)
        assert time.monotonic() - t0 >= 0.25, "the second join did not wait for the sibling's output word"
        assert b._settled and watchdogs == [b]
        t0 = time.monotonic()
        b._join_waiters()  # (a grow's remap: settled, no wait)
        assert time.monotonic() - t0 < 0.1
        a._deciding = True  # (a call of a's, now beside b: it waits for its reply, so it is no longer deciding)
        assert a._decide(torch.zeros(2)) == (False, False) and not a._deciding
    finally:
        with local._WAITERS_LOCK:  # (the box is the fixture's: only the bookkeeping goes)
            for t in (a, b):
                local._WAITERS.pop(id(t), None)


def test_a_call_whose_mailbox_grew_looks_again_at_who_is_attached(box):
    """A call of a lone tenant may return early; if its mailbox grows before it is sent, a sibling
    may have joined during the grow without seeing it (no mailbox to read then). The call then looks
    again and waits for its reply instead of queueing an early GPU wait beside the sibling."""
    import types

    from symbiont.client.transports import local

    def transport(mailbox_=None, seq=0):
        t = local.LocalTransport("local://test-grow-look", "test-grow-look")
        t._executor_pid, t._box = 404, mailbox_
        t._order = types.SimpleNamespace(seq=seq, device=torch.device("cpu")) if mailbox_ is not None else None
        return t

    fd, mem = mailbox.create_region("symbiont-test-grown", mailbox.Mailbox.total_bytes(0))
    grown = mailbox.Mailbox(mem, 0)
    a, joiner, sent = transport(box, seq=3), None, {}
    a.split_bytes = 0
    box.set_output_word(3)
    try:
        a._join_waiters()

        def plan_with_a_grow(key, x):  # (as _plan does when the data area is too small: another mailbox)
            nonlocal joiner
            a._box = None  # (between the grow's two mailboxes)
            joiner = transport()
            joiner._join_waiters()  # (sees no mailbox of a's: nothing to wait for)
            a._box = grown
            return "plan"

        def send_call(*args):
            sent["may_return"], sent["native"] = args[-1], args[-2]
            return "result"

        a._plan, a._send_call = plan_with_a_grow, send_call
        a._deciding = True
        assert a._call_decided("u", pb.FORWARD, torch.zeros(1, 4), (1, 4), torch.float32, pb.INFERENCE, None) == "result"
        assert sent == {"may_return": False, "native": False} and not a._deciding
    finally:
        with local._WAITERS_LOCK:
            for t in (a, joiner):
                local._WAITERS.pop(id(t), None)
        grown.close()
        os.close(fd)


def test_a_failed_step_program_run_lets_its_graph_go_after_the_run_before_it(box):
    """A step program's run refused by the executor (client/transports/local_programs.py): its
    graph waits on the program output word, so that word is set to let every wait pass, but only
    once the previous call's result is in and the previous run's graph has set the word back to 0
    (else that reset would undo the release); the program is then marked to be defined again."""
    u = Unanswered()
    u.bind(box)
    u.add(_sent(1))  # the previous run, its result in once the output word reaches 1
    u.add(Sent(2, 2, "step program 7", pb.FORWARD, (), None, program=True))
    assert u.answer(_ok(1)) and u.answer(_failed(2))
    box.set_output_word(1)
    box._set_word(mailbox.PROGRAM_OUT_OFFSET, 19)  # run 1's graph has read its last call's result, not yet reset the word
    u.release()
    assert box.output_word() == 1 and box.program_output_word() == 19, "released under the previous run's reset"
    assert u.take_failure() is None
    box._set_word(mailbox.PROGRAM_OUT_OFFSET, 0)  # run 1's graph ends
    u.release()
    assert box.output_word() == 2 and box.program_output_word() == mailbox.RELEASED
    assert isinstance(u.take_failure(), UnknownUnitError)
    assert u.failed_programs == {"step program 7"}
