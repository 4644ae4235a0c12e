"""CUDA graphs of lone calls: a same-GPU tenant's call reads its input from and writes its result
to fixed places of its device mailbox, so its GEMMs (one for a Linear, five to ten kernels for an
MLP unit) can be captured once per (unit, op, shape, offsets) and replayed after: one graph
launch instead of a launch through torch per kernel, which is most of the executor's host time
per call on a slow host (benchmarks/RESULTS.md, S6).

A replay runs the kernels the eager ops chose when captured, so its result is bitwise the eager
one (tests/test_gpu.py compares them). One CallGraphs holds the graphs of one data area on one
stream: replays on one stream never overlap, so its graphs share one memory pool for their
intermediates (an MLP unit's), the pool holding the largest of them. The eager calls on that
stream allocate from the same pool: otherwise each tenant's stream kept a second cache of the
same intermediates in torch's allocator (benchmarks/RESULTS.md, "Memory per tenant"). A graph uses the cuBLAS
workspace of the stream it was captured on, so it is captured on the stream it is replayed on;
the legacy default stream cannot be captured, so its graphs are captured on a side stream whose
workspace nothing else uses. The eager ops stay the slow twin: a call is run eagerly the first
time its key is seen, always beyond `max_tokens`, and where capture fails.
"""
from __future__ import annotations

import contextlib
import gc
import logging

import torch

from symbiont.base_executor import runner
from symbiont.base_executor.catalog import CONV1D, EMBEDDING, LINEAR, MLP, SPAN
from symbiont.base_executor.core import add_adapters, span_deltas
from symbiont.base_executor.scheduler import Call
from symbiont.proto import executor_pb2 as pb

log = logging.getLogger("base_executor")


