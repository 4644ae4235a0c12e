"""What a rank of a sharded executor holds in host memory while loading a save_pretrained
checkpoint, against one executor process loading it whole: the peak resident memory (VmHWM) of
each `base-executor serve` process once it serves, and how long it took to come up.

    python benchmarks/probes/rank_memory.py --model llama-1b --dtype bfloat16 [--world 2] [--out FILE]

The built-in's random weights are saved to a temporary directory first (safetensors).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
REPO = pathlib.Path(__file__).resolve().parents[2]


def peak_rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def serve(model_dir: str, dtype: str, devices: list[str], log: pathlib.Path) -> dict:
    from symbiont import wait_for_executor

    url = f"local://rankmem-{uuid.uuid4().hex[:8]}"
    flags = ["--devices", ",".join(devices)] if len(devices) > 1 else ["--device", devices[0]]
    cmd = [sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", model_dir, "--dtype", dtype,
           "--listen", url, *flags]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_for_executor(url, 900, proc)
            ready_s = time.monotonic() - t0
            ranks = [proc.pid, *children(proc.pid)]
            return {"devices": devices, "ready_s": ready_s, "peak_rss_mb": [peak_rss_mb(p) for p in ranks]}
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args()
    import torch

    from symbiont.base_executor.models import build_builtin

    with tempfile.TemporaryDirectory() as tmp:
        model = build_builtin(a.model, getattr(torch, a.dtype))
        model.save_pretrained(tmp)
        size_mb = sum(f.stat().st_size for f in pathlib.Path(tmp).glob("*.safetensors")) / 2**20
        del model
        rows = []
        for devices in (["cpu"], ["cpu"] * a.world):
            row = serve(tmp, a.dtype, devices, pathlib.Path(tempfile.gettempdir()) / f"rank_memory_{len(devices)}.log")
            row.update(model=a.model, dtype=a.dtype, checkpoint_mb=size_mb)
            rows.append(row)
            print(json.dumps(row), flush=True)
    one, ranks = rows
    print(f"{a.model} {a.dtype}, checkpoint {size_mb:.0f} MiB: one process peaks at {one['peak_rss_mb'][0]:.0f} MiB "
          f"(ready in {one['ready_s']:.1f} s); {a.world} ranks at {', '.join(f'{m:.0f}' for m in ranks['peak_rss_mb'])} MiB "
          f"(ready in {ranks['ready_s']:.1f} s)")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
