"""Layout of the same-host shared memory: the executor's wake word and each tenant's mailbox.

Every region is a sealed memfd owned by the executor (it cannot be shrunk or grown by a
tenant, so a tenant cannot make the executor fault); a tenant maps it through
/proc/<executor pid>/fd/<fd>.

Mailbox layout (offsets in bytes):

    [REQUEST_RING_OFFSET, +RING_REGION)   tenant -> executor calls   (csrc Ring)
    [REPLY_RING_OFFSET,   +RING_REGION)   executor -> tenant replies (csrc Ring)
    [REPLY_BELL_OFFSET,   +8)             doorbell the executor rings after a reply
    [DETACHED_OFFSET,     +4)             non-zero once the executor has detached the tenant
    [INPUT_WORD_OFFSET,   +4)             same GPU: the tenant's stream writes a call's input_seq here
                                          once its input is in place; the executor's stream waits on it
    [OUTPUT_WORD_OFFSET,  +4)             same GPU: the executor's stream writes a call's input_seq here
                                          once its result is in place; the tenant's stream waits on it
    [FAILURES_OFFSET,     +4)             how many failure replies the executor has pushed: a tenant
                                          that takes its replies in batches looks here at each call
    [PROGRAM_IN_OFFSET,   +4)             same GPU, a step program's run: the tenant's graph writes each
                                          call's number (1, 2, ...) once its input is in place
    [PROGRAM_OUT_OFFSET,  +4)             ... and the executor's stream writes it once its result is in
    [PROGRAM_SCRATCH_OFFSET, +4)          scratch: the tenant's word kernels are warmed up on it
    [DATA_OFFSET,         +data_bytes)    tensor bytes; the tenant names in/out offsets per call

Wake region: one Doorbell at offset 0, rung by every tenant after it pushes a call.

Device words (`serve --device-words`): the last DEVICE_WORDS_BYTES of a same-GPU tenant's device
region (CudaRegion.words_offset) hold a step program's input and output words again, for the
programs whose definition says so (ProgramRequest.device_words), where a GPU's look at them stays
in its memory instead of crossing PCIe. The host words stay what releases (RELEASED written there;
a wait on a device word looks at its host word every so often for it) and what the host reads:
the tenant's graph writes its input word to both (in no promised order: nothing passes on a
host number), the executor writes the output word to both, the host's first (so a waiter that saw
the device word and sets both back to 0 finds the host's written already).

    [DEVICE_PROGRAM_IN,  +4)             the program input word, in device memory
    [DEVICE_PROGRAM_OUT, +4)             the program output word, in device memory
    [DEVICE_SCRATCH,     +4)             the tenant's word kernels are warmed up on it
"""
from __future__ import annotations

import fcntl
import mmap
import os
import weakref

import torch

from symbiont.proto import codec
from symbiont.proto._doorbell import Doorbell, Ring

RING_SLOTS = 64
RING_SLOT_SIZE = 512
RING_REGION = 36864  # Ring.bytes_needed(64, 512) = 32896, rounded up to pages
REQUEST_RING_OFFSET = 0
REPLY_RING_OFFSET = REQUEST_RING_OFFSET + RING_REGION
REPLY_BELL_OFFSET = REPLY_RING_OFFSET + RING_REGION
DETACHED_OFFSET = REPLY_BELL_OFFSET + 64
INPUT_WORD_OFFSET = REPLY_BELL_OFFSET + 128
OUTPUT_WORD_OFFSET = REPLY_BELL_OFFSET + 192
FAILURES_OFFSET = REPLY_BELL_OFFSET + 256
PROGRAM_IN_OFFSET = REPLY_BELL_OFFSET + 320
PROGRAM_OUT_OFFSET = REPLY_BELL_OFFSET + 384
PROGRAM_SCRATCH_OFFSET = REPLY_BELL_OFFSET + 448  # a word the tenant's graph-word kernels are warmed up on
WORDS_PAGE = (REPLY_BELL_OFFSET, 4096)  # the page holding the words a GPU reads or writes
INPUT_WORD_IN_PAGE = INPUT_WORD_OFFSET - WORDS_PAGE[0]
OUTPUT_WORD_IN_PAGE = OUTPUT_WORD_OFFSET - WORDS_PAGE[0]
PROGRAM_IN_IN_PAGE = PROGRAM_IN_OFFSET - WORDS_PAGE[0]
PROGRAM_OUT_IN_PAGE = PROGRAM_OUT_OFFSET - WORDS_PAGE[0]
DEVICE_WORDS_BYTES = 512  # at the end of a device region with device words (a 128-byte line each)
DEVICE_PROGRAM_IN, DEVICE_PROGRAM_OUT, DEVICE_SCRATCH = 0, 128, 256
RELEASED = 0x7FFFFFFF  # a program word set to this lets every wait of a run pass (calls are numbered from 1)
DATA_OFFSET = REPLY_BELL_OFFSET + 4096
WAKE_BYTES = 4096
ALIGN = 64

assert Ring.bytes_needed(RING_SLOTS, RING_SLOT_SIZE) <= RING_REGION


