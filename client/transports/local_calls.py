"""The calls of the same-host transport (`local://NAME`), tenant side: the plan every call of one
unit, op and input shape shares on a mailbox (the request's serialised fields, where its input
and result go), and the same-GPU call made in one native call (proto._stream_ops.Lane): the copy
in, the input word, the request, the executor's doorbell and our stream's wait for the result.
A mixin of LocalTransport (client/transports/local.py), which owns the mailbox, the replies and
the slow path."""
from __future__ import annotations

import dataclasses
import warnings

import torch

from symbiont.client.errors import InternalError
from symbiont.client.transports.unanswered import Sent
from symbiont.client.transports.words import StreamOrder
from symbiont.proto import codec, mailbox

TAKE_EVERY = 16  # a native call takes the replies that came once this many calls are unanswered
MAX_UNANSWERED = 32  # calls sent before the replies of some are waited for (the rings hold 64)
MAX_PLANS = 256  # call plans kept per mailbox (sequence lengths vary)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What every call of one unit, op, input shape and dtype shares on one mailbox."""

    header: bytes  # its CallRequest without call_id and input_seq, serialised
    in_nbytes: int  # the input's bytes, at the data area's start
    out: torch.Tensor  # where its result lands: a view of the data area


class LocalCalls:
    """Plans and native calls of LocalTransport; `self` is the LocalTransport."""

    def _plan(self, key: tuple, x: torch.Tensor) -> Plan:
        """The plan of the calls of `key` on this mailbox, made once (after growing the data area
        when it cannot hold their input and result)."""
        unit, op, _, dtype, latency, out_shape, out_dtype = key
        in_nbytes = x.numel() * x.element_size()
        out_offset = mailbox.align(in_nbytes)
        need = out_offset + codec.nbytes(out_shape, out_dtype)
        if need > self._data_bytes:
            self._collect(keep=0)  # the grown mailbox replaces this one: every call on it answered first
            self._grow(need)
        header = self._request(unit, op, x, latency)
        header.out_offset = out_offset
        area = self._order.region if self._order is not None else self._box
        plan = Plan(header.SerializeToString(), in_nbytes, area.view(out_offset, out_shape, out_dtype))
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _send(self, x: torch.Tensor, plan: Plan, key: tuple, take, call_id: int):
        """A call from our GPU (the executor's, or a peer) in one native call (proto._stream_ops.Lane): the copy in,
        the input word, the request, the executor's doorbell, and our stream's wait for the
        result; then the copy out, queued behind that wait. Its reply is taken later."""
        order, unanswered, lane = self._order, self._unanswered, self._lane
        if not x.is_contiguous():
            x = x.contiguous()
        stream = order.current_stream()
        if stream != order.stream:
            order.follow(stream)
        seq = 0
        try:
            seq = order.seq = order.seq % 0xFFFFFFFF + 1  # (never 0, which means "no word")
            unanswered.add(Sent(call_id, seq, key[0], key[1], key[5], key[6]))
            rc = lane.send(x.data_ptr(), plan.in_nbytes, stream, plan.header, call_id, seq)
            if rc < 0:
                raise InternalError("request ring full: another thread is using this tenant's transport without its lock")
            if rc:  # sent, but the wait for its result was not queued (its reply is taken later)
                order.wait_result(stream, seq)
            self._deciding = False  # (its wait is queued: a joining sibling reads its sequence now)
        except BaseException:  # (an interrupt too, raised as the native call returns)
            if seq:
                self._interrupted(lane, call_id, seq, stream)
            raise
        result = self._take(plan.out, stream, take)
        if len(unanswered) >= TAKE_EVERY:
            self._collect(keep=MAX_UNANSWERED // 2 if len(unanswered) >= MAX_UNANSWERED else None)
        return result

    def _take(self, out: torch.Tensor, stream: int, take):
        """The result of a call from our GPU, in place at `out` (a view of the data area), copied
        on `stream` behind its wait for the result; or what take() makes of it."""
        order = self._order
        if order.peer:  # on our GPU first
            y = order.copy_out(out, stream)
            return y if take is None else take(y)
        return out.clone() if take is None else take(out)  # (clone: S6 pieces, faster than empty + copy_async)

    def _interrupted(self, lane, call_id: int, seq: int, stream: int) -> None:
        """A native call that raised: one whose request never went has its output word written in
        call order (nobody else writes it); one that went is taken with the other unanswered
        calls, and our stream still waits for its result (the next call's copy in must not
        overwrite the input its GEMM reads)."""
        if lane.pushed != seq:
            self._unanswered.forget(call_id)
            self._release_failed(call_id, seq)
        elif lane.waited != seq:
            try:
                self._order.wait_result(stream, seq)
            except Exception:  # (the error being raised says more)
                pass


def native_lane(box: mailbox.Mailbox, order: StreamOrder, wake_mem, url: str):
    """The native call path of a mailbox whose calls order on our GPU by words, where the native
    stream operations are built and the CUDA driver is there (else None: calls make their steps
    from Python)."""
    from symbiont.proto.cuda_ipc import native_ops

    ops = native_ops()
    if ops is None:
        return None
    try:
        return ops.Lane(box.mem, mailbox.REQUEST_RING_OFFSET, mailbox.RING_SLOTS, mailbox.RING_SLOT_SIZE, wake_mem,
                        order.region.ptr, order.words, order.out_word, order.device.index)
    except (RuntimeError, ValueError, TypeError) as e:  # (a native module of another version)
        warnings.warn(f"{url}: no native call path ({e}); calls make their steps from Python", RuntimeWarning, stacklevel=3)
        return None
