"""Accuracy-aware adapter packing (VaLoRA 4.2.1): as few LoRA adapters as meet every task's target.

Several small tasks each need some knowledge in an adapter; one adapter per task is many adapters
to serve, and one adapter for all may be too small to keep every task accurate. The greedy,
accuracy-aware heuristic fuses tasks into an adapter one after another: after training the adapter
on the new task (together with the tasks already in it, so it does not forget them) it checks
every task of the adapter on held-out data; if one falls below its target, the adapter goes back to
its weights before this task and a new adapter starts with it.

The tasks here are synthetic and tiny, so it runs on a CPU in a minute or two: task t reads a
sequence "<bos> <task t> x1 .. x8" and answers yes or no to "does the key token of task t occur in
x?". Tasks differ only in their key, so an adapter of small rank can hold a few of them but not
all. Everything is trained through a real executor (`base-executor serve`, started here on the
`tiny-llama` built-in model unless --executor names one): the tenant's model comes from the
executor (`connect(url).model()`) and holds only its adapters. At the end each packed adapter is
handed to the executor (`host_adapter`) and its tasks are scored again through the hosted path.

    python examples/adapter_packing.py
    python examples/adapter_packing.py --tasks 4 --rank 4 --targets 0.95,0.9,0.9,0.8
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

BOS, YES, NO, FIRST, SPAN, LEN, TASK_IDS = 1, 3, 4, 10, 32, 8, 100


def task_data(task: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples of task `task`: ids [n, 2 + LEN] and yes (1) / no (0) labels, half of each."""
    g = torch.Generator().manual_seed(seed * 1009 + task)
    key = FIRST + task
    x = torch.randint(FIRST, FIRST + SPAN, (n, LEN), generator=g)
    x[x == key] = FIRST + SPAN  # no key unless the label says so
    y = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(0, LEN, (n,), generator=g)
    rows = torch.nonzero(y).flatten()
    x[rows, where[rows]] = key
    ids = torch.cat([torch.full((n, 1), BOS), torch.full((n, 1), TASK_IDS + task), x], dim=1)
    return ids, y


def answer_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The [no, yes] logits at the last position."""
    return model(input_ids=ids).logits[:, -1, [NO, YES]]


def accuracy(model, tasks, seed: int = 7, n: int = 256) -> dict[int, float]:
    out = {}
    with torch.no_grad():
        for t in tasks:
            ids, y = task_data(t, n, seed)
            out[t] = (answer_logits(model, ids).argmax(-1) == y).float().mean().item()
    return out


def train(model, tasks, steps: int, lr: float, batch: int = 32) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    loss = torch.tensor(0.0)
    for step in range(steps):
        parts = [task_data(t, max(batch // len(tasks), 2), 10_000 + step) for t in tasks]
        ids, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = torch.nn.functional.cross_entropy(answer_logits(model, ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def pack(model, tasks: list[int], targets: dict[int, float], rank: int, steps: int, lr: float, log=print):
    """The greedy accuracy-aware fusion. Returns [(adapter name, its tasks, their accuracies)]."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    def config():
        return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)

    bins: list[tuple[str, list[int], dict[int, float]]] = []
    peft = None
    for task in tasks:
        if peft is None:
            torch.manual_seed(0)
            peft = get_peft_model(model, config(), adapter_name="adapter0")
            bins.append(("adapter0", [], {}))
        name, fused, _ = bins[-1]
        before = {k: v.clone() for k, v in get_peft_model_state_dict(peft, adapter_name=name).items()}
        t0 = time.monotonic()
        loss = train(peft, fused + [task], steps, lr)
        scores = accuracy(peft, fused + [task])
        ok = all(scores[t] >= targets[t] for t in fused + [task])
        log(f"  {name} + task {task}: loss {loss:.3f}, accuracy " + ", ".join(f"task {t} {scores[t]:.2f}/{targets[t]:.2f}"
            for t in fused + [task]) + f" ({time.monotonic() - t0:.0f} s): " + ("fused" if ok else "over capacity"))
        if ok or not fused:  # (a task alone below its target still needs an adapter: it gets its own)
            bins[-1] = (name, fused + [task], scores)
            continue
        set_peft_model_state_dict(peft, before, adapter_name=name)  # roll back to before this task
        new = f"adapter{len(bins)}"
        torch.manual_seed(len(bins))
        peft.add_adapter(new, config())
        peft.set_adapter(new)
        t0 = time.monotonic()
        loss = train(peft, [task], steps, lr)
        scores = accuracy(peft, [task])
        bins.append((new, [task], scores))
        log(f"  {new} (new) + task {task}: loss {loss:.3f}, accuracy {scores[task]:.2f}/{targets[task]:.2f} "
            f"({time.monotonic() - t0:.0f} s)")
    return peft, bins


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--targets", default="0.9", help="each task's accuracy target (one value for all, or one per task)")
    p.add_argument("--rank", type=int, default=4, help="each adapter's LoRA rank (its capacity)")
    p.add_argument("--steps", type=int, default=250, help="training steps each time a task is fused")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--executor", default="", help="the URL of a running executor of tiny-llama (default: start one)")
    a = p.parse_args()
    values = [float(v) for v in a.targets.split(",")]
    targets = {t: values[t] if len(values) > 1 else values[0] for t in range(a.tasks)}
    from symbiont import connect, wait_for_executor

    proc = None
    url = a.executor or f"local://packing-{os.getpid()}"
    if not a.executor:
        proc = subprocess.Popen([sys.executable, "-m", "symbiont.base_executor.cli", "serve", "--model", "tiny-llama", "--listen", url],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_executor(url, 120, proc)
        with connect(url, name="packing") as conn:
            model = conn.model(device="cpu")
            print(f"packing {a.tasks} tasks into rank-{a.rank} LoRA adapters through {url}")
            t0 = time.monotonic()
            peft, bins = pack(model, list(range(a.tasks)), targets, a.rank, a.steps, a.lr)
            print(f"\n{len(bins)} adapters for {a.tasks} tasks (one per task would be {a.tasks}), {time.monotonic() - t0:.0f} s:")
            for name, tasks, scores in bins:
                met = all(scores[t] >= targets[t] for t in tasks)
                print(f"  {name}: tasks {tasks}, accuracy " + ", ".join(f"{scores[t]:.2f}" for t in tasks)
                      + ("" if met else "  (below target: this task alone does not fit a rank-%d adapter)" % a.rank))
            # each packed adapter served by the executor instead: the same answers, no adapter code in the tenant
            print("hosted by the executor:")
            for name, tasks, scores in bins:
                conn.host_adapter(f"packed-{name}", peft, adapter_name=name)
                hosted = conn.model(device="cpu", adapter=f"packed-{name}")
                again = accuracy(hosted, tasks)
                print(f"  packed-{name}: tasks {tasks}, accuracy " + ", ".join(f"{again[t]:.2f}" for t in tasks))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
