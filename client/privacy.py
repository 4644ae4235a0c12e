"""Noise masking: the executor sees a linear unit's input only with noise added, and the tenant
removes the noise's effect from the reply, so the model computes what it would unmasked.

For a linear unit y = x W^T + b the tenant sends x + n and subtracts n W^T from the reply; for
its backward, grad_x = g W, it sends g + m and subtracts m W. The noise of every call is fresh: a
secret random combination n = s * C N of the unit's noise basis N (rank k rows of d_in, drawn
once from a secret seed), with C drawn anew per call, and s the scale times the input's RMS. The
effects N W^T (and M W of the backward basis M) are computed once per unit, either

- by the executor (`effects="executor"`, as in Symbiosis 3.8): one FORWARD_NO_BIAS (BACKWARD)
  call of the basis itself at the unit's first masked call, so the executor learns the basis
  (it can then remove the noise's span from what it sees); or
- by the tenant (`effects="local"`), from the public base weights it holds
  (`weights`: a state dict of the base model, e.g. `AutoModelForCausalLM.from_pretrained(...).state_dict()`):
  the executor never sees any noise alone.

Cost per unit: 2 k (d_in + d_out) values of the unit's dtype for the bases and effects (computed
in float32, kept in it), and per call two GEMMs of [tokens, k] by [k, d]. Removing the noise is
exact up to the rounding of the served dtype at the noised magnitude (tests/test_privacy.py,
`tiny-llama`): in float32 logits and adapter gradients stay within 5e-6 x max(1, s) relative
(the worst of 10 runs: gradients 1.6e-6 at s = 1, 3.0e-5 at s = 30; logits 5e-7 at s = 1); in
bfloat16 within twice the bfloat16 model's own distance from float32 plus 5e-3 x s (the worst of
10 runs: 0.007 at s = 0.1, 0.008 at 1, 0.040 at 10, the bfloat16 model being 0.006 from float32;
0.050 at 10 for calls of LOW_NOISE_MIN values or more, masked by GEMMs in bfloat16). Embeddings (ids) and whole-MLP calls are never
masked: virtualize(mask=...) calls an MLP's Linears one by one.
"""
from __future__ import annotations

import dataclasses
import secrets
import threading

import torch

from symbiont.proto import executor_pb2 as pb

MASKED_KINDS = ("linear", "conv1d")
# From this many values a bfloat16 (float16) call's noise and its removal are GEMMs in its own
# dtype: float32 copies of a big input and reply cost more than the GEMMs (the tenant's masking at
# 4096 x 2048 bf16 on the 2-core VM: 62 ms with them); below it the casts cost more than they save.
LOW_NOISE_MIN = 1 << 18
# Below this many values a CPU call's two masking GEMMs ([tokens, k] by [k, d]) run on one thread:
# MKL splits even these over its threads, and waking sleeping OpenMP threads (OMP_WAIT_POLICY=PASSIVE,
# as the README asks of CPU tenants) costs more than the GEMM (16 x 2048, k = 16, float32, 2-core VM:
# 14 us on one thread, 54 on two).
ONE_THREAD_MAX = 1 << 18
SCRATCH_MAX_BYTES = 64 << 20  # the largest masked CPU input kept in memory reused between calls


