"""A step program's word writes and waits inside a CUDA graph (client/transports/local_programs.py).

The CUDA driver's stream memory operations, which order a call's steps on our GPU otherwise
(cuStreamWriteValue32, cuStreamWaitValue32), invalidate a stream capture (benchmarks/RESULTS.md,
session 47: benchmarks/probes/graphed_step.py). Inside a graph the words are written and waited on
by one-thread kernels instead: `write` stores the value; `wait` spins on a volatile load until the
word reaches the value (an int32 `>=`: program words count 1, 2, ... from 0 and are released with
0x7FFFFFFF). The mailbox's words page is page-locked host memory mapped for our GPU; `page` is an
int32 CUDA tensor over that mapping. Triton is imported at the first use.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # (no specialisation on the values: one compiled kernel serves every call's number)
    @triton.jit(do_not_specialize=["index", "value"])
    def write(page, index, value):
        tl.store(page + index, value)

    @triton.jit(do_not_specialize=["index", "value"])
    def wait(page, index, value):
        word = tl.load(page + index, volatile=True)
        while word < value:
            word = tl.load(page + index, volatile=True)

    return write, wait


def warm(page: torch.Tensor, index: int) -> None:
    """Compiles and loads both kernels outside a capture (which may not load a module): writes 0
    to page[index] and waits for it, on the current stream."""
    write(page, index, 0)
    wait(page, index, 0)


def write(page: torch.Tensor, index: int, value: int) -> None:
    """Queues on the current stream: page[index] = value (int32)."""
    _kernels()[0][(1,)](page, index, value)


def wait(page: torch.Tensor, index: int, value: int) -> None:
    """Queues on the current stream a wait until page[index] >= value (int32)."""
    _kernels()[1][(1,)](page, index, value)
