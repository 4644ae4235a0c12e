"""Decoding steps replayed as CUDA graphs, their executor calls included (`virtualize(...,
step_graphs=True)`; a same-GPU tenant).

A decoding tenant at batch 1 is bound by its host: every token is some hundred kernel launches
through PyTorch and transformers, its ~20 calls to the executor among them (benchmarks/RESULTS.md,
"What S3's goal asks of one tenant"). Here a decoding step (one token a row, a static cache:
`generate(..., cache_implementation="static")`) is captured once as a CUDA graph, the calls
recorded into a step program the executor runs as one graph of its own
(client/transports/local_programs.py), and each later step is one replay: the tenant's host
copies the step's inputs in, sends one request, and launches one graph.

- **What is captured.** A forward without gradients, of one token a row, whose cache is
  transformers' StaticCache of full-attention layers only (a sliding window's layer keeps its
  length on the host), filled (the prefill ran eagerly), and at most a 2-D or 4-D attention mask. The first such
  step of a shape runs eagerly (it makes the calls' plans and warms the executor's side); the
  second is captured, and every later one replayed. Anything else runs eagerly, as before.
- **Inputs.** Each tensor argument is copied into the graph's own buffer before a replay; a 2-D
  attention mask, whose length grows a token a step, goes into a buffer as long as the cache,
  zero beyond its end (what transformers pads it to for a static cache anyway). The forward keeps
  the model's signature (generate reads it to choose what to pass).
- **The cache.** generate makes a new static cache for every call. The graph reads and writes the
  tensors of the cache it was captured with; a later cache of the same shapes adopts them (its
  tensors are copied in once, and its layers then hold the graph's), so one capture serves every
  generate of a shape. A cache that had adopted them before gets copies of its own back first.
- **Exact.** A replay runs the kernels the eager step ran, on the same inputs: greedy tokens and
  logits equal the eager tenant's (tests/test_gpu.py).
- **Host data.** A tensor made on the GPU from host data inside the forward (transformers' eager
  attention makes its mask's zero with `torch.tensor(0.0, device=...)`) is copied from a
  page-locked copy while capturing (a graph may copy only from page-locked memory), kept as long
  as the graph.
- **Compiled** (`step_graphs="compiled"`): the step is captured from the model's forward compiled
  by torch.compile (inductor; a second cache length compiles once more, symbolic in the length,
  and later lengths reuse it), whose fused kernels make a token far fewer launches
  than eager PyTorch's (~1,000 for `llama-1b` with a LoRA on four projections); with many tenants
  on one GPU, launches are what the GPU runs out of (benchmarks/RESULTS.md, session 49). Before its
  capture the step runs once compiled, outside it (the compile, its kernels loaded); the cache's
  small state tensors (StaticLayer's length) are put back after it, and the entries it wrote the
  replay writes again, the same. The tenant's own linears of few rows (its LoRA's A and B at a
  decoding step) are traced as float32 products summed, which inductor fuses with their neighbours
  (instead of two cuBLAS GEMMs a LoRA: `model.forward.small_linears = False` keeps the GEMMs).
  `model.forward.compiled_prefill = True` runs a prefill into the static cache through the compiled
  forward too (not captured: once a prompt length; after a second length, symbolic in it): a
  prefill is ~1,000 eager launches, in a burst the other tenants' steps share the GPU with (an
  experiment, off: benchmarks/fleet_worker.py --compiled-prefill).
  A compile inside the capture (a guard the run before it passed failing there) fails the
  capture: the step runs eagerly from then on. A call of that run failing for a passing reason
  (retry later, the executor away) leaves the step eager, captured again at a later step. One
  compiled step is run and captured at a time in a process (dynamo's counts tell a compile during
  the capture). Exact to the compiled forward:
  inductor's fusions round otherwise than eager kernels (float rounding; tests/test_gpu.py).
- Graphs are kept per thread (a thread's steps replay its own graphs and buffers). A step that
  cannot be captured (transformers reading a GPU value on the host inside the forward, for
  instance) runs eagerly from then on, with a warning; `failures` keeps why.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode

from symbiont.client.errors import ExecutorUnavailableError, NotAttachedError, ResourceExhaustedError, RetryLaterError
from symbiont.client.shim import linear_args
from symbiont.client.transports.local_programs import StaleProgram

EAGER = ("labels", "inputs_embeds", "output_attentions", "output_hidden_states")  # a step given any of these runs eagerly
MAX_STEPS = 8  # graphs kept per thread; the oldest goes first beyond it


class _Step:
    """One captured decoding step: its graph, the buffers of its inputs, its output."""

    __slots__ = ("graph", "inputs", "mask", "output", "program", "transport", "cache", "layers", "adopter", "host")

    def __init__(self):
        self.graph = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.mask: torch.Tensor | None = None
        self.output = None
        self.program = 0
        self.transport = None
        self.cache = None  # the cache captured with (its layers' tensors are the graph's)
        self.layers: list[dict[str, torch.Tensor]] = []  # each layer's tensors, as captured
        self.adopter = None  # weakref of the cache whose layers hold them now
        self.host: list[torch.Tensor] = []  # page-locked host tensors the graph copies from


class StepGraphs:
    """The forward of a virtualized model (installed as its `forward`): decoding steps replayed as
    graphs, everything else eager (the module's docstring)."""

    def __init__(self, forward, transports, compiled: bool = False):
        self._forward = forward  # the model's own forward (bound)
        # (compiles at its first call; a second cache length compiles once more, with that length
        # symbolic, and every later one reuses it: dynamo's automatic dynamic shapes)
        self._compiled = torch.compile(forward) if compiled else None
        self.__signature__ = inspect.signature(forward)  # (generate inspects it: logits_to_keep, cache_position, ...)
        self.__wrapped__ = forward
        self._transports = transports
        self._local = threading.local()
        self._failed: set = set()  # keys whose capture failed: eager from then on
        self.replays = 0
        self.captures = 0
        self.failures: list[str] = []  # why captures failed (each such step shape runs eagerly)
        self._tuner = None  # the model's first PEFT adapter layer (False: none), found at the first step
        self.small_linears = True  # compiled: the tenant's own linears of few rows as reductions (_SmallLinears)
        self.compiled_prefill = False  # compiled: a prefill into a static cache runs compiled too (not a graph)

    def __deepcopy__(self, memo):
        import copy

        graphs = StepGraphs(copy.deepcopy(self._forward, memo), self._transports, compiled=self._compiled is not None)
        graphs.small_linears, graphs.compiled_prefill = self.small_linears, self.compiled_prefill
        return graphs

    def __call__(self, *args, **kwargs):
        key = self._key(args, kwargs)
        if key is None or key in self._failed:
            if self.compiled_prefill and self._compiled is not None and _prefill(args, kwargs):
                with _COMPILED_CAPTURES:  # (its compile is never inside another thread's capture)
                    return self._compiled(**kwargs)
            return self._forward(*args, **kwargs)
        steps = self._steps()
        step = steps.get(key)
        if step is None:  # the first step of its shape: eager (plans, the executor's side warmed)
            steps[key] = _Step()
            if len(steps) > MAX_STEPS:
                del steps[next(iter(steps))]
            return self._forward(**kwargs)
        if step.graph is None:
            try:
                self._capture(step, kwargs)
            except (StaleProgram, RetryLaterError, _WarmRunFailed):  # (the mailbox grew meanwhile; the executor's
                del steps[key]  # side not ready yet; a call of the run before it failed): eager, captured again later
                return self._forward(**kwargs)
            except Exception as e:  # (eager from now on: nothing was sent)
                self._failed.add(key)
                del steps[key]
                self.failures.append(f"{type(e).__name__}: {e}")
                warnings.warn(f"a decoding step could not be captured as a CUDA graph ({type(e).__name__}: {e}); "
                              "it runs eagerly", RuntimeWarning, stacklevel=2)
                return self._forward(**kwargs)
        try:
            return self._replay(step, kwargs)
        except StaleProgram:  # (the mailbox grew, or the tenant reattached: captured again next time)
            del steps[key]
            return self._forward(**kwargs)

    def _steps(self) -> dict:
        steps = getattr(self._local, "steps", None)
        if steps is None:
            steps = self._local.steps = {}
        return steps

    def _key(self, args, kwargs):
        """The shape key of a step that may be replayed, or None (eager)."""
        if not _plain(args, kwargs) or len(self._transports) != 1:
            return None
        ids, cache = kwargs.get("input_ids"), _cache(kwargs)
        if not (isinstance(ids, torch.Tensor) and ids.is_cuda and ids.dim() == 2 and ids.shape[1] == 1):
            return None
        if not _static(cache):
            return None
        if torch.cuda.is_current_stream_capturing() or not self._transports[0].programs_possible():
            return None
        length = _length(cache)
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.shape[0] == ids.shape[0] and (
                (mask.dim() == 2 and mask.shape[1] <= length) or (mask.dim() == 4 and mask.shape[-1] == length))):
            return None
        module = getattr(self._forward, "__self__", None)
        parts = [threading.get_ident(), length, type(cache), _layer_shapes(cache), torch.is_inference_mode_enabled(),
                 getattr(module, "training", None), self._adapters_state(module)]
        for name in sorted(kwargs):
            v = kwargs[name]
            if name in CACHE_NAMES:
                continue
            if name == "attention_mask" and v is not None and v.dim() == 2:
                parts.append((name, v.shape[0], v.dtype, v.device))
            elif isinstance(v, torch.Tensor):
                parts.append((name, tuple(v.shape), v.dtype, v.device))
            elif v is None or isinstance(v, (bool, int, float, str)):
                parts.append((name, v))
            else:
                return None
        return tuple(parts)

    def _adapters_state(self, module) -> tuple | None:
        """PEFT's switches a replay would not see (disable_adapter(), set_adapter()): those of the
        model's first adapter layer, which PEFT sets on every layer alike."""
        if self._tuner is None:
            try:
                from peft.tuners.tuners_utils import BaseTunerLayer
            except ImportError:  # (no PEFT: no adapter layers)
                BaseTunerLayer = ()
            self._tuner = next((m for m in module.modules() if isinstance(m, BaseTunerLayer)), False) if module is not None else False
        if not self._tuner:
            return None
        return bool(self._tuner.disable_adapters), tuple(self._tuner.active_adapters)

    def _capture(self, step: _Step, kwargs) -> None:
        cache = _cache(kwargs)
        transport = self._transports[0]
        fixed = {}
        for name, v in kwargs.items():
            if name == "attention_mask" and v is not None and v.dim() == 2:
                step.mask = torch.zeros((v.shape[0], _length(cache)), dtype=v.dtype, device=v.device)
                step.mask[:, : v.shape[1]].copy_(v)
                fixed[name] = step.mask
            elif isinstance(v, torch.Tensor):
                step.inputs[name] = fixed[name] = v.clone()
            else:
                fixed[name] = v
        with _COMPILED_CAPTURES if self._compiled is not None else contextlib.nullcontext():
            output, headers = self._record(step, transport, cache, fixed, kwargs["input_ids"].device)
        step.program = transport.define_program(headers)
        step.output, step.transport, step.cache = output, transport, cache
        step.layers = [_tensors(layer) for layer in cache.layers]
        step.adopter = weakref.ref(cache)
        self.captures += 1

    def _record(self, step: _Step, transport, cache, fixed: dict, device: torch.device) -> tuple:
        """Captures the step on `fixed` (compiled: after one run outside the capture): (its output,
        its calls' headers)."""
        forward = self._compiled or self._forward
        # (the same modes around the run before the capture and the capture: dynamo guards on them)
        linears = _SmallLinears() if self._compiled is not None and self.small_linears else contextlib.nullcontext()
        if self._compiled is not None:  # (compiled and its kernels loaded outside the capture, on these very inputs)
            try:
                with _cache_state_kept(cache), linears:
                    self._compiled(**fixed)
                transport.confirm()  # (its calls' replies: a failure of theirs is not the capture's)
            except TRANSIENT as e:
                raise _WarmRunFailed() from e
        torch.cuda.synchronize(device)  # (our calls before it are done: their replies are taken first)
        transport.begin_program()
        graph = torch.cuda.CUDAGraph()
        # (a compiled forward makes no host tensors; a mode around it would change its guards: compiled again)
        host_data = _PinnedHostData(step.host) if self._compiled is None else contextlib.nullcontext()
        compiled_before = _graphs_compiled()
        try:
            # (thread_local: another thread's synchronise meanwhile neither fails nor ends this capture)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"), host_data, linears:
                output = forward(**fixed)
                if _graphs_compiled() != compiled_before:  # (a guard the run before it passed failed here)
                    raise RuntimeError("the compiled step was compiled again inside its capture")
                headers = transport.end_program()
        except BaseException:
            transport.abort_program()
            raise
        step.graph = graph
        return output, headers

    def _replay(self, step: _Step, kwargs):
        cache = _cache(kwargs)
        if step.adopter() is not cache:
            self._adopt(step, cache)
        for name, buf in step.inputs.items():
            buf.copy_(kwargs[name])
        mask = kwargs.get("attention_mask")
        if mask is not None and step.mask is not None:
            step.mask[:, mask.shape[1]:].zero_()
            step.mask[:, : mask.shape[1]].copy_(mask)
        step.transport.run_program(step.program, step.graph.replay)
        self.replays += 1
        out = step.output
        fresh = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        for name in CACHE_NAMES:
            if name in fresh:
                fresh[name] = cache
        return type(out)(**fresh)

    @staticmethod
    def _adopt(step: _Step, cache) -> None:
        """Makes `cache`'s layers hold the graph's tensors, with cache's contents; the cache that
        held them before gets copies of its own back."""
        before = step.adopter()
        if before is not None:
            for layer, mine in zip(before.layers, step.layers):
                for name, t in mine.items():
                    if getattr(layer, name, None) is t:
                        setattr(layer, name, t.clone())
        for layer, mine in zip(cache.layers, step.layers):
            for name, t in mine.items():
                theirs = getattr(layer, name)
                if theirs is not t:
                    t.copy_(theirs)
                    setattr(layer, name, t)
        step.adopter = weakref.ref(cache)


