"""A step program's word writes and waits inside a CUDA graph (client/transports/local_programs.py).

The CUDA driver's stream memory operations, which order a call's steps on our GPU otherwise
(cuStreamWriteValue32, cuStreamWaitValue32), invalidate a stream capture (benchmarks/RESULTS.md,
session 47: benchmarks/probes/graphed_step.py). Inside a graph the words are written and waited on
by one-program kernels instead: `write` stores the value; `wait` (SPIN_WARPS warps) spins on a volatile load until the
word reaches the value (an int32 `>=`: program words count 1, 2, ... from 0 and are released with
0x7FFFFFFF). The mailbox's words page is page-locked host memory mapped for our GPU; `page` is an
int32 CUDA tensor over that mapping. Triton is imported at the first use.

Fused handovers (`FUSED_HANDOVER`, off: exact on the GPU, but 16 tenants decoded at a quarter of
the four nodes' pace in session 51, when every thread of 16 warps of a waiting `take` spun; it spins
with SPIN_WARPS now): a call's four graph nodes (the
copy of its input into the mailbox, the word write, the wait, the copy of its result out) become
two kernels of one program each. `put` copies the input, then (every thread's stores before it:
a barrier, then one thread's system-scope release store, as CUTLASS's semaphores release) writes
the word; `take` spins on the word, then (each thread's acquire fence after its relaxed loads)
copies the result out. On a GPU the fences are inline PTX; Triton's CPU interpreter, which runs
no PTX, copies and writes without them (its kernels run one after another anyway).
"""
from __future__ import annotations

import functools

import torch