def program_words(input_word: int) -> tuple[int, int]:
    """A GPU's addresses of the program input and output words, from its address of the input word
    (the words page as that GPU maps it: Mailbox.map_words)."""
    page = input_word - INPUT_WORD_IN_PAGE
    return page + PROGRAM_IN_IN_PAGE, page + PROGRAM_OUT_IN_PAGE


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def create_region(name: str, size: int) -> tuple[int, mmap.mmap]:
    """Executor side: a sealed, zero-filled shared region of `size` bytes. Returns (fd, map)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def open_region(owner_pid: int, fd: int, size: int) -> mmap.mmap:
    """Tenant side: map a region the executor created."""
    path = f"/proc/{owner_pid}/fd/{fd}"
    try:
        local = os.open(path, os.O_RDWR)
    except OSError as e:
        raise ConnectionError(
            f"cannot open the executor's shared region {path}: {e}. The tenant must run on the same host, "
            "as the same user, and in the same PID namespace as the executor."
        ) from e
    try:
        if os.fstat(local).st_size < size:
            raise ConnectionError(f"shared region {path} is smaller than the {size} bytes the executor announced")
        return mmap.mmap(local, size)
    finally:
        os.close(local)


class Mailbox:
    """A view on one tenant's mailbox: both rings, the reply doorbell and the data area."""

    def __init__(self, mem: mmap.mmap, data_bytes: int):
        self.mem = mem
        self.data_bytes = data_bytes
        self.requests = Ring(mem, REQUEST_RING_OFFSET, RING_SLOTS, RING_SLOT_SIZE)
        self.replies = Ring(mem, REPLY_RING_OFFSET, RING_SLOTS, RING_SLOT_SIZE)
        self.reply_bell = Doorbell(mem, REPLY_BELL_OFFSET)
        self._views = codec.ViewCache(lambda offset, shape, dtype: codec.view(mem, DATA_OFFSET + offset, shape, dtype))
        self._words_mapped: weakref.finalize | None = None

    @staticmethod
    def total_bytes(data_bytes: int) -> int:
        return DATA_OFFSET + data_bytes

    def view(self, offset: int, shape, dtype):
        """The tensor at `offset` of the data area (no copy); the caller checks bounds."""
        return self._views.get(offset, shape, dtype)

    @property
    def detached(self) -> bool:
        return self.mem[DETACHED_OFFSET : DETACHED_OFFSET + 4] != b"\0\0\0\0"

    def words_address(self) -> int:
        """Host address of WORDS_PAGE in this process (no buffer export is kept)."""
        return torch.frombuffer(self.mem, dtype=torch.uint8, offset=WORDS_PAGE[0], count=WORDS_PAGE[1]).data_ptr()

    def map_words(self, device) -> tuple[int, int]:
        """Maps WORDS_PAGE for `device`'s streams (proto.cuda_ipc); returns the device addresses of
        the input word and the output word. Undo with unmap_words; a mailbox dropped without it
        undoes it as it goes (else a later map at the same address would find it still mapped)."""
        from symbiont.proto.cuda_ipc import map_host_words, unpin_host_quietly

        address = self.words_address()
        page = map_host_words(device, address, WORDS_PAGE[1])
        self._words_mapped = weakref.finalize(self, unpin_host_quietly, device, address)
        self._words_mapped.atexit = False  # (at exit the driver goes anyway; GPU work may still use it)
        return page + INPUT_WORD_IN_PAGE, page + OUTPUT_WORD_IN_PAGE

    def unmap_words(self, device) -> None:
        from symbiont.proto.cuda_ipc import unpin_host

        if self._words_mapped is not None:
            self._words_mapped.detach()
            self._words_mapped = None
        unpin_host(device, self.words_address())

    def input_word(self) -> int:
        return self._word(INPUT_WORD_OFFSET)

    def set_input_word(self, value: int) -> None:
        """Executor side: releases whatever waits on the word for `value` (a detached tenant's call)."""
        self._set_word(INPUT_WORD_OFFSET, value)

    def output_word(self) -> int:
        return self._word(OUTPUT_WORD_OFFSET)

    def set_output_word(self, value: int) -> None:
        """Tenant side: releases its own stream's wait for the result of call `value` (a failed
        call's, or any once the executor is gone)."""
        self._set_word(OUTPUT_WORD_OFFSET, value)

    def program_output_word(self) -> int:
        return self._word(PROGRAM_OUT_OFFSET)

    def program_input_word(self) -> int:
        return self._word(PROGRAM_IN_OFFSET)

    def release_program(self, output: bool) -> None:
        """Lets every GPU wait of a step program's run pass: the executor's waits for the inputs
        (its tenant detached or dead), or (output) the tenant's waits for the results (the run
        failed, or the executor is gone). The results are then garbage; the run's reply says so."""
        self._set_word(PROGRAM_OUT_OFFSET if output else PROGRAM_IN_OFFSET, RELEASED)

    def failures(self) -> int:
        """How many failure replies the executor has pushed on this mailbox (modulo 2**32)."""
        return self._word(FAILURES_OFFSET)

    def count_failure(self) -> None:
        """Executor side, after pushing a failure reply."""
        self._set_word(FAILURES_OFFSET, self.failures() + 1)

    def _word(self, offset: int) -> int:
        return int.from_bytes(self.mem[offset : offset + 4], "little")

    def _set_word(self, offset: int, value: int) -> None:
        self.mem[offset : offset + 4] = (value & 0xFFFFFFFF).to_bytes(4, "little")

    def mark_detached(self) -> None:
        """Executor side: tells a tenant still waiting here that nobody serves this mailbox any more."""
        self.mem[DETACHED_OFFSET : DETACHED_OFFSET + 4] = (1).to_bytes(4, "little")
        self.reply_bell.ring()

    def close(self) -> None:
        """Drops the ring views. The map is not unmapped here: tensors made by torch.frombuffer
        view it without holding a buffer export, so it is freed when the last of them dies."""
        self.requests = self.replies = self.reply_bell = None
        self._views.clear()