_COMPILED_CAPTURES = threading.Lock()  # a compiled step's run before its capture and capture, one at a time a process
TRANSIENT = (ResourceExhaustedError, ExecutorUnavailableError, NotAttachedError)  # a warm run's call failures worth a retry


def _plain(args, kwargs) -> bool:
    """Whether a forward may run other than eagerly at all: keyword arguments only, no gradients,
    not inside a trace, nothing of EAGER."""
    return (not args and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in EAGER))


def _prefill(args, kwargs) -> bool:
    """Whether a forward is a prefill StepGraphs.compiled_prefill runs compiled: ids of more than
    one token a row into a static cache, a _plain forward, not inside a capture."""
    ids = kwargs.get("input_ids")
    return (_plain(args, kwargs) and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 1
            and _static(_cache(kwargs), filled=False) and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()))


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class _WarmRunFailed(Exception):
    """A call of a compiled step's run before its capture failed: the step runs eagerly, and is
    captured again at a later step of its shape."""


@contextlib.contextmanager
def _cache_state_kept(cache):
    """Around a step run before its capture: the cache's small tensors (StaticLayer's
    cumulative_length, which each step advances) as they were before; the keys and values it writes
    at the step's positions the replay writes again, the same."""
    kept = [(t, t.clone()) for layer in cache.layers for t in _tensors(layer).values() if t.numel() <= SMALL_STATE]
    try:
        yield
    finally:
        for t, before in kept:
            t.copy_(before)


