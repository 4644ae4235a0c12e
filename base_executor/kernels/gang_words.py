"""Kernels of a gang's round (base_executor/transports/gangs.py): the waits, word writes and row
copies of several tenants' step programs inside one CUDA graph.

A gang's graph must serve whichever of its tenants take part in a round, so nothing of a
tenant is in the graph itself: its words' and rows' addresses are in a table (int64, one row of
`width` addresses per slot), and a slot's number for the round is in `seqs` (int32, the run's
input_seq; 0: the slot sits the round out). Every kernel reads both when it runs.

- wait: one program spins (volatile loads) until each taking-part slot's word at column `col`
  reaches `value`, or the slot's own seq with `from_seq` (cyclic, as the driver's
  cuStreamWaitValue32 GEQ: word - value >= 0 as int32), loading again only the words still
  short. The words are mailbox words, page-locked host memory mapped for our GPU (released with
  0x7FFFFFFF), or with `serve --device-words` a program's words in the tenant's device region,
  whose host words (column `also`) a wait looks at every ALSO_EVERY turns for a release.
- write: stores `value` (or the slot's seq) to each taking-part slot's word at column `col` (and
  first at column `also`).
- gather: copies each taking-part slot's row (n int32 words at the address in column `col`) into
  row `slot` of a contiguous batch; scatter copies a batch's rows back out.
Triton is imported at the first use; `warm` compiles every kernel outside a capture.
"""
from __future__ import annotations

import functools

import torch

from symbiont.proto.codec import int32_words
from symbiont.proto.cuda_ipc import runs_ptx

COPY_BLOCK = 1024  # int32 words per program of a row copy
SPIN_WARPS = 1
"""Warps of a wait's one program (`serve --spin-warps`): each spins on the words, which are host
memory its loads read across PCIe. One: S3 at N = 16 gave 1,893.7 tokens/s with one-warp waits on
both sides against 1,393.2 with four (session 52, call 1). Set before `warm`."""
ALSO_EVERY = 64  # a wait on device words looks at their host words once in this many turns
SPIN_NAP_NS = 0
"""Nanoseconds a wait sleeps between its looks at the words (`serve --spin-nap-ns`; 0: none, it
looks again at once). Set before `warm`."""


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["width", "col", "also", "value", "slots"])
    def wait(table, width, col, also, seqs, value, slots, BLOCK: tl.constexpr, FROM_SEQ: tl.constexpr, NAP: tl.constexpr,
             ALSO: tl.constexpr, EVERY: tl.constexpr):
        i = tl.arange(0, BLOCK)
        seq = tl.load(seqs + i, mask=i < slots, other=0)
        on = seq != 0
        if FROM_SEQ:
            target = seq
        else:
            target = seq * 0 + value
        words = tl.load(table + i * width + col, mask=on, other=0).to(tl.pointer_type(tl.int32))
        word = tl.load(words, mask=on, other=0, volatile=True)
        # (a word that reached its target counts as reached: only the words still short are loaded
        # again, so each turn reads fewer words. It stays there until the round resets it, unless a
        # release is written over by a detached tenant's queued runs or an older seq, and then
        # passing, as the driver's cuStreamWaitValue32 would once it saw the release, is what the
        # release is for)
        short = on & ((word - target) < 0)
        turn = 0
        while tl.sum(short.to(tl.int32), axis=0) > 0:
            if NAP > 0:  # (the next look after NAP ns: fewer reads across PCIe, a later reaction)
                tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [seq * 0 + NAP], dtype=tl.int32,
                                          is_pure=False, pack=1)
            word = tl.load(words, mask=short, other=0, volatile=True)
            if ALSO:  # (device words: every EVERY turns a look at the host's word too, for a release)
                turn += 1
                if turn % EVERY == 0:
                    hosts = tl.load(table + i * width + also, mask=short, other=0).to(tl.pointer_type(tl.int32))
                    host = tl.load(hosts, mask=short, other=0, volatile=True)
                    word = tl.where(host == 0x7FFFFFFF, target, word)  # (only a release: the host's may be stale)
            short = short & ((word - target) < 0)

    @triton.jit(do_not_specialize=["width", "col", "also", "value", "slots"])
    def write(table, width, col, also, seqs, value, slots, BLOCK: tl.constexpr, FROM_SEQ: tl.constexpr,
              ALSO: tl.constexpr, ASM: tl.constexpr):
        i = tl.arange(0, BLOCK)
        seq = tl.load(seqs + i, mask=i < slots, other=0)
        on = seq != 0
        if FROM_SEQ:
            v = seq
        else:
            v = seq * 0 + value
        if ALSO:  # (the host's word beside a device word first, then a fence: a waiter that saw the
            # device word and sets both back finds the host's written already)
            hosts = tl.load(table + i * width + also, mask=on, other=0).to(tl.pointer_type(tl.int32))
            tl.store(hosts, v, mask=on)
            if ASM:
                tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [seq], dtype=tl.int32,
                                          is_pure=False, pack=1)
        words = tl.load(table + i * width + col, mask=on, other=0).to(tl.pointer_type(tl.int32))
        tl.store(words, v, mask=on)

    @triton.jit(do_not_specialize=["width", "col", "n"])
    def copy_rows(table, width, col, seqs, batch, n, BLOCK: tl.constexpr, GATHER: tl.constexpr):
        slot = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        on = (j < n) & ((j * 0 + tl.load(seqs + slot)) != 0)  # (a block, not a scalar: Triton's interpreter masks so)
        row = tl.load(table + slot * width + col).to(tl.pointer_type(tl.int32))
        mine = batch + slot.to(tl.int64) * n + j
        if GATHER:
            tl.store(mine, tl.load(row + j, mask=on), mask=on)
        else:
            tl.store(row + j, tl.load(mine, mask=on), mask=on)

    # (in Triton's CPU interpreter writes go without the fence, one kernel after another anyway)
    return wait, write, copy_rows, runs_ptx(write)


