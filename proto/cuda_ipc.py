"""Same-GPU mailboxes: device memory the executor allocates for one tenant and shares once, at
attach, by CUDA IPC handle; two interprocess CUDA events order the tenant's copy-in, the
executor's GEMM and the tenant's read without any host synchronisation per call.

The memory is a dedicated cuMemAlloc per mailbox (not a block of torch's caching allocator),
so the IPC handle exposes this tenant's mailbox and nothing else, and the executor frees it
when the tenant detaches or dies, whatever the tenant still maps. Driver API through ctypes:
nothing to compile, nothing needed on machines without CUDA.

Because the mailboxes bypass torch's caching allocator, its expandable segments (which cannot
be shared by IPC handle) may stay on for the executor's own work.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading

import torch

from symbiont.proto import codec

_IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcMemHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back cut at its first NUL byte
    _fields_ = [("reserved", ctypes.c_ubyte * _IPC_HANDLE_BYTES)]

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), _IPC_HANDLE_BYTES)

    @classmethod
    def from_bytes(cls, data: bytes) -> "_IpcMemHandle":
        if len(data) != _IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC memory handle has {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
        h = cls()
        ctypes.memmove(ctypes.addressof(h), data, _IPC_HANDLE_BYTES)
        return h


_lib = None


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        lib.cuMemsetD8Async.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxEnablePeerAccess.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuDevicePrimaryCtxGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_int)]
        lib.cuDevicePrimaryCtxSetFlags_v2.argtypes = [ctypes.c_int, ctypes.c_uint]
        for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
            fn = getattr(lib, name + "_v2", None) or getattr(lib, name)  # _v2 since CUDA 11.7
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            setattr(lib, "_" + name, fn)
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


HOST_WAITS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*


def set_host_waits(index: int, mode: str) -> None:
    """How this process's threads wait for GPU `index` (a synchronize, an .item()): "spin" on a core,
    "yield" it between polls, "blocking" sleep until the GPU signals, or CUDA's "auto" (spin
    while the process has no more contexts than the host has cores). Set on the device's primary
    context, best before this process first uses it; RuntimeError when they did not take."""
    lib = _driver()
    _check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxSetFlags_v2(dev.value, HOST_WAITS[mode]), f"setting host waits {mode!r}")
    flags, active = ctypes.c_uint(), ctypes.c_int()
    _check(lib.cuDevicePrimaryCtxGetState(dev.value, ctypes.byref(flags), ctypes.byref(active)), "cuDevicePrimaryCtxGetState")
    if flags.value & 7 != HOST_WAITS[mode]:
        raise RuntimeError(f"host waits {mode!r} not in force on GPU {index} (flags {flags.value:#x})")


def device_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (device indexes differ with CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def mappable_device(uuid: str, near: torch.device) -> torch.device | None:
    """The device of this process that is the GPU `uuid`, when memory there can be mapped and
    copied to and from `near` (the same GPU, or a peer of it); else None."""
    if not uuid or not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            if i == near.index or torch.cuda.can_device_access_peer(near.index, i):
                return torch.device("cuda", i)
            return None
    return None


_PEER_ACCESS_ALREADY_ENABLED = 704


def enable_peer_access(a: torch.device, b: torch.device) -> None:
    """Lets copies between memory on GPUs `a` and `b` go directly (NVLink or PCIe peer to peer),
    whichever GPU's stream they are queued on. Both ways are needed: with access from `a` to `b`
    only, the driver still stages a copy through the host (16 MiB between two H200s over NVLink:
    455-462 µs against 46-54 µs, benchmarks/RESULTS.md). torch enables it only around its own copies."""
    for device, peer in ((a, b), (b, a)):
        with _current(peer):  # (retains its primary context)
            pass
        with _current(device):
            rc = _driver().cuCtxEnablePeerAccess(_PRIMARY[peer.index], 0)
        if rc != _PEER_ACCESS_ALREADY_ENABLED:
            _check(rc, f"cuCtxEnablePeerAccess({device} -> {peer})")


_HOST_REGISTER_PORTABLE = 1


def pin_host(device: torch.device, ptr: int, nbytes: int) -> None:
    """Page-locks host memory (a tenant's shared mailbox) so copies between it and the GPU are
    DMA, with no staging copy; `ptr` and `nbytes` must be page-aligned."""
    with _current(device):
        _check(_driver().cuMemHostRegister_v2(ptr, nbytes, _HOST_REGISTER_PORTABLE), f"cuMemHostRegister({nbytes})")


_HOST_REGISTER_DEVICEMAP = 2
_ALREADY_REGISTERED = 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
_WAIT_GEQ = 0  # (int32)(*addr - value) >= 0: a cyclic comparison, so the counter may wrap


def map_host_words(device: torch.device, ptr: int, nbytes: int) -> int:
    """Page-locks host memory and maps it for the GPU; returns the device address of `ptr`. The
    GPU can then write words there (stream_write) and wait on them (stream_wait)."""
    lib = _driver()
    with _current(device):
        rc = lib.cuMemHostRegister_v2(ptr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP)
        if rc == _ALREADY_REGISTERED:  # left by memory unmapped without unregistering (it was here before)
            lib.cuMemHostUnregister(ptr)
            rc = lib.cuMemHostRegister_v2(ptr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP)
        _check(rc, f"cuMemHostRegister({nbytes})")
        dptr = ctypes.c_uint64()
        rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ptr, 0)
        if rc != 0:
            lib.cuMemHostUnregister(ptr)
            _check(rc, "cuMemHostGetDevicePointer")
    return dptr.value


def stream_write(stream: int, dptr: int, value: int) -> None:
    """Queues on `stream` a write of the 32-bit `value` to `dptr`, after a memory fence: when the
    word changes, everything the stream did before is visible."""
    if _native is not None:
        _native.write_word(stream, dptr, value & 0xFFFFFFFF)
    else:
        _stream_write_ctypes(stream, dptr, value)


def stream_wait(stream: int, dptr: int, value: int) -> None:
    """Queues on `stream` a wait until the word at `dptr` has reached `value` (cyclically)."""
    if _native is not None:
        _native.wait_word(stream, dptr, value & 0xFFFFFFFF)
    else:
        _stream_wait_ctypes(stream, dptr, value)


def copy_async(dst: int, src: int, nbytes: int, stream: int, device: torch.device) -> None:
    """Queues on `stream` (of `device`) a copy of nbytes from device address src to dst (torch's
    copy_ of a contiguous tensor, for a fraction of its host time). In a thread that has made no
    CUDA call yet it makes the device's primary context current first, as the runtime would."""
    if _native is not None:
        _native.copy(dst, src, nbytes, stream, device.index)
    else:
        _copy_async_ctypes(dst, src, nbytes, stream, device)


# the slow twins of the three above (csrc/stream_ops.cpp): used where the extension is not built
def _stream_write_ctypes(stream: int, dptr: int, value: int) -> None:
    _check(_driver()._cuStreamWriteValue32(stream, dptr, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")


def _stream_wait_ctypes(stream: int, dptr: int, value: int) -> None:
    _check(_driver()._cuStreamWaitValue32(stream, dptr, value & 0xFFFFFFFF, _WAIT_GEQ), "cuStreamWaitValue32")


def _copy_async_ctypes(dst: int, src: int, nbytes: int, stream: int, device: torch.device) -> None:
    with _current(device):  # (a context current in this thread)
        _check(_driver().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def _load_native():
    try:
        from symbiont.proto import _stream_ops
    except ImportError:
        return None
    return _stream_ops if _stream_ops.available() else None


_native = _load_native()  # proto._stream_ops, where it is built and the driver is there


def native_ops():
    """proto._stream_ops where it is built and the CUDA driver is there (its Lane is the same-GPU
    call path of client/transports/local_calls.py), else None."""
    return _native


def reached(word: int, value: int) -> bool:
    """The host's reading of stream_wait's condition."""
    return (word - value) & 0xFFFFFFFF < 0x80000000


_spare_streams: dict[int, list] = {}  # device index -> streams given back by drop_stream
_spare_lock = threading.Lock()


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A stream nobody else uses (torch's pool hands the same streams out again): what waits on
    it stalls nothing else. Give it back with drop_stream."""
    with _spare_lock:
        spare = _spare_streams.get(device.index)
        if spare:
            return spare.pop()
    s = ctypes.c_void_p()
    with _current(device):
        _check(_driver().cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")  # 1: non-blocking
    return torch.cuda.ExternalStream(s.value, device=device)


def drop_stream(device: torch.device, stream: torch.cuda.ExternalStream) -> None:
    """Gives back a stream of own_stream (the caller made sure nothing of its holder is still
    queued there): the next own_stream hands it out again. It is never destroyed: the caching
    allocator records there the last use of memory read on it (record_stream: a hosted adapter's
    weights), and marks that use with an event on the stream when the memory goes, maybe long after
    its tenant left; on a destroyed stream that aborts the process."""
    with _spare_lock:
        _spare_streams.setdefault(device.index, []).append(stream)


def unpin_host(device: torch.device, ptr: int) -> None:
    with _current(device):
        _check(_driver().cuMemHostUnregister(ptr), "cuMemHostUnregister")


def unpin_host_quietly(device: torch.device, ptr: int) -> None:
    """unpin_host for a finalizer: nothing to raise to."""
    try:
        unpin_host(device, ptr)
    except Exception:
        pass


_PRIMARY: dict[int, ctypes.c_void_p] = {}  # device index -> its primary context, retained for good


@contextlib.contextmanager
def _current(device: torch.device):
    """Makes `device`'s primary context (the one torch uses) current on this thread for driver
    calls; restores the caller's context after. (torch.cuda.set_device may defer the switch
    until a kernel launch.) The context is retained once and never released: releasing the last
    reference before torch has used the GPU would destroy it, and with it what was mapped."""
    lib = _driver()
    index = device.index if device.index is not None else torch.cuda.current_device()
    ctx = _PRIMARY.get(index)
    if ctx is None:
        _check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
        ctx = ctypes.c_void_p()
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _PRIMARY[index] = ctx
    _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def runs_ptx(kernel) -> bool:
    """Whether a @triton.jit kernel runs on the GPU, where inline PTX (fences, release stores) runs,
    and not in Triton's CPU interpreter (chosen when the kernel was made), which runs none."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return True
    return not isinstance(kernel, InterpretedFunction)


def zero_device(device: torch.device, ptr: int, nbytes: int) -> None:
    """Sets nbytes of device memory at ptr to 0 and waits until it is done: a driver memset (no
    kernel module to load) on a stream of its own (own_stream), so no stream of ours that waits on
    a tenant holds it up."""
    stream = own_stream(device)
    try:
        with _current(device):
            _check(_driver().cuMemsetD8Async(ptr, 0, nbytes, stream.cuda_stream), "cuMemsetD8Async")
            _check(_driver().cuStreamSynchronize(stream.cuda_stream), "cuStreamSynchronize")
    finally:
        drop_stream(device, stream)


class _CudaArray:
    """Exposes a raw device pointer to torch.as_tensor (zero copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def as_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 [nbytes] tensor over device memory at ptr (the caller keeps the memory alive); never an
    inference tensor (a mailbox made during a call under torch.inference_mode() is written outside it)."""
    with torch.inference_mode(False):
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


class _Area:
    data: torch.Tensor  # uint8 [nbytes]

    def __post_init__(self):
        self._views = codec.ViewCache(self._make_view)

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The tensor at `offset` of the data area (no copy); the caller checks bounds."""
        return self._views.get(offset, shape, dtype)

    def _make_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.data[offset : offset + codec.nbytes(shape, dtype)].view(dtype).view(shape)

    def _drop_views(self) -> None:
        """Before the memory goes: no cached view may outlive it."""
        self._views.clear()
        self.data = None


@dataclasses.dataclass(eq=False)
class DeviceRegion(_Area):
    """Executor side: one tenant's device mailbox and its two events."""

    device: torch.device
    ptr: int
    nbytes: int
    data: torch.Tensor  # uint8 [nbytes]
    input_ready: torch.cuda.Event  # the tenant records it after writing an input
    output_ready: torch.cuda.Event  # the executor records it after writing results

    @classmethod
    def allocate(cls, device: torch.device, nbytes: int) -> "DeviceRegion":
        ptr = ctypes.c_uint64()
        with _current(device):
            _check(_driver().cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc({nbytes})")
        try:
            zero_device(device, ptr.value, nbytes)  # no stale bytes of earlier tenants, before the tenant gets it
        except BaseException:
            with _current(device):
                _driver().cuMemFree_v2(ptr.value)
            raise
        events = [torch.cuda.Event(interprocess=True, enable_timing=False) for _ in range(2)]
        for e in events:
            e.record(torch.cuda.current_stream(device))  # an event must be recorded once before it is shared
        return cls(device, ptr.value, nbytes, as_tensor(ptr.value, nbytes, device), *events)

    def handles(self) -> tuple[bytes, bytes, bytes]:
        h = _IpcMemHandle()
        _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), self.ptr), "cuIpcGetMemHandle")
        return h.to_bytes(), self.input_ready.ipc_handle(), self.output_ready.ipc_handle()

    def free(self) -> None:
        torch.cuda.synchronize(self.device)  # no queued kernel may still touch it
        self._drop_views()
        with _current(self.device):
            _check(_driver().cuMemFree_v2(self.ptr), "cuMemFree")


@dataclasses.dataclass(eq=False)
class OpenedRegion(_Area):
    """Tenant side: the executor's device mailbox mapped into this process, and its events."""

    device: torch.device
    ptr: int
    data: torch.Tensor
    input_ready: torch.cuda.Event
    output_ready: torch.cuda.Event

    @classmethod
    def open(cls, device: torch.device, nbytes: int, mem_handle: bytes, input_ready: bytes, output_ready: bytes) -> "OpenedRegion":
        h = _IpcMemHandle.from_bytes(mem_handle)
        ptr = ctypes.c_uint64()
        with _current(device):
            _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return cls(
            device,
            ptr.value,
            as_tensor(ptr.value, nbytes, device),
            torch.cuda.Event.from_ipc_handle(device, input_ready),
            torch.cuda.Event.from_ipc_handle(device, output_ready),
        )

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._drop_views()
        with _current(self.device):  # the context the mapping was opened in
            _check(_driver().cuIpcCloseMemHandle(self.ptr), "cuIpcCloseMemHandle")
