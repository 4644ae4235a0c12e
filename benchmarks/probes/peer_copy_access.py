"""Peer copies to and from an executor's device mailbox (needs two GPUs): 16 MiB copied between
a tenant's cuda:1 and memory that another process allocated on cuda:0 and shared by CUDA IPC,
with peer access enabled one way (A), both ways (B), the mapping opened in cuda:1's context (C),
or nothing (none). Each variant runs in a fresh process.

    python benchmarks/probes/peer_copy_access.py
"""
import ctypes, subprocess, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # the repository root
import torch
from symbiont.proto import cuda_ipc as ci

N = 16 << 20
if sys.argv[1:2] == ["export"]:
    r = ci.DeviceRegion.allocate(torch.device("cuda:0"), N)
    print(r.handles()[0].hex(), flush=True)
    sys.stdin.read()
    sys.exit(0)
if sys.argv[1:2] == ["import"]:
    h, variant = bytes.fromhex(sys.argv[2]), sys.argv[3]
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    torch.cuda.set_device(d1)
    torch.zeros(1, device=d0); torch.zeros(1, device=d1)
    lib = ci._driver()
    open_on = d1 if variant.startswith("C") else d0
    ptr = ctypes.c_uint64()
    with ci._current(open_on):
        ci._check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), ci._IpcMemHandle.from_bytes(h), 1), "open")
    if variant in ("A", "B"):
        ci.enable_peer_access(d1, d0)
    if variant == "B":
        ci.enable_peer_access(d0, d1)
    x = torch.randn(N // 4, device=d1)
    y = torch.empty_like(x)
    s1 = torch.cuda.Stream(d1)
    s0 = torch.cuda.Stream(d0)
    def t(fn, iters=20):
        fn(); torch.cuda.synchronize(d0); torch.cuda.synchronize(d1)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(d0); torch.cuda.synchronize(d1)
        return (time.perf_counter() - t0) / iters * 1e6
    cin = t(lambda: ci.copy_async(ptr.value, x.data_ptr(), N, s1.cuda_stream, d1))
    cout = t(lambda: ci.copy_async(y.data_ptr(), ptr.value, N, s1.cuda_stream, d1))
    def out0():
        with torch.cuda.device(d0):
            ci.copy_async(y.data_ptr(), ptr.value, N, s0.cuda_stream, d0)
    cout0 = t(out0)
    ok = torch.equal(x, y)
    print(f"variant {variant}: 16 MiB in on cuda:1 stream {cin:.1f} us, out on cuda:1 stream {cout:.1f} us, out on cuda:0 stream {cout0:.1f} us, equal {ok}", flush=True)
    sys.exit(0)
ex = subprocess.Popen([sys.executable, __file__, "export"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
h = ex.stdout.readline().strip()
for v in ("A", "B", "C", "none"):
    r = subprocess.run([sys.executable, __file__, "import", h, v], capture_output=True, text=True, timeout=60)
    print(r.stdout.strip() or ("variant " + v + " FAILED " + r.stderr[-600:]), flush=True)
ex.stdin.close(); ex.wait()
