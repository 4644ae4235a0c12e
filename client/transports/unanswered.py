"""Calls that returned before the executor answered them, until their replies come.

A same-GPU call returns as soon as it is sent: the tenant's stream waits on the GPU for the
mailbox's output word, which the executor's stream writes once the result is in place, so
neither host waits for the other. The replies (statuses) come later and are taken here.

A call that failed (a status other than OK) got no result and the executor does not write the
output word for it, so nothing would release the tenant GPU's wait for it. The
tenant writes the output word itself, in call order and only once the previous call's result is
in (the word has reached it): an earlier call's read is never let through before its result.
Its failure is raised once that is done, at the next call or at the next confirm().

Two threads use this: the caller, and the transport's watchdog, which takes replies and releases
failed calls while the caller's host may be blocked in a CUDA synchronise behind one of our GPU's
waits (holding the transport's lock). So everything here is done under `lock`, a lock of its own
that is never held across a CUDA call or a sleep; the watchdog never needs the transport's lock.
A reply that the caller waits for itself (`awaited`) is kept for it when the watchdog takes it.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import threading

import torch

from symbiont.client.errors import InternalError, error_for_status
from symbiont.proto import codec
from symbiont.proto import executor_pb2 as pb
from symbiont.proto.cuda_ipc import reached

LIVENESS_SLICE_US = 200_000  # how long a wait sleeps before it looks whether the executor is alive
RELEASE_POLL_US = 1000  # how often a failed call's release looks at the output word


@dataclasses.dataclass(slots=True)
class Sent:
    call_id: int
    seq: int  # the call's input_seq: the output word reaches it with the result
    unit: str
    op: int
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype | None  # (None: a step program's run, whose reply carries no result)
    program: bool = False  # a step program's run: its release lets the program's waits go too


def call_name(unit: str, op: int) -> str:
    """What a call was, for its errors: "FORWARD of 'model.layers.0.self_attn.q_proj'"."""
    name = pb.Op.Name(op) if op in pb.Op.values() else f"op {op}"
    return f"{name} of {unit!r}"


def reply_error(reply: pb.CallReply, unit: str, op: int, out_shape: tuple[int, ...], out_dtype: torch.dtype) -> Exception | None:
    """The error a call's reply says (its status, or a result other than the one asked for); None if OK."""
    if reply.status.code == pb.OK:
        if tuple(reply.shape) == tuple(out_shape) and codec.TORCH_OF.get(reply.dtype) is out_dtype:
            return None
        return InternalError(
            f"{call_name(unit, op)}: executor returned {list(reply.shape)} {reply.dtype}, expected {list(out_shape)} {out_dtype}"
        )
    return error_for_status(reply.status, call_name(unit, op))


def previous_seq(seq: int) -> int:
    """The input_seq of the call before `seq` (they count 1 .. 2**32 - 1, then wrap to 1)."""
    return (seq - 2) % 0xFFFFFFFF + 1


