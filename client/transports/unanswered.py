"""Calls that returned before the executor answered them, until their replies come.

A same-GPU call returns as soon as it is sent: the tenant's stream waits on the GPU for the
mailbox's output word, which the executor's stream writes once the result is in place, so
neither host waits for the other. The replies (statuses) come later and are taken here.

A call that failed (a status other than OK) got no result and the executor does not write the
output word for it, so nothing would release the tenant GPU's wait for it. The
tenant writes the output word itself, in call order and only once the previous call's result is
in (the word has reached it): an earlier call's read is never let through before its result.
Its failure is raised once that is done, at the next call or at the next confirm().
"""
from __future__ import annotations

import bisect
import collections
import dataclasses

import torch

from client.errors import InternalError, error_for_status
from proto import codec
from proto import executor_pb2 as pb
from proto.cuda_ipc import reached

LIVENESS_SLICE_US = 200_000  # how long a wait sleeps before it looks whether the executor is alive
RELEASE_POLL_US = 1000  # how often a failed call's release looks at the output word


@dataclasses.dataclass(slots=True)
class Sent:
    call_id: int
    seq: int  # the call's input_seq: the output word reaches it with the result
    unit: str
    op: int
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype

    @property
    def what(self) -> str:
        return call_name(self.unit, self.op)


def call_name(unit: str, op: int) -> str:
    """What a call was, for its errors: "FORWARD of 'model.layers.0.self_attn.q_proj'"."""
    name = pb.Op.Name(op) if op in pb.Op.values() else f"op {op}"
    return f"{name} of {unit!r}"


def reply_error(reply: pb.CallReply, what: str, out_shape: tuple[int, ...], out_dtype: torch.dtype) -> Exception | None:
    """The error a call's reply says (its status, or a result other than the one asked for); None if OK."""
    failure = error_for_status(reply.status, what)
    if failure is None and (tuple(reply.shape) != tuple(out_shape) or codec.TORCH_OF.get(reply.dtype) is not out_dtype):
        failure = InternalError(
            f"{what}: executor returned {list(reply.shape)} {reply.dtype}, expected {list(out_shape)} {out_dtype}"
        )
    return failure


def previous_seq(seq: int) -> int:
    """The input_seq of the call before `seq` (they count 1 .. 2**32 - 1, then wrap to 1)."""
    return (seq - 2) % 0xFFFFFFFF + 1


class Unanswered:
    def __init__(self):
        self.sent: collections.deque[Sent] = collections.deque()  # in call order
        self.failed: list[Sent] = []  # answered with a failure, output word not written yet; call order
        self.failure: tuple[int, Exception] | None = None  # (call id, error) of the earliest failure not raised yet

    def __len__(self) -> int:
        return len(self.sent)

    @property
    def busy(self) -> bool:
        """Whether anything is left to take or to release."""
        return bool(self.sent or self.failed or self.failure)

    def add(self, sent: Sent) -> None:
        self.sent.append(sent)

    def add_failed(self, sent: Sent) -> None:
        """A call whose failure its caller raises itself (it waited for its reply, or was never
        sent): only its output word is left to write."""
        bisect.insort(self.failed, sent, key=lambda s: s.call_id)

    def answer(self, reply: pb.CallReply) -> bool:
        """Takes a reply; False when it answers none of these calls."""
        if self.sent and self.sent[0].call_id == reply.call_id:  # replies mostly come in call order
            sent = self.sent[0]
        else:
            sent = next((s for s in self.sent if s.call_id == reply.call_id), None)
        if sent is None and reply.call_id == 0 and self.sent:  # a request that did not parse: the oldest
            sent = self.sent[0]
        if sent is None:
            return False
        if sent is self.sent[0]:
            self.sent.popleft()
        else:
            self.sent.remove(sent)
        failure = reply_error(reply, sent.what, sent.out_shape, sent.out_dtype)
        if failure is not None:
            if reply.status.code != pb.OK:  # (a call run with a result other than asked for had its word written)
                bisect.insort(self.failed, sent, key=lambda s: s.call_id)
            if self.failure is None or sent.call_id < self.failure[0]:
                self.failure = (sent.call_id, failure)
        return True

    def release(self, box) -> None:
        """Writes the output word for each failed call whose previous call's result is in
        (`box`: the mailbox, proto.mailbox.Mailbox)."""
        while self.failed:
            seq = self.failed[0].seq
            word = box.output_word()
            if not reached(word, previous_seq(seq)):
                return
            if not reached(word, seq):
                box.set_output_word(seq)
            self.failed.pop(0)

    def take(self, box) -> int:
        """Takes every reply on the mailbox's ring and releases what it can; returns how many came."""
        n = 0
        while (raw := box.replies.pop()) is not None:
            self.answer(pb.CallReply.FromString(raw))
            n += 1
        self.release(box)
        return n

    def collect(self, box, sleep, keep: int | None = None) -> None:
        """Takes the replies. keep=None: those that came; else waits until at most `keep` calls
        are unanswered. Raises the first failure among them once our GPU's wait for each failed
        call is released. sleep(box, bell_seq, timeout_us) waits for the next reply (and raises
        when the executor is gone)."""
        while True:
            seq = box.reply_bell.seq()
            got = self.take(box)
            failure = self.take_failure()
            if failure is not None:
                raise failure
            if not self.failed and (keep is None or len(self) <= keep):
                return
            if not got:  # a failed call waits for its predecessor's result, not for a reply
                sleep(box, seq, RELEASE_POLL_US if self.failed else LIVENESS_SLICE_US)

    def take_failure(self) -> Exception | None:
        """The earliest call's failure, once every failed call is released (then forgotten)."""
        if self.failed or self.failure is None:
            return None
        (_, failure), self.failure = self.failure, None
        return failure

    def abandon(self) -> None:
        """Forgets everything (the executor is gone or the mailbox goes)."""
        self.sent.clear()
        self.failed.clear()
        self.failure = None