SMALL_STATE = 64  # elements: a cache layer's tensor of at most this many is state, not keys or values


SMALL_ROWS = 16  # a linear of at most this many rows is a reduction in a compiled step (_SmallLinears)
SMALL_PRODUCTS = 1 << 23  # ... and of at most this many products (rows x in x out: a LoRA's A or B is far fewer)


class _SmallLinears(TorchFunctionMode):
    """While a compiled step is traced (only then): F.linear of at most SMALL_ROWS rows (the
    tenant's own linears at a decoding step: its LoRA's A and B) as a product summed in float32 or
    wider, which inductor fuses with the kernels around it, instead of a cuBLAS GEMM of its own (two
    of them a LoRA, four LoRAs a layer: most of a compiled tenant's launches). The precision of the
    GEMM (products and sums in float32, rounded once), another order of the sum. Inputs, weight and
    bias of one dtype only, and not under autocast (whose F.linear computes in another dtype)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and torch.compiler.is_compiling() and not torch.is_autocast_enabled():
            x, weight, bias = linear_args(args, kwargs)
            if (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2 and x.dim() >= 1
                    and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)
                    and x.numel() <= SMALL_ROWS * x.shape[-1]
                    and x.numel() * weight.shape[0] <= SMALL_PRODUCTS):  # (what an eager run would make)
                wide = torch.promote_types(x.dtype, torch.float32)
                y = (x.to(wide).unsqueeze(-1) * weight.t().to(wide)).sum(-2)
                return (y if bias is None else y + bias.to(wide)).to(x.dtype)
        return func(*args, **kwargs)


class _PinnedHostData(TorchFunctionMode):
    """While capturing: torch.tensor(data, device=<a GPU>) made from a page-locked copy of the data
    (kept in `keep`), whose copy a graph may hold; the same values."""

    def __init__(self, keep: list):
        super().__init__()
        self.keep = keep

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            host = torch.tensor(*args, **{**kwargs, "device": "cpu"}).pin_memory()
            self.keep.append(host)
            return host.to(kwargs["device"], non_blocking=True)
        return func(*args, **kwargs)


CACHE_NAMES = ("past_key_values", "cache")  # (the cache's argument and output field: transformers renamed it)


def _cache(kwargs):
    return next((kwargs[n] for n in CACHE_NAMES if kwargs.get(n) is not None), None)


def _static(cache, filled: bool = True) -> bool:
    """Whether cache is a static cache (`filled`: whose layers hold their tensors already) whose
    layers keep all their state in GPU tensors (transformers' StaticLayer exactly: a
    sliding-window layer counts its length on the host)."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    return (bool(layers) and getattr(cache, "is_compileable", False)
            and all(type(layer) is StaticLayer and (layer.is_initialized or not filled) for layer in layers))


def _length(cache) -> int | None:
    """The static cache's length (max_cache_len), or None."""
    length = getattr(cache.layers[0], "max_cache_len", None)
    return length if isinstance(length, int) else None


def _tensors(layer) -> dict[str, torch.Tensor]:
    return {name: v for name, v in vars(layer).items() if isinstance(v, torch.Tensor)}


def _layer_shapes(cache) -> tuple:
    """What a cache must share with the one a graph was captured with (the first layer's tensors,
    the number of layers: a model's layers are alike)."""
    first = cache.layers[0]
    return len(cache.layers), tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in sorted(_tensors(first).items()))


def install(root: torch.nn.Module, transports, compiled: bool = False) -> StepGraphs:
    """Makes root's forward a StepGraphs over its own forward (`compiled`: captured from it compiled)."""
    graphs = StepGraphs(root.forward, transports, compiled=compiled)
    root.forward = graphs
    return graphs
