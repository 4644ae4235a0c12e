"""Cheap repeat launches of @triton.jit kernels.

Triton's JIT entry (`kernel[grid](*args)`) binds the arguments, computes the
specialisation key and looks it up on every call: tens of microseconds of Python. A
`GridLaunch` pays that once per specialisation: its first launch goes through the JIT
and keeps the compiled kernel's runner for its grid; later launches call that runner.
Callers pass a `spec` built from everything Triton specialises on besides the
constexprs fixed for the GridLaunch (dtypes, 16-byte alignment of pointers, int
arguments == 1 or % 16), so a runner is only reused where the JIT would pick the same
compiled kernel.
"""

from __future__ import annotations

_INTERNED: dict[tuple, int] = {}


def intern(t: tuple) -> int:
    """A small int standing for `t` (process-wide), so that cache keys hash cheaply."""
    return _INTERNED.setdefault(t, len(_INTERNED))


def ptr_spec(t) -> bool:
    """What Triton specialises a pointer argument on: its 16-byte alignment."""
    return t.data_ptr() % 16 == 0


def int_spec(v: int) -> int:
    """What Triton specialises an int argument on: == 1, divisible by 16, or neither."""
    assert -2 ** 31 <= v < 2 ** 31, "int arguments must fit int32"
    return 0 if v == 1 else 1 if v % 16 == 0 else 2


class CompiledKernels:
    """The compiled kernels of one @triton.jit function, by specialisation key."""

    enabled = True
    """False once a Triton's compiled-kernel runner refused our arguments: JIT only from then."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict[tuple, object] = {}

    def runner(self, key: tuple, grid: tuple[int, int, int]):
        """The runner of the kernel compiled for `key` at `grid`, or None if not compiled yet."""
        kernel = self.compiled.get(key)
        return kernel[grid] if kernel is not None else None

    def launch_jit(self, key: tuple | None, grid: tuple[int, int, int], args: tuple, num_warps: int,
                   num_stages: int) -> None:
        """Launch through Triton's JIT and keep the compiled kernel under `key` (if not None)."""
        kernel = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
        if key is not None and kernel is not None and hasattr(kernel, "__getitem__"):
            self.compiled[key] = kernel


class GridLaunch:
    """Launches of one kernel with fixed constexprs, grid, warps and stages."""

    __slots__ = ("kernels", "grid", "kernel_id", "num_warps", "num_stages", "runners")

    def __init__(self, kernels: CompiledKernels, grid: tuple[int, int, int], kernel_id: int,
                 num_warps: int, num_stages: int):
        self.kernels = kernels
        self.grid = grid
        self.kernel_id = kernel_id      # interned constexprs and int specialisations fixed here
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.runners: dict[tuple, object] = {}

    def __call__(self, spec: tuple | None, args: tuple) -> None:
        """Launch with `args` (constexprs included, in kernel order). `spec` None: through the
        JIT every time (Triton's CPU interpreter, which has no compiled kernels)."""
        if spec is not None and CompiledKernels.enabled:
            runner = self.runners.get(spec)
            if runner is None:
                runner = self.kernels.runner((self.kernel_id, *spec), self.grid)
                if runner is not None:
                    self.runners[spec] = runner
            if runner is not None:
                try:
                    runner(*args)
                    return
                except TypeError:  # a Triton whose runner wants other arguments: JIT from now on
                    CompiledKernels.enabled = False
                    self.runners.clear()
        key = (self.kernel_id, *spec) if spec is not None and CompiledKernels.enabled else None
        self.kernels.launch_jit(key, self.grid, args, self.num_warps, self.num_stages)
