"""Probe: can a decoding tenant's whole step be one CUDA graph, its executor calls included?

Two questions, on one GPU:

A. Words in a graph. A CUDA graph captured on one stream writes an input word and waits for an
   output word around each of n calls (one-thread kernels, client/transports/graph_words.py, as
   step programs do; and, last, whether the driver's cuStreamWriteValue32 / cuStreamWaitValue32
   can be captured at all: session 47's first run found a capture of them invalidated); a second
   stream ("the executor"), driven from the host, waits for each input word with
   cuStreamWaitValue32, runs a GEMM from the input area to the output area and writes the output
   word. Values 1..n each replay; each side resets the word it waits on after its last wait.
   Checks the replayed result against the same math run eagerly, and times a replay against the
   same graph with the GEMMs inside it (the handovers' cost).

B. transformers' decode step in a graph. A Llama (a built-in config, random weights, bf16) with a
   StaticCache and a fixed-length 2-D mask: one decode step captured with torch.cuda.graph
   (eager, no torch.compile) and replayed for every token; greedy tokens and logits against the
   same steps run eagerly, and the time per token of each.

    python benchmarks/probes/graphed_step.py --model llama-1b [--calls 19] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch


def memops_captured(dev: torch.device) -> dict:
    """Whether a capture survives one cuStreamWriteValue32 (and, separately, one cuStreamWaitValue32)."""
    from symbiont.proto.cuda_ipc import native_ops

    ops = native_ops()
    words = torch.zeros(64, dtype=torch.int32).pin_memory()
    out = {}
    for what in ("write_word", "wait_word"):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        try:
            graph.capture_begin()
            try:
                getattr(ops, what)(torch.cuda.current_stream(dev).cuda_stream, words.data_ptr(), 0)
            finally:
                graph.capture_end()
            out[what] = "captured"
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"[:300]
        del graph, stream
    return out


def words_in_a_graph(dev: torch.device, n: int, width: int, reps: int) -> dict:
    from symbiont.client.transports import graph_words
    from symbiont.proto.cuda_ipc import as_tensor, native_ops

    ops = native_ops()
    if ops is None:
        return {"error": "proto._stream_ops not built"}
    torch.manual_seed(0)
    words = torch.zeros(64, dtype=torch.int32).pin_memory()
    page = as_tensor(words.data_ptr(), words.numel() * 4, dev).view(torch.int32)  # (UVA: cudaHostAlloc memory)
    p_in, p_out = words.data_ptr(), words.data_ptr() + 128
    w = torch.randn(width, width, device=dev, dtype=torch.bfloat16) / width**0.5
    box_in = torch.zeros(1, width, device=dev, dtype=torch.bfloat16)
    box_out = torch.zeros(1, width, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, width, device=dev, dtype=torch.bfloat16)
    tenant, executor = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def expected() -> torch.Tensor:
        h = x.clone()
        for _ in range(n):
            h = torch.mm(h, w) * 0.5 + h
        return h

    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(graph, stream=tenant):
        h = x.clone()
        for k in range(1, n + 1):
            box_in.copy_(h)
            graph_words.write(page, 0, k)
            graph_words.wait(page, 32, k)
            h = box_out * 0.5 + h
        graph_words.write(page, 32, 0)
        y = h

    inline = torch.cuda.CUDAGraph()  # the same, each GEMM in the graph: no handover
    with torch.cuda.graph(inline, stream=tenant):
        h2 = x.clone()
        for _ in range(n):
            h2 = torch.mm(h2, w) * 0.5 + h2
        y2 = h2

    def serve_one_replay() -> None:
        es = executor.cuda_stream
        with torch.cuda.stream(executor):
            for k in range(1, n + 1):
                ops.wait_word(es, p_in, k)
                if k == n:
                    ops.write_word(es, p_in, 0)
                torch.mm(box_in, w, out=box_out)
                ops.write_word(es, p_out, k)

    ref = expected()
    torch.cuda.synchronize(dev)
    oks = []
    for _ in range(3):
        serve_one_replay()
        graph.replay()
        torch.cuda.synchronize(dev)
        oks.append(bool(torch.equal(y, ref)))
    inline.replay()
    torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / reps * 1e6

    def handed() -> None:
        serve_one_replay()
        graph.replay()

    us = timed(handed)
    us_inline = timed(inline.replay)
    return {"calls": n, "exact": oks, "inline_exact": bool(torch.equal(y2, ref)), "replay_us": us, "inline_us": us_inline,
            "handover_us_per_call": (us - us_inline) / n}


def hf_step_in_a_graph(dev: torch.device, model_name: str, prompt: int, new_tokens: int) -> dict:
    from transformers import StaticCache

    from symbiont.base_executor.models import build_builtin

    torch.manual_seed(0)
    model = build_builtin(model_name, dtype=torch.bfloat16).to(dev).eval()
    length = prompt + new_tokens + 8
    ids = torch.randint(100, 1000, (1, prompt), device=dev)

    def prefilled():
        cache = StaticCache(config=model.config, max_cache_len=length)
        mask = torch.zeros(1, length, dtype=torch.long, device=dev)
        mask[:, :prompt] = 1
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(prompt, device=dev))
        return cache, mask, out.logits[:, -1:].argmax(-1)

    # eager: the same step, the same inputs, token after token
    cache, mask, tok = prefilled()
    eager_tokens, eager_logits = [], []
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(new_tokens):
            pos = prompt + i
            mask[:, pos] = 1
            out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([pos], device=dev))
            eager_logits.append(out.logits.float().cpu())
            tok = out.logits[:, -1:].argmax(-1)
            eager_tokens.append(int(tok))
    eager_ms = (time.perf_counter() - t0) / new_tokens * 1e3

    # graphed
    cache, mask, tok = prefilled()
    static_tok = tok.clone()
    static_pos = torch.tensor([prompt], device=dev)
    result: dict = {}
    try:
        with torch.no_grad():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up, as make_graphed_callables does (writes position `prompt`, rewritten below)
                model(input_ids=static_tok, attention_mask=mask, past_key_values=cache, use_cache=True, cache_position=static_pos)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = model(input_ids=static_tok, attention_mask=mask, past_key_values=cache, use_cache=True,
                               cache_position=static_pos).logits
    except Exception as e:  # what stops a capture is the answer
        return {"captured": False, "error": f"{type(e).__name__}: {e}"[:2000], "eager_ms_per_token": eager_ms}
    graph_tokens, same_logits = [], 0
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for i in range(new_tokens):
        pos = prompt + i
        mask[:, pos] = 1
        static_pos.fill_(pos)
        graph.replay()
        nxt = logits[:, -1:].argmax(-1)
        static_tok.copy_(nxt)
        graph_tokens.append(nxt)
    torch.cuda.synchronize(dev)
    graph_ms = (time.perf_counter() - t0) / new_tokens * 1e3
    graph_tokens = [int(t) for t in graph_tokens]
    # the logits of the last step, against eager's (bitwise when a replay runs eager's kernels)
    same_logits = bool(torch.equal(logits.float().cpu(), eager_logits[-1])) if graph_tokens == eager_tokens else None
    result.update(captured=True, tokens_equal=graph_tokens == eager_tokens, last_logits_equal=same_logits,
                  eager_ms_per_token=eager_ms, graph_ms_per_token=graph_ms,
                  first_mismatch=next((i for i, (a, b) in enumerate(zip(graph_tokens, eager_tokens)) if a != b), None))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--calls", type=int, default=19)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    # (a capture gone wrong leaves the process's CUDA state broken: the driver's memops go last)
    out["hf_step_in_a_graph"] = hf_step_in_a_graph(dev, a.model, a.prompt, a.new_tokens)
    print(json.dumps(out["hf_step_in_a_graph"], indent=1), flush=True)
    try:
        out["words_in_a_graph"] = words_in_a_graph(dev, a.calls, a.width, a.reps)
    except Exception as e:
        out["words_in_a_graph"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out["words_in_a_graph"], indent=1), flush=True)
    out["memops_captured"] = memops_captured(dev)
    print(json.dumps(out["memops_captured"], indent=1), flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
