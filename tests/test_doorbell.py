"""The csrc rings and doorbells: ordering, bounds, corruption, and waking another process."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from symbiont.proto import mailbox
from symbiont.proto._doorbell import Doorbell, Ring


def region(size=1 << 16):
    fd, mem = mailbox.create_region("test", size)
    return fd, mem


def test_ring_fifo_full_and_empty():
    fd, mem = region()
    r = Ring(mem, 0, 4, 64)
    assert r.pop() is None
    for i in range(4):
        assert r.push(bytes([i]) * (i + 1))
    assert not r.push(b"x")  # full
    assert [r.pop() for _ in range(4)] == [b"\x00", b"\x01\x01", b"\x02\x02\x02", b"\x03" * 4]
    assert r.pop() is None and r.pending() == 0
    with pytest.raises(ValueError):
        r.push(b"x" * 61)  # payload is slot_size - 4
    os.close(fd)


def test_corrupt_indices_and_lengths_raise_not_crash():
    fd, mem = region()
    r = Ring(mem, 0, 4, 64)
    mem[0:8] = (1000).to_bytes(8, "little")  # head far ahead of tail
    with pytest.raises(ValueError, match="corrupt"):
        r.pop()
    r.reset()
    assert r.push(b"ok")
    mem[128:132] = (10_000).to_bytes(4, "little")  # length prefix beyond the slot
    with pytest.raises(ValueError, match="corrupt"):
        r.pop()
    os.close(fd)


def test_region_bounds_are_checked():
    fd, mem = region(4096)
    with pytest.raises(Exception, match="does not fit"):
        Ring(mem, 0, 64, 512)
    os.close(fd)


def test_sealed_region_cannot_be_resized():
    fd, mem = region(4096)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 1024)
    os.close(fd)


def test_wait_times_out_and_returns_same_seq():
    fd, mem = region()
    bell = Doorbell(mem, 0)
    seq = bell.seq()
    t0 = time.monotonic()
    assert bell.wait(seq, 10, 50_000) == seq
    assert 0.04 < time.monotonic() - t0 < 2.0
    os.close(fd)


def test_spin_never_outlasts_the_timeout():
    # the executor polls a held GPU call on a short timeout while spinning long on its wake word
    fd, mem = region()
    bell = Doorbell(mem, 0)
    seq = bell.seq()
    t0 = time.monotonic()
    assert bell.wait(seq, 3_000_000, 20_000) == seq
    assert time.monotonic() - t0 < 1.5
    os.close(fd)


def _ringer(pid, fd, size, delay):
    mem = mailbox.open_region(pid, fd, size)
    r = Ring(mem, 0, 8, 64)
    time.sleep(delay)
    r.push(b"hello from another process")
    Doorbell(mem, 4096).ring()


def test_wakes_a_sleeping_process():
    fd, mem = region()
    r = Ring(mem, 0, 8, 64)
    bell = Doorbell(mem, 4096)
    seq = bell.seq()
    p = mp.get_context("spawn").Process(target=_ringer, args=(os.getpid(), fd, 1 << 16, 0.3))
    p.start()
    got = bell.wait(seq, 10, 30_000_000)  # sleeps in the futex until the other process rings
    assert got != seq
    assert r.pop() == b"hello from another process"
    p.join(10)
    assert p.exitcode == 0
    os.close(fd)


def test_split_request_finds_the_header_a_native_call_writes():
    """proto._stream_ops.split_request (the executor's native lane keys calls by their header):
    a request as the tenant's Lane.send writes it, a header then call_id and input_seq, splits
    into those; the header parsed and serialised again is the header itself; a request of any
    other shape is not split (Python serves it)."""
    import random

    from symbiont.proto import executor_pb2 as pb
    from symbiont.proto._stream_ops import split_request

    header = pb.CallRequest(unit="model.layers.0.mlp", op=pb.FORWARD, dtype=pb.BFLOAT16, shape=[2, 7, 64], out_offset=2048,
                            latency=pb.INFERENCE).SerializeToString()
    for call_id, seq in ((1, 1), (300, 0xFFFFFFFF), (1 << 40, 128)):
        raw = header + pb.CallRequest(call_id=call_id, input_seq=seq).SerializeToString()
        assert split_request(raw) == (len(header), call_id, seq)
        again = pb.CallRequest.FromString(raw)
        assert (again.call_id, again.input_seq) == (call_id, seq)
        again.ClearField("call_id")
        again.ClearField("input_seq")
        assert again.SerializeToString() == header
    whole = pb.CallRequest(call_id=5, unit="u", op=pb.FORWARD, shape=[1, 64], input_seq=3).SerializeToString()
    tail = pb.CallRequest(call_id=5, input_seq=3).SerializeToString()
    for raw in (
        whole,  # call_id first, input_seq last: Python serialised it
        header + pb.CallRequest(call_id=5).SerializeToString(),  # no input_seq
        header + pb.CallRequest(call_id=5, input_seq=3).SerializeToString() + b"\x10\x01",  # something after it
        header + tail[:-1],  # cut short
        header[:-1] + tail,  # a header cut short
        b"",
        tail[2:],
    ):
        assert split_request(raw) is None, raw
    rng = random.Random(0)
    for _ in range(2000):  # never reads past the message, whatever it holds
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        got = split_request(raw)
        assert got is None or got[0] < len(raw)
