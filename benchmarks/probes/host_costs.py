"""Host time of single torch calls an executor or tenant makes per remote call (GPU): medians of
50 back-to-back launches, synchronised between batches. Explains where a same-GPU call's
microseconds go (benchmarks/RESULTS.md, S1 run 3). Run: python3 benchmarks/probes/host_costs.py"""
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from symbiont.proto.cuda_ipc import DeviceRegion  # noqa: E402


def host_us(f, reps=40, n=50) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    dev, bf = torch.device("cuda:0"), torch.bfloat16
    w = torch.randn(2048, 2048, device=dev, dtype=bf)
    x = torch.randn(1, 2048, device=dev, dtype=bf)
    out_t = torch.empty(1, 2048, device=dev, dtype=bf)
    region = DeviceRegion.allocate(dev, 1 << 20)  # a mailbox, as the executor allocates it
    out_r, x_r = region.view(0, (1, 2048), bf), region.view(65536, (1, 2048), bf)
    side, wt = torch.cuda.Stream(), w.t()

    def in_stream():
        with torch.cuda.stream(side):
            pass

    cases = {
        "F.linear(x, w)": lambda: F.linear(x, w),
        "mm(x, w.t(), out=torch)": lambda: torch.mm(x, w.t(), out=out_t),
        "mm(x, w.t(), out=region)": lambda: torch.mm(x, w.t(), out=out_r),
        "mm(x_region, wt, out=region)": lambda: torch.mm(x_r, wt, out=out_r),
        "x.clone()": lambda: x.clone(),
        "event.record()": lambda: region.output_ready.record(),
        "current_stream()": lambda: torch.cuda.current_stream(dev),
        "with torch.cuda.stream(s)": in_stream,
    }
    print(f"host µs per call, {torch.cuda.get_device_name()}, 1 x 2048 bf16")
    for name, f in cases.items():
        print(f"{host_us(f):8.1f}  {name}")


if __name__ == "__main__":
    main()