class Unanswered:
    def __init__(self):
        self.lock = threading.Lock()  # never held across a CUDA call or a sleep (module docstring)
        self.box = None  # the mailbox (proto.mailbox.Mailbox) the replies come on; None: none now
        self.tag = None  # see bind()
        self.sent: collections.deque[Sent] = collections.deque()  # in call order
        self.failed: list[Sent] = []  # answered with a failure, output word not written yet; call order
        self.failure: tuple[int, Exception] | None = None  # (call id, error) of the earliest failure not raised yet
        self.awaited = 0  # the call id of a call whose caller takes its reply itself (0: none)
        self.awaited_reply: pb.CallReply | None = None  # its reply, when another thread took it
        self.failed_programs: set[str] = set()  # the names of step programs a run of which failed (defined again)

    def __len__(self) -> int:
        return len(self.sent)

    @property
    def busy(self) -> bool:
        """Whether anything is left to take or to release."""
        return bool(self.sent or self.failed or self.failure)

    def bind(self, box, tag=None) -> None:
        """Takes the replies of `box` from now on (None: of no mailbox); forgets everything of the
        mailbox before, which must not be used by anyone once this returns. `tag`: what watch()
        must be given for this mailbox (its words' owner)."""
        with self.lock:
            self.box, self.tag = box, tag
            self.sent.clear()
            self.failed.clear()
            self.failure = None
            self.awaited, self.awaited_reply = 0, None

    def add(self, sent: Sent) -> None:
        with self.lock:
            self.sent.append(sent)

    def add_failed(self, sent: Sent) -> None:
        """A call whose failure its caller raises itself (it waited for its reply, or was never
        sent): only its output word is left to write."""
        with self.lock:
            bisect.insort(self.failed, sent, key=lambda s: s.call_id)

    def await_reply(self, call_id: int) -> None:
        """The reply of call_id is its caller's to take (wait_reply): it is kept when another
        thread takes it (a reply already kept for it stays)."""
        with self.lock:
            if self.awaited != call_id:
                self.awaited, self.awaited_reply = call_id, None

    def forget(self, call_id: int) -> None:
        """Forgets a call that add() or await_reply() announced but that was never sent."""
        with self.lock:
            sent = next((s for s in reversed(self.sent) if s.call_id == call_id), None)
            if sent is not None:
                self.sent.remove(sent)
            if self.awaited == call_id:
                self.awaited, self.awaited_reply = 0, None

    def answer(self, reply: pb.CallReply) -> bool:
        """Takes a reply; False when it answers none of these calls."""
        with self.lock:
            return self._answer(reply)

    def _answer(self, reply: pb.CallReply) -> bool:
        if self.sent and self.sent[0].call_id == reply.call_id:  # replies mostly come in call order
            sent = self.sent[0]
        else:
            sent = next((s for s in self.sent if s.call_id == reply.call_id), None)
        if sent is None and reply.call_id == 0 and self.sent:  # a request that did not parse: the oldest
            sent = self.sent[0]
        if sent is None:
            if self.awaited and reply.call_id in (self.awaited, 0):
                self.awaited_reply = reply
                return True
            return False
        if sent is self.sent[0]:
            self.sent.popleft()
        else:
            self.sent.remove(sent)
        failure = reply_error(reply, sent.unit, sent.op, sent.out_shape, sent.out_dtype)
        if failure is not None:
            if sent.program:
                self.failed_programs.add(sent.unit)
            failure.call_id = sent.call_id  # (its transport drops what it kept for the call: client/transports/ids.py)
            if reply.status.code != pb.OK:  # (a call run with a result other than asked for had its word written)
                bisect.insort(self.failed, sent, key=lambda s: s.call_id)
            if self.failure is None or sent.call_id < self.failure[0]:
                self.failure = (sent.call_id, failure)
        return True

    def release(self) -> None:
        """Writes the output word for each failed call whose previous call's result is in."""
        with self.lock:
            self._release()

    def _release(self) -> None:
        box = self.box
        while self.failed and box is not None:
            seq = self.failed[0].seq
            word = box.output_word()
            if not reached(word, previous_seq(seq)):
                return
            if self.failed[0].program and box.program_output_word() != 0:  # (an earlier run's graph sets it back to 0 last)
                return
            if not reached(word, seq):
                box.set_output_word(seq)
            if self.failed[0].program:  # (its graph waits on the program output word, call by call)
                box.release_program(output=True)
            self.failed.pop(0)

    def take(self) -> int:
        """Takes every reply on the mailbox's ring and releases what it can; returns how many came."""
        with self.lock:
            return self._take()

    def _take(self) -> int:
        n = 0
        while self.box is not None and (raw := self.box.replies.pop()) is not None:
            self._answer(pb.CallReply.FromString(raw))
            n += 1
        self._release()
        return n

    def collect(self, sleep, keep: int | None = None) -> None:
        """Takes the replies. keep=None: those that came; else waits until at most `keep` calls
        are unanswered. Raises the first failure among them once our GPU's wait for each failed
        call is released. sleep(box, bell_seq, timeout_us) waits for the next reply (and raises
        when the executor is gone)."""
        while True:
            with self.lock:
                box = self.box
                seq = box.reply_bell.seq()
                got = self._take()
                failure = self._take_failure()
                done = not self.failed and (keep is None or len(self) <= keep)
                failed = bool(self.failed)
            if failure is not None:
                raise failure
            if done:
                return
            if not got:  # a failed call waits for its predecessor's result, not for a reply
                sleep(box, seq, RELEASE_POLL_US if failed else LIVENESS_SLICE_US)

    def wait_reply(self, call_id: int, sleep) -> pb.CallReply:
        """Waits for the reply of a call that returns only with it (it is not one of these),
        taking the others' replies meanwhile; sleep as for collect."""
        self.await_reply(call_id)
        while True:
            with self.lock:
                box = self.box
                seq = box.reply_bell.seq()
                while self.awaited_reply is None and (raw := box.replies.pop()) is not None:
                    self._answer(pb.CallReply.FromString(raw))  # (False: a stale reply of an abandoned call)
                reply, failed = self.awaited_reply, bool(self.failed)
                if reply is not None:
                    self.awaited, self.awaited_reply = 0, None
                    return reply
                self._release()  # (a failed earlier call's wait may hold this call's input back)
            sleep(box, seq, RELEASE_POLL_US if failed else LIVENESS_SLICE_US)

    def take_failure(self) -> Exception | None:
        """The earliest call's failure, once every failed call is released (then forgotten)."""
        with self.lock:
            return self._take_failure()

    def _take_failure(self) -> Exception | None:
        if self.failed or self.failure is None:
            return None
        (_, failure), self.failure = self.failure, None
        return failure

    def watch(self, seq: int, executor_alive, tag=None) -> bool:
        """The watchdog's look: when our GPU may still wait for the output word to reach `seq`,
        takes the replies that came and releases failed calls; when the executor is gone or has
        detached us (executor_alive() False), writes `seq` to the word, since no result comes
        any more, and returns True. Nothing when `tag` is not the bound mailbox's (the watchdog
        read `seq` for a mailbox that a grow has replaced since)."""
        with self.lock:
            box = self.box
            if box is None or tag is not self.tag or reached(box.output_word(), seq):
                return False
            try:
                self._take()
            except Exception:  # (a corrupt ring: the caller's next call meets it)
                pass
            if box.detached or not executor_alive():
                box.set_output_word(seq)
                box.release_program(output=True)  # (a step program's run in flight: its waits go too)
                return True
            return False

    def release_every(self, seq: int) -> None:
        """Writes `seq` to the output word unless it has reached it (no result comes for the
        calls up to it), and lets step programs' runs go."""
        with self.lock:
            if self.box is not None and not reached(self.box.output_word(), seq):
                self.box.set_output_word(seq)
            if self.box is not None:  # (every time: each step program's run queued sets its word back to 0)
                self.box.release_program(output=True)
