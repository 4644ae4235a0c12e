"""A tenant on cuda:0 whose input copy cannot start: alone on the executor, its call is taken at
once and the executor's GPU waits for the input. Prints "called" and lingers (the test kills it
while the executor's stream still waits).

argv[2] says what holds the copy back: "wait" (default), a GPU wait on a word nobody writes, or
"kernel", ~10 s of GPU sleep. Under MPS, a process killed while its kernel runs may fault the
other processes on the GPU (README), so the test uses "wait"."""
import mmap
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from symbiont.proto import executor_pb2 as pb  # noqa: E402
from symbiont.proto.cuda_ipc import map_host_words, stream_wait  # noqa: E402
from tests.jobs import gpu_tenant_and_input  # noqa: E402

UNIT = "model.layers.0.mlp.down_proj"
conn, x = gpu_tenant_and_input(sys.argv[1], UNIT)
if (sys.argv[2] if len(sys.argv) > 2 else "wait") == "kernel":
    torch.cuda._sleep(20_000_000_000)
else:
    page = mmap.mmap(-1, mmap.PAGESIZE)
    word = map_host_words(torch.device("cuda:0"), torch.frombuffer(page, dtype=torch.uint8).data_ptr(), mmap.PAGESIZE)
    stream_wait(torch.cuda.current_stream().cuda_stream, word, 1)  # never written
conn.transport.call(UNIT, pb.FORWARD, x, (3, 64), torch.float32, pb.INFERENCE)
print("called", flush=True)
time.sleep(120)
