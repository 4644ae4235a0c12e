"""S6 pieces: the tenant's host time per same-GPU call, and what each step of it costs alone.

A call returns before its reply, so its host time is what gates a tenant whose host runs
ahead of its GPU (decode). This times, on the executor's GPU (1 token x hidden 2048, bf16):
a whole call through the transport (`t.call`) and through a shim (`q_proj(x)`), and each step
a call makes, alone: building and serialising the request, finding the current stream, the
copy into the mailbox, a word write and a word wait, the copy out (each through the native
extension csrc/stream_ops.cpp, and through its slow twins: torch's copies and ctypes), and a
plain torch op for scale. The whole call is timed twice: with the native extension, and with
it switched off (ctypes for the driver calls). Medians of host time; the GPU is synchronised only
between rounds.

    python benchmarks/probes/s6_call_pieces.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for s6_transport
from s6_transport import HIDDEN, UNIT, make_model, serve  # noqa: E402


def host_us(fn, n: int) -> float:
    """Median host time of fn over n calls, synchronising every 32 calls (outside the timing)."""
    times = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        if i % 32 == 31:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def main() -> int:
    from symbiont import connect, virtualize
    from symbiont.proto import codec
    from symbiont.proto import executor_pb2 as pb
    import symbiont.proto.cuda_ipc as cuda_ipc
    from symbiont.proto.cuda_ipc import copy_async, map_host_words, stream_wait, stream_write

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    dev = torch.device("cuda:0")
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp)
        url = f"local://s6p-{os.getpid()}"
        proc = serve(tmp, url, "cuda:0", "bfloat16", None)
        try:
            conn = connect(url)
            conn.ensure_attached(dev)
            t = conn.transport
            x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device=dev)
            shape = (1, HIDDEN)

            def call():
                t.call(UNIT, pb.FORWARD, x, shape, torch.bfloat16, pb.INFERENCE)

            native = cuda_ipc._native
            for name, ops in (("native", native), ("ctypes", None)):
                cuda_ipc._native = ops
                for _ in range(50):
                    call()
                t.confirm()
                rows[f"call through the transport (returns early), {name}"] = host_us(call, a.calls)
                t.confirm()
            cuda_ipc._native = native
            if native is None:
                print("the native extension proto._stream_ops is not built or finds no driver: rows marked native are ctypes")

            from transformers import AutoModelForCausalLM

            model = virtualize(AutoModelForCausalLM.from_pretrained(tmp).to(dev, torch.bfloat16), conn)
            q_proj = model.model.layers[0].self_attn.q_proj
            with torch.no_grad():
                rows["call through a shim: q_proj(x), no grad"] = host_us(lambda: q_proj(x), a.calls)
            t.confirm()

            n = 0

            def request():
                nonlocal n
                n += 1
                pb.CallRequest(unit=UNIT, op=pb.FORWARD, dtype=codec.dtype_enum(torch.bfloat16), shape=[1, HIDDEN],
                               latency=pb.INFERENCE, call_id=n, in_offset=0, out_offset=4096, input_seq=n).SerializeToString()

            rows["build and serialise the request"] = host_us(request, a.calls)
            rows["torch.cuda.current_stream(device)"] = host_us(lambda: torch.cuda.current_stream(dev), a.calls)
            rows["its raw handle: torch._C._cuda_getCurrentRawStream(index)"] = host_us(
                lambda: torch._C._cuda_getCurrentRawStream(dev.index), a.calls)
            area = t._order.region
            inp, out = area.view(0, shape, torch.bfloat16), area.view(8192, shape, torch.bfloat16)
            s = torch.cuda.current_stream(dev).cuda_stream
            nbytes = x.numel() * x.element_size()
            rows["copy into the mailbox, torch (copy_)"] = host_us(lambda: inp.copy_(x), a.calls)
            rows["copy into the mailbox, native (cuMemcpyAsync)"] = host_us(lambda: copy_async(area.ptr, x.data_ptr(), nbytes, s, dev), a.calls)
            rows["copy out of the mailbox, torch (clone)"] = host_us(lambda: out.clone(), a.calls)

            def empty_and_copy():
                y = torch.empty(shape, dtype=torch.bfloat16, device=dev)
                copy_async(y.data_ptr(), area.ptr + 8192, nbytes, s, dev)

            rows["copy out of the mailbox, native (empty + cuMemcpyAsync)"] = host_us(empty_and_copy, a.calls)
            page = mmap.mmap(-1, mmap.PAGESIZE)
            word = map_host_words(dev, torch.frombuffer(page, dtype=torch.uint8).data_ptr(), mmap.PAGESIZE)
            for name, ops in (("native", native), ("ctypes", None)):
                cuda_ipc._native = ops
                rows[f"word write (cuStreamWriteValue32), {name}"] = host_us(lambda: stream_write(s, word, 0), a.calls)
                rows[f"word wait, already reached (cuStreamWaitValue32), {name}"] = host_us(lambda: stream_wait(s, word, 0), a.calls)
            cuda_ipc._native = native
            rows["torch.add of one token (a plain op)"] = host_us(lambda: torch.add(x, 1), a.calls)
            conn.close()
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\nS6 pieces: tenant host time per step, median us, 1 token x {HIDDEN} bf16, {torch.cuda.get_device_name(dev)}")
    for name, us in rows.items():
        print(f"{name:58s} {us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