@contextlib.contextmanager
def capture_guard():
    """Around a capture: no garbage collection meanwhile. A collection there may destroy CUDA graphs
    of reference cycles (a detached tenant's), which the driver refuses while this thread captures,
    and that refusal invalidates the capture (session 48, calls 2 and 5: "operation not permitted
    when stream is capturing (function reset)")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool, body) -> None:
    """Captures body() into graph (on the current stream, into `pool`). Where the capture fails, the
    allocator is told the pool records no more (torch's capture_end raises before it ends that:
    every later use of the pool, a graph's or use_mem_pool's, would fail) and given back its use of
    the pool; the error is raised, and the caller captures into that pool no more (torch may still
    hold a host-side recording of it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with capture_guard():
        try:
            # thread_local: the control thread may run meanwhile, which a global capture would refuse
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        except Exception:
            try:
                torch._C._cuda_endAllocateToPool(index, pool)
            except Exception:  # (it had ended, or never begun: nothing to give back)
                pass
            else:
                torch._C._cuda_releasePool(index, pool)
            raise


CAPTURE_AT = 2  # a key is captured the second time it is seen: one-off shapes stay eager
SHARED_POOLS = hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")  # (torch >= 2.5)
MAX_GRAPHS = 512  # per CallGraphs; the oldest key goes first beyond it (a decode uses ~50, a training step ~150)


class _Entry:
    __slots__ = ("seen", "graph", "y", "failed", "adapter")

    def __init__(self):
        self.seen = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.y: torch.Tensor | None = None  # the result in the mailbox, in the call's output shape
        self.failed = False
        self.adapter = None  # the hosted adapter's delta (or merged unit) its graph reads: kept while the graph lives


def _compute(call: Call, exact: bool) -> torch.Tensor:
    """call's result into call.out: the unit's op and the hosted adapter's term when it names one,
    as core's calls run alone."""
    y = runner.run(call.unit, call.op, call.x, exact, call.out, span_deltas([call]))
    add_adapters([call], call.x, y)
    return y


class CallGraphs:
    """The graphs of one data area's calls run on one stream."""

    def __init__(self, device: torch.device, max_tokens: int, counters, side_stream=None):
        """counters: core.Counters (graph_replays, graph_captures are counted there).
        side_stream: a warmed-up stream to capture on when the calls run on the legacy default
        stream (which cannot be captured)."""
        self.device = device
        self.max_tokens = max_tokens
        self.counters = counters
        self._side_stream = side_stream
        self._pool = None  # torch.cuda.MemPool (or a graph pool handle before torch 2.5)
        self._entries: dict[object, _Entry] = {}
        self.on_drop = None  # called with a key whose graph goes (beyond MAX_GRAPHS), before it goes

    def forget(self, predicate) -> int:
        """Drops the graphs whose key matches (our GPU idle: no replay of theirs is queued); how many."""
        gone = [key for key in self._entries if predicate(key)]
        for key in gone:
            if self.on_drop is not None:
                self.on_drop(key)
            del self._entries[key]
        return len(gone)

    def graph_of(self, key) -> torch.cuda.CUDAGraph | None:
        """The captured graph of `key`, if any: it lives until on_drop(key) or close()."""
        e = self._entries.get(key)
        return e.graph if e is not None else None

    def run(self, call: Call, exact: bool) -> torch.Tensor:
        """call's result, written into call.out (its [tokens, d_out] place in the mailbox), viewed
        as call.out_shape. Its graph is found by call.graph_key (its unit, op, shape and mailbox
        offsets)."""
        e = self._entry(call.graph_key)
        if e.graph is not None:
            e.graph.replay()
            self.counters.graph_replays += 1
            return e.y
        e.seen += 1
        if e.seen >= CAPTURE_AT and not e.failed and self._capturable(call):
            try:
                e.graph = self._capture(call, exact)
            except Exception as ex:  # the eager ops serve it from now on
                e.failed = True
                log.warning("capturing a CUDA graph of %s %s failed (%s: %s); it runs eagerly",
                            call.unit.id, pb.Op.Name(call.op), type(ex).__name__, ex)
            else:
                e.y = call.out.view(call.out_shape)
                e.adapter = call.adapter if call.adapter is not None else call.unit if call.merge_epoch else None
                e.graph.replay()
                self.counters.graph_captures += 1
                self.counters.graph_replays += 1
                return e.y
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream == 0 or not SHARED_POOLS:  # (the default stream's graphs are captured on the side stream)
            return _compute(call, exact).view(call.out_shape)
        with torch.cuda.use_mem_pool(self._memory(), self.device):
            return _compute(call, exact).view(call.out_shape)

    def _entry(self, key) -> _Entry:
        """key's entry, made at its first sight (the oldest key goes beyond MAX_GRAPHS)."""
        e = self._entries.get(key)
        if e is None:
            if len(self._entries) >= MAX_GRAPHS:
                oldest = next(iter(self._entries))
                if self.on_drop is not None:
                    self.on_drop(oldest)
                del self._entries[oldest]  # (a replay still queued, or a step program, keeps its graph alive)
            e = self._entries[key] = _Entry()
        return e

    def _memory(self):
        """The pool of this stream's graphs and eager calls (every use is on the one stream, so
        a block freed by one call is free for the next, graphed or not); a graph pool where
        torch has no MemPool (before 2.5)."""
        if self._pool is None:
            self._pool = torch.cuda.MemPool() if SHARED_POOLS else torch.cuda.graph_pool_handle()
        return self._pool

    def capture_pool(self):
        """What a capture passes as its pool: these graphs' memory."""
        return self._memory().id if SHARED_POOLS else self._memory()

    def graph_for(self, call: Call, exact: bool) -> torch.cuda.CUDAGraph:
        """The graph of call's key, captured now if it has none (nothing runs); raises where it
        cannot be (transports/programs.py: a step program is graphs only)."""
        e = self._entry(call.graph_key)
        if e.graph is not None:
            return e.graph
        if not self._capturable(call):
            raise ValueError(f"{call.unit.id} {pb.Op.Name(call.op)} of {call.tokens} tokens is not captured as a graph")
        e.seen = max(e.seen, CAPTURE_AT)
        e.graph = self._capture(call, exact)
        e.y = call.out.view(call.out_shape)
        e.adapter = call.adapter if call.adapter is not None else call.unit if call.merge_epoch else None
        self.counters.graph_captures += 1
        return e.graph

    def _capturable(self, call: Call) -> bool:
        if call.out is None or call.tokens > self.max_tokens or call.unit.kind not in (LINEAR, CONV1D, EMBEDDING, MLP, SPAN):
            return False
        # an activation without a backward op of its own is differentiated by autograd
        return not (call.unit.kind == MLP and call.op == pb.BACKWARD and call.unit.act_backward is None)

    def _capture(self, call: Call, exact: bool) -> torch.cuda.CUDAGraph:
        """Captures the call's ops (nothing runs); the caller replays the graph."""
        stream = torch.cuda.current_stream(self.device)
        on = stream if stream.cuda_stream != 0 else self._side_stream
        # (a CallGraphs's calls are all on one stream; on the default stream only its captures use the pool)
        pool = self.capture_pool()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_stream(on)
        try:
            capture(graph, self.device, pool, lambda: _compute(call, exact))
        except Exception:
            self._pool = None  # (a failed capture's pool is not captured into again: a fresh one from now on)
            raise
        finally:
            torch.cuda.set_stream(stream)
        return graph

    def close(self) -> None:
        """Drops every graph and, with the last, the pool; no replay may still be running."""
        self._entries.clear()
        self._pool = None