@dataclasses.dataclass
class NoiseMask:
    """How a tenant masks its calls: pass to virtualize(..., mask=NoiseMask(...))."""

    scale: float = 1.0
    """Noise RMS relative to the RMS of the tensor it masks."""
    rank: int = 16
    """Rows k of each unit's noise basis: every call's noise is a fresh combination of them."""
    effects: str = "local"
    """"local": computed from `weights` (the executor never sees noise alone); "executor": by the
    executor from the basis at the unit's first call (it learns the basis)."""
    weights: dict | None = None
    """effects="local": the base model's state dict (unit id + ".weight" -> tensor)."""
    backward: bool = True
    """Mask the gradients sent by backward calls too."""

    def __post_init__(self):
        if self.effects not in ("local", "executor"):
            raise ValueError(f"effects must be 'local' or 'executor', got {self.effects!r}")
        if self.effects == "local" and self.weights is None:
            raise ValueError('effects="local" needs weights= (the public base checkpoint\'s state dict)')
        if self.rank < 1 or self.scale < 0:
            raise ValueError(f"need rank >= 1 and scale >= 0, got rank={self.rank}, scale={self.scale}")
        self._rng: dict = {}  # device -> a generator seeded from the OS's secret randomness
        self._local = threading.local()  # .scratch: a thread's memory for its CPU calls' masked inputs (_scratch)
        self._units: dict[str, "_UnitNoise"] = {}
        self._members: dict[str, list[str]] = {}  # group unit -> its member units (from the catalog)

    def __deepcopy__(self, memo):
        return self  # (a copied model masks with the same secrets)

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._rng.get(device)
        if g is None:
            g = self._rng[device] = torch.Generator(device=device)
            g.manual_seed(secrets.randbits(63))
        return g

    # ---- per unit ------------------------------------------------------------------

    def _weight(self, unit_id: str, kind: str, device) -> torch.Tensor:
        """W as [d_out, d_in] in float32 from `weights` (a group's members side by side)."""
        members = self._members.get(unit_id) or [unit_id]
        parts = []
        for m in members:
            w = self.weights.get(m + ".weight")
            if w is None:
                raise KeyError(f"noise mask: weights has no {m + '.weight'!r} (effects='local' needs the base state dict)")
            parts.append(w.T if kind == "conv1d" else w)  # (GPT-2's Conv1D keeps [d_in, d_out])
        return torch.cat(parts).to(device=device, dtype=torch.float32)

    def _unit(self, ref, device: torch.device) -> "_UnitNoise":
        u = self._units.get(ref.unit_id)
        if u is not None and u.device == device:
            return u
        g = self._generator(device)
        k = self.rank
        n = torch.randn(k, ref._d_in, generator=g, device=device)
        m = torch.randn(k, ref._d_out, generator=g, device=device) if self.backward else None
        dt = ref._dtype  # the bases are values of the unit's dtype: what its GEMMs take, exactly
        n, m = n.to(dt).float(), (m.to(dt).float() if m is not None else None)
        if self.effects == "local":
            w = self._weight(ref.unit_id, ref._kind, device)
            e, f = n @ w.T, (m @ w if m is not None else None)
        else:  # the executor's, through the unit itself (it sees the bases once)
            t = ref.transport
            e = t.call(ref.unit_id, pb.FORWARD_NO_BIAS, n.to(dt), (k, ref._d_out), dt, pb.TRAINING).float()
            f = t.call(ref.unit_id, pb.BACKWARD, m.to(dt), (k, ref._d_in), dt, pb.TRAINING).float() if m is not None else None
        u = self._units[ref.unit_id] = _UnitNoise(device, n, e, m, f)
        return u

    def _scratch(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Memory of rows' shape and dtype for a CPU call's masked input, reused call after call (a
        fresh tensor of several MiB costs its page faults anew, as much as the masking's GEMMs);
        None for a GPU call or one over SCRATCH_MAX_BYTES. Per thread: calls of one thread return
        before its next (Transport.call: the input has been read by then). Each thread that masks
        keeps its largest such input's memory (up to SCRATCH_MAX_BYTES) while the mask lives."""
        nbytes = rows.numel() * rows.element_size()
        if rows.device.type != "cpu" or nbytes > SCRATCH_MAX_BYTES:
            return None
        kept = getattr(self._local, "scratch", None)
        if kept is None or kept.dtype != rows.dtype or kept.numel() < rows.numel():
            with torch.inference_mode(False):  # (made under inference_mode it could not be written outside it)
                kept = self._local.scratch = torch.empty(rows.numel(), dtype=rows.dtype)
        return kept[: rows.numel()].view(rows.shape)

    def call(self, ref, x: torch.Tensor, op: int, send):
        """`op` of ref's unit on x, masked, through send(v, take) -> take(the reply to v) (the
        transport's call: take reads the reply where it lies); None when this call is not masked.
        A small CPU call runs on this thread alone (ONE_THREAD_MAX), its reply included."""
        if ref._kind not in MASKED_KINDS or op == pb.FORWARD_NO_BIAS or (op == pb.BACKWARD and not self.backward) or not x.numel():
            return None  # (an empty input, an expert no token chose, carries nothing to hide)
        u = self._unit(ref, x.device)
        threads = torch.get_num_threads()  # (this thread's: OpenMP's count is per thread; restored as it was)
        if x.device.type != "cpu" or x.numel() >= ONE_THREAD_MAX or threads == 1:
            return self._masked(u, x, op, send)
        torch.set_num_threads(1)
        try:
            return self._masked(u, x, op, send)
        finally:
            torch.set_num_threads(threads)

    def _masked(self, u: "_UnitNoise", x: torch.Tensor, op: int, send):
        basis, effect = (u.n, u.e) if op == pb.FORWARD else (u.m, u.f)
        rows = x.reshape(-1, x.shape[-1])
        low = x.dtype != torch.float32 and rows.numel() >= LOW_NOISE_MIN
        # a small bf16 (float16) call: its float32 copy, whose norm is taken and to which the noise is
        # added in place (0.87x the ops of a norm over x and a fresh sum, 16 tokens, 2-core VM)
        wide = rows.float() if x.dtype != torch.float32 and not low else None
        # (a float32 reduction over a big bf16 tensor took 16 ms at 4096 x 2048; in its dtype, 1 ms)
        norm = torch.linalg.vector_norm(rows if wide is None else wide).float()
        c = torch.randn(rows.shape[0], self.rank, generator=self._generator(x.device), device=x.device)
        factor = self.scale / (rows.numel() * self.rank) ** 0.5  # (noise RMS = scale x the input's)
        # the reply is (x + s c basis) W^T (+ b): take() takes away s c (basis W^T), the noise's
        # effect, reading the reply where the transport has it and writing the result once
        if x.device.type == "cpu" and not low:  # s as the GEMMs' alpha: two tensor ops fewer (reading a CPU norm waits for nothing)
            s = float(norm) * factor
        else:  # (on a GPU the norm stays there, reading it would wait for the GPU; a big bf16 call's c goes to its dtype)
            c *= norm * factor
            s = 1.0
        if not low:
            if wide is None:
                v = torch.addmm(rows, c, basis, alpha=s, out=self._scratch(rows))  # (out=None: a new tensor)
            else:  # (a small bf16 call: its float32 copies cost less than GEMMs in bf16)
                v = wide.addmm_(c, basis, alpha=s).to(x.dtype)

            def take(y):
                flat = y.reshape(-1, y.shape[-1])
                if flat.dtype == torch.float32:  # (the reply where the transport has it: read, not written)
                    return torch.addmm(flat, c, effect, alpha=-s).view(y.shape)
                return flat.float().addmm_(c, effect, alpha=-s).to(y.dtype).view(y.shape)

            return send(v.view(x.shape), take)
        # a big bf16 (float16) call: both GEMMs in its dtype, the addition in their float32
        # epilogue (one rounding, as the float32 path's), no float32 copy of x or y
        c = c.to(x.dtype)
        v = torch.addmm(rows, c, u.low(basis, x.dtype), out=self._scratch(rows))

        def take_low(y):
            return torch.addmm(y.reshape(-1, y.shape[-1]), c, u.low(effect, y.dtype), alpha=-1).view(y.shape)

        return send(v.view(x.shape), take_low)


@dataclasses.dataclass
class _UnitNoise:
    device: torch.device
    n: torch.Tensor  # [k, d_in]  forward basis
    e: torch.Tensor  # [k, d_out] its effect, n W^T
    m: torch.Tensor | None  # [k, d_out] backward basis
    f: torch.Tensor | None  # [k, d_in]  its effect, m W
    _low: dict = dataclasses.field(default_factory=dict)

    def low(self, basis: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A basis or effect in the unit's dtype (a basis's values are that dtype's already), made once."""
        v = self._low.get((id(basis), dtype))
        if v is None:
            v = self._low[(id(basis), dtype)] = basis.to(dtype)
        return v