def _block(slots: int) -> int:
    return max(16, 1 << (slots - 1).bit_length())


def wait(table: torch.Tensor, col: int, seqs: torch.Tensor, value: int = 0, from_seq: bool = False,
         also: int | None = None) -> None:
    """Queues on the current stream: until table[s, col]'s word >= value (or seqs[s]) for every s with
    seqs[s] != 0; with `also`, a word passes too once table[s, also]'s is RELEASED (looked at every
    ALSO_EVERY turns: the host's word beside a device word, which releases)."""
    slots = seqs.shape[0]
    _kernels()[0][(1,)](table, table.shape[1], col, col if also is None else also, seqs, value, slots, BLOCK=_block(slots),
                        FROM_SEQ=from_seq, NAP=SPIN_NAP_NS, ALSO=also is not None, EVERY=ALSO_EVERY, num_warps=SPIN_WARPS)


def write(table: torch.Tensor, col: int, seqs: torch.Tensor, value: int = 0, from_seq: bool = False,
          also: int | None = None) -> None:
    """Queues on the current stream: table[s, col]'s word = value (or seqs[s]) for every s with
    seqs[s] != 0; with `also`, table[s, also]'s first (a system-scope fence between)."""
    slots = seqs.shape[0]
    kernels = _kernels()
    kernels[1][(1,)](table, table.shape[1], col, col if also is None else also, seqs, value, slots,
                     BLOCK=_block(slots), FROM_SEQ=from_seq, ALSO=also is not None, ASM=kernels[3])


def _copy_rows(table: torch.Tensor, col: int, seqs: torch.Tensor, batch: torch.Tensor, gather: bool) -> None:
    slots = seqs.shape[0]
    n = batch.numel() * batch.element_size() // 4 // slots
    _kernels()[2][(slots, triton_cdiv(n))](table, table.shape[1], col, seqs, int32_words(batch), n, BLOCK=COPY_BLOCK,
                                          GATHER=gather)


def gather(table: torch.Tensor, col: int, seqs: torch.Tensor, batch: torch.Tensor) -> None:
    """Queues: row s of batch (its first dimension split in seqs' slots) = the bytes at table[s, col]."""
    _copy_rows(table, col, seqs, batch, True)


def scatter(batch: torch.Tensor, table: torch.Tensor, col: int, seqs: torch.Tensor) -> None:
    """Queues: the bytes at table[s, col] = row s of batch."""
    _copy_rows(table, col, seqs, batch, False)


def triton_cdiv(n: int) -> int:
    return (n + COPY_BLOCK - 1) // COPY_BLOCK


def warm(device: torch.device, slots: int, device_words: bool = False) -> None:
    """Compiles and loads every kernel of gangs of `slots` outside a capture (which may not load a
    module), on the current stream: a table whose slots all sit out."""
    table = torch.zeros((slots, 1), dtype=torch.int64, device=device)
    seqs = torch.zeros(slots, dtype=torch.int32, device=device)
    batch = torch.zeros(slots, dtype=torch.int32, device=device)
    for from_seq in (False, True):
        for also in (None, 0) if device_words else (None,):
            wait(table, 0, seqs, 1, from_seq, also)
            write(table, 0, seqs, 1, from_seq, also)
    gather(table, 0, seqs, batch)
    scatter(batch, table, 0, seqs)