from symbiont.proto.cuda_ipc import runs_ptx


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # (no specialisation on the values: one compiled kernel serves every call's number)
    @triton.jit(do_not_specialize=["index", "value", "dindex"])
    def write(page, index, value, dev, dindex, DEV: tl.constexpr):
        tl.store(page + index, value)
        if DEV:  # (and the device word, where the executor's GPU looks)
            tl.store(dev + dindex, value)

    # (a wait's looks, written out in wait and take: a jit function defined here, in a closure, is
    # not one every Triton version calls) With DEV the word looked at is the device word, and every
    # EVERY turns the host's beside it, for a release (RELEASED); NAP ns between looks.
    @triton.jit(do_not_specialize=["index", "value", "dindex"])
    def wait(page, index, value, dev, dindex, NAP: tl.constexpr, DEV: tl.constexpr, EVERY: tl.constexpr):
        if DEV:
            at = dev + dindex
        else:
            at = page + index
        word = tl.load(at, volatile=True)
        turn = 0
        while word < value:
            if NAP > 0:
                tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r",
                                          [tl.zeros([32], dtype=tl.int32) + NAP], dtype=tl.int32, is_pure=False, pack=1)
            word = tl.load(at, volatile=True)
            if DEV:
                turn += 1
                if turn % EVERY == 0:  # (only a release passes: the host's word may be stale)
                    word = tl.where(tl.load(page + index, volatile=True) == 0x7FFFFFFF, value, word)

    # (no specialisation on the addresses' alignment or the sizes: the kernels warm() compiles serve every call)
    @triton.jit(do_not_specialize=["page", "index", "value", "dst", "src", "n", "dev", "dindex"],
                do_not_specialize_on_alignment=["page", "dst", "src", "dev"])
    def put(page, index, value, dst, src, n, dev, dindex, BLOCK: tl.constexpr, THREADS: tl.constexpr, ASM: tl.constexpr,
            DEV: tl.constexpr):
        i = tl.arange(0, BLOCK)
        for at in range(0, n, BLOCK):
            m = at + i < n
            tl.store(dst + at + i, tl.load(src + at + i, mask=m), mask=m)
        tl.debug_barrier()  # (every thread's copy, then one thread's release of the word, and of the device word)
        if ASM:
            for j in tl.static_range(2 if DEV else 1):  # (the host's word, then the device word)
                if j == 0:
                    word = page + index
                else:
                    word = dev + dindex
                tl.inline_asm_elementwise(
                    "{ .reg .pred %p; .reg .b32 %t; mov.u32 %t, %tid.x; setp.eq.u32 %p, %t, 0; "
                    "@%p st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0; }",
                    "=r,l,r", [word + tl.zeros([THREADS], dtype=tl.int32), value + tl.zeros([THREADS], dtype=tl.int32)],
                    dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.store(page + index, value)
            if DEV:
                tl.store(dev + dindex, value)

    @triton.jit(do_not_specialize=["page", "index", "value", "dst", "src", "n", "dev", "dindex"],
                do_not_specialize_on_alignment=["page", "dst", "src", "dev"])
    def take(page, index, value, dst, src, n, dev, dindex, BLOCK: tl.constexpr, THREADS: tl.constexpr, ASM: tl.constexpr,
             DEV: tl.constexpr, EVERY: tl.constexpr):
        if DEV:  # (the looks as wait's)
            at = dev + dindex
        else:
            at = page + index
        word = tl.load(at, volatile=True)
        turn = 0
        while word < value:
            word = tl.load(at, volatile=True)
            if DEV:
                turn += 1
                if turn % EVERY == 0:  # (only a release passes: the host's word may be stale)
                    word = tl.where(tl.load(page + index, volatile=True) == 0x7FFFFFFF, value, word)
        if ASM:  # (a relaxed load that saw the value, then a fence: each thread's acquire)
            tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [tl.zeros([THREADS], dtype=tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        i = tl.arange(0, BLOCK)
        for at in range(0, n, BLOCK):
            m = at + i < n
            tl.store(dst + at + i, tl.load(src + at + i, mask=m), mask=m)

    # (in Triton's CPU interpreter put and take go without fences)
    return write, wait, put, take, runs_ptx(put)


FUSED_HANDOVER = False
"""Whether a step program's calls hand over with `put` and `take` (two kernels a call) instead of
a copy, a write, a wait and a copy (client/transports/local_programs.py). Off: exact on a GPU, but
slower with many tenants (the module's docstring)."""
SPIN_WARPS = 1
"""Warps of `wait`'s and `take`'s one program: each spins on the word, host memory its loads read
across PCIe (benchmarks/fleet_worker.py --spin-warps). One: S3 at N = 16 gave 1.36x the tokens/s
of four, with the executor's waits one warp too (session 52, call 1). Set before the first call
(warm compiles for it)."""
SPIN_NAP_NS = 0
"""Nanoseconds `wait` sleeps between its looks at the word (fleet_worker --spin-nap-ns; 0: none).
Set before the first call."""
HOST_LOOK_EVERY = 64  # a wait on a device word looks at the host's word beside it once in this many turns
MAX_FUSED_BYTES = 1 << 16  # a call's input or result that one program copies, at most (larger: the four nodes)
_WARPS = 16  # put's (it does not spin)
_WORDS_A_THREAD = 8  # int32 words each thread copies at a time (one program: its release needs every thread's copy first)


def warm(page: torch.Tensor, index: int, dev: tuple | None = None) -> None:
    """Compiles and loads the kernels outside a capture (which may not load a module): writes 0
    to page[index] and waits for it, on the current stream (with FUSED_HANDOVER: through put and
    take too, copying one word of the page onto itself); with `dev` (a device word: (tensor,
    index)), the kernels that write and look at it too."""
    for d in (None, dev) if dev is not None else (None,):
        write(page, index, 0, d)
        wait(page, index, 0, d)
        if FUSED_HANDOVER:
            one = page[index:index + 1]
            put(page, index, 0, one, one, d)
            take(page, index, 0, one, one, d)


def put(page: torch.Tensor, index: int, value: int, dst: torch.Tensor, src: torch.Tensor, dev: tuple | None = None) -> None:
    """Queues on the current stream: dst = src (int32 words, contiguous), then page[index] = value
    (then the device word `dev`, (tensor, index), too), released to the system (the executor's GPU
    wait sees the word only after the data)."""
    kernels = _kernels()
    d, di = dev if dev is not None else (page, index)
    kernels[2][(1,)](page, index, value, dst, src, src.numel(), d, di, BLOCK=32 * _WARPS * _WORDS_A_THREAD,
                     THREADS=32 * _WARPS, ASM=kernels[4], DEV=dev is not None, num_warps=_WARPS)


def take(page: torch.Tensor, index: int, value: int, dst: torch.Tensor, src: torch.Tensor, dev: tuple | None = None) -> None:
    """Queues on the current stream: a wait until page[index] >= value (SPIN_WARPS warps spinning;
    with `dev`, the device word, and page[index] for RELEASED every HOST_LOOK_EVERY turns), then dst = src
    (int32 words)."""
    kernels = _kernels()
    d, di = dev if dev is not None else (page, index)
    kernels[3][(1,)](page, index, value, dst, src, src.numel(), d, di, BLOCK=32 * SPIN_WARPS * _WORDS_A_THREAD,
                     THREADS=32 * SPIN_WARPS, ASM=kernels[4], DEV=dev is not None, EVERY=HOST_LOOK_EVERY,
                     num_warps=SPIN_WARPS)


def words(t: torch.Tensor) -> torch.Tensor | None:
    """t's bytes as int32 words, or None where put and take do not copy it (codec.int32_words: not
    contiguous, not of whole aligned words, or over MAX_FUSED_BYTES)."""
    from symbiont.proto.codec import int32_words

    return int32_words(t, MAX_FUSED_BYTES)


def write(page: torch.Tensor, index: int, value: int, dev: tuple | None = None) -> None:
    """Queues on the current stream: page[index] = value (int32), then the device word `dev`
    ((tensor, index)) too."""
    d, di = dev if dev is not None else (page, index)
    _kernels()[0][(1,)](page, index, value, d, di, DEV=dev is not None)


def wait(page: torch.Tensor, index: int, value: int, dev: tuple | None = None) -> None:
    """Queues on the current stream a wait until page[index] >= value (int32); with `dev`
    ((tensor, index)), until the device word does, or page[index] is RELEASED at a look every
    HOST_LOOK_EVERY turns."""
    d, di = dev if dev is not None else (page, index)
    _kernels()[1][(1,)](page, index, value, d, di, NAP=SPIN_NAP_NS, DEV=dev is not None, EVERY=HOST_LOOK_EVERY,
                        num_warps=SPIN_WARPS)
