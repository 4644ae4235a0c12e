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

import ctypes
import dataclasses

import torch

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
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


def device_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (device indexes differ with CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class _CudaArray:
    """Exposes a raw device pointer to torch.as_tensor (zero copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def as_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 [nbytes] tensor over device memory at ptr (the caller keeps the memory alive)."""
    return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


class _Area:
    data: torch.Tensor  # uint8 [nbytes]

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The tensor at `offset` of the data area (no copy); the caller checks bounds."""
        n = 1
        for d in shape:
            n *= int(d)
        return self.data[offset : offset + n * dtype.itemsize].view(dtype).view(tuple(shape))


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
        torch.cuda.set_device(device)  # makes the primary context current on this thread
        ptr = ctypes.c_uint64()
        _check(_driver().cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc({nbytes})")
        _check(_driver().cuMemsetD8_v2(ptr.value, 0, nbytes), "cuMemsetD8")  # no stale bytes of earlier tenants
        events = [torch.cuda.Event(interprocess=True, enable_timing=False) for _ in range(2)]
        for e in events:
            e.record(torch.cuda.current_stream(device))  # an event must be recorded once before it is shared
        return cls(device, ptr.value, nbytes, as_tensor(ptr.value, nbytes, device), *events)

    def handles(self) -> tuple[bytes, bytes, bytes]:
        h = _IpcMemHandle()
        _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), self.ptr), "cuIpcGetMemHandle")
        return h.to_bytes(), self.input_ready.ipc_handle(), self.output_ready.ipc_handle()

    def free(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)  # no queued kernel may still touch it
        self.data = None
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
        torch.cuda.set_device(device)
        h = _IpcMemHandle.from_bytes(mem_handle)
        ptr = ctypes.c_uint64()
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
        self.data = None
        _check(_driver().cuIpcCloseMemHandle(self.ptr), "cuIpcCloseMemHandle")
