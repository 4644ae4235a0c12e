"""Tiling table for the ATMM kernels: which tile shapes to launch for which input shape.

An ATMM call is classified into a `ShapeClass` (active tokens, adapters, rank bucket,
input and output width). A `TilingTable` maps shape classes to `TileConfig`s for one
GPU; `tune-atmm` fills it by profiling and saves it as versioned JSON keyed by GPU
name. Lookup never fails: an unseen class takes the nearest profiled class (distance in
log2 space), and a GPU with no table takes the built-in defaults below, which encode
what profiling on an H100 found (benchmarks/RESULTS.md, S7).

No Triton import here: this module is plain Python so the executor can read tables
on any machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

FORMAT = "symbiont-atmm-tiling"
VERSION = 2  # 2: fused column groups adjacent in the grid (2026-11-22); tables of 1 timed the old order
MAX_RANK = 128
# Token-tile heights for which a segment plan prebuilds its tile map.
BLOCK_MS = (16, 32, 64, 128)
# Shared memory a config may plan for (H100/H200 allow 227 KiB per block; keep slack).
SMEM_BUDGET = 200 * 1024
DEFAULT_PATH = Path("~/.cache/symbiont/atmm_tiling.json").expanduser()


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    """Launch parameters of one ATMM call."""

    mode: str
    """'split': a shrink kernel then an expand kernel; 'fused': one kernel doing both."""
    block_m: int
    """Token rows per program (one adapter per tile); one of BLOCK_MS."""
    block_k: int
    """Reduction step over the input width in the shrink."""
    block_n: int
    """Output columns per expand step."""
    split: int = 1
    """'split' mode: programs splitting the shrink's reduction (split-K).
    'fused' mode: programs splitting the output columns (each redoes the shrink)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the shrink loop."""

    def __post_init__(self) -> None:
        if self.mode not in ("split", "fused"):
            raise ValueError(f"mode must be 'split' or 'fused', got {self.mode!r}")
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"block_m must be one of {BLOCK_MS}, got {self.block_m}")
        for name in ("block_k", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad split/num_warps/num_stages in {self}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def short(self) -> str:
        return (f"{self.mode[0]}{self.block_m}x{self.block_k}x{self.block_n}"
                f"s{self.split}w{self.num_warps}p{self.num_stages}")


def block_r_for(max_rank: int) -> int:
    """Rank tile: the next power of two >= max_rank, at least 16 (tl.dot's minimum)."""
    if not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"adapter rank must be in 1..{MAX_RANK}, got {max_rank}")
    return max(16, 1 << (max_rank - 1).bit_length())


def fit_config(cfg: TileConfig, block_r: int, elem_size: int = 2) -> TileConfig:
    """Shrink stages (then block_k) until the shared-memory estimate fits SMEM_BUDGET.

    Deterministic, so a table entry tuned at a small rank still launches at rank 128.
    """
    def smem(c: TileConfig) -> int:
        shrink = c.num_stages * (c.block_m * c.block_k + c.block_k * block_r)
        expand = 2 * (block_r * c.block_n + c.block_m * c.block_n)
        return elem_size * max(shrink, expand) + 4 * c.block_m * block_r

    while smem(cfg) > SMEM_BUDGET:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        elif cfg.block_n > 32:
            cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
        else:
            break
    return cfg


def _pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, kw_only=True, order=True)
class ShapeClass:
    """What an ATMM call looks like, bucketed so that nearby calls share a tiling."""

    tokens: int
    """Active token rows, rounded up to a power of two."""
    adapters: int
    """Distinct adapters in the batch, rounded up to a power of two."""
    rank: int
    """Rank tile (block_r_for of the largest rank)."""
    h_in: int
    """Input width (x columns)."""
    h_out: int
    """Output width (y columns)."""

    @classmethod
    def of(cls, tokens: int, adapters: int, max_rank: int, h_in: int, h_out: int) -> "ShapeClass":
        return cls(tokens=_pow2_ceil(tokens), adapters=_pow2_ceil(adapters),
                   rank=block_r_for(max_rank), h_in=h_in, h_out=h_out)

    def distance(self, other: "ShapeClass") -> float:
        d = lambda a, b: abs(math.log2(a) - math.log2(b))  # noqa: E731
        return (2.0 * d(self.tokens, other.tokens) + d(self.adapters, other.adapters)
                + 1.5 * d(self.rank, other.rank) + 0.5 * d(self.h_in, other.h_in)
                + 0.5 * d(self.h_out, other.h_out))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def builtin_config(cls: ShapeClass) -> TileConfig:
    """The tiling used when no profiled table exists for this GPU: what two tuning runs on
    H100 machines agreed on (4096 x 4096; benchmarks/results/atmm_tiling_h100*.json).

    From 4096 tokens: shrink then expand, except at rank 128, where one fused launch with
    4 (4096) or 2 (8192) column groups was faster. Below: one fused launch (launch-bound:
    one launch is cheaper than two), 16-row tiles up to 256 tokens of rank <= 64; except
    64 adapters of rank >= 64, where both tables took shrink then expand.
    """
    if cls.tokens >= 4096:
        if cls.rank >= 128:
            return TileConfig(mode="fused", block_m=64, block_k=64, block_n=128, split=4 if cls.tokens <= 4096 else 2)
        return TileConfig(mode="split", block_m=32, block_k=128, block_n=128, split=2)
    if cls.adapters >= 64 and cls.rank >= 64:
        return TileConfig(mode="split", block_m=32, block_k=128, block_n=128, split=2)
    if cls.tokens <= 256 and cls.rank <= 64:
        return TileConfig(mode="fused", block_m=16, block_k=128 if cls.rank <= 16 else 256, block_n=64, split=8)
    return TileConfig(mode="fused", block_m=64, block_k=64, block_n=128, split=8)


def gpu_name() -> str:
    """The name tables are keyed by: torch.cuda's device name, or 'cpu'."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return "cpu"


class TilingTable:
    """Profiled tile configs of one GPU; `lookup` never fails."""

    def __init__(self, gpu: str, entries: dict[ShapeClass, TileConfig] | None = None,
                 *, static_best: TileConfig | None = None, meta: dict | None = None,
                 timings: dict[ShapeClass, dict] | None = None):
        self.gpu = gpu
        self.entries = dict(entries or {})
        self.static_best = static_best
        """The one config that was best over all profiled classes (geometric mean)."""
        self.meta = dict(meta or {})
        self.timings = dict(timings or {})
        """Per class, what profiling measured (microseconds), kept for the record."""
        self._memo: dict[tuple, TileConfig] = {}

    def lookup(self, tokens: int, adapters: int, max_rank: int, h_in: int, h_out: int) -> TileConfig:
        """Config for a call: exact class, else nearest profiled class, else built-in."""
        key = (tokens, adapters, max_rank, h_in, h_out)
        cfg = self._memo.get(key)
        if cfg is None:
            cls = ShapeClass.of(tokens, adapters, max_rank, h_in, h_out)
            cfg = self.entries.get(cls)
            if cfg is None and self.entries:
                nearest = min(self.entries, key=lambda c: (cls.distance(c), c))
                cfg = self.entries[nearest]
            if cfg is None:
                cfg = builtin_config(cls)
            cfg = fit_config(cfg, cls.rank)
            self._memo[key] = cfg
        return cfg

    # ---- persistence -------------------------------------------------------------
    def to_json_dict(self) -> dict:
        return {
            "meta": self.meta,
            "static_best": self.static_best.to_dict() if self.static_best else None,
            "entries": [{"class": c.to_dict(), "config": cfg.to_dict(), **self.timings.get(c, {})}
                        for c, cfg in sorted(self.entries.items())],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write this GPU's table into `path`, keeping other GPUs' tables there."""
        path = Path(path)
        doc = _read(path) if path.exists() else None
        if doc is None:
            doc = {"format": FORMAT, "version": VERSION, "gpus": {}}
        doc["gpus"][self.gpu] = self.to_json_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, gpu: str | None = None) -> "TilingTable":
        """This GPU's table from `path` (default ~/.cache/symbiont/atmm_tiling.json).

        A missing file, a file of another format version, or a file with no entry for
        this GPU gives an empty table (built-in defaults), never an error.
        """
        gpu = gpu or gpu_name()
        path = Path(path) if path is not None else DEFAULT_PATH
        doc = _read(path) if path.exists() else None
        g = (doc or {}).get("gpus", {}).get(gpu)
        if not g:
            return cls(gpu)
        entries, timings = {}, {}
        for e in g.get("entries", []):
            c = ShapeClass(**e["class"])
            entries[c] = TileConfig.from_dict(e["config"])
            timings[c] = {k: v for k, v in e.items() if k not in ("class", "config")}
        sb = g.get("static_best")
        return cls(gpu, entries, static_best=TileConfig.from_dict(sb) if sb else None,
                   meta=g.get("meta"), timings=timings)


def _read(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        return None
    return doc


_DEFAULT: dict[str, TilingTable] = {}


def default_table() -> TilingTable:
    """The table the launchers use when none is passed (loaded once per process)."""
    name = gpu_name()
    if name not in _DEFAULT:
        _DEFAULT[name] = TilingTable.load(DEFAULT_PATH, name)
    return _DEFAULT[name]


def candidate_configs(quick: bool = False) -> list[TileConfig]:
    """Tilings `tune-atmm` profiles. Splits vary at run time (no recompile)."""
    fused = [(16, 128, 64, 4, 3), (16, 256, 64, 4, 3), (32, 128, 64, 4, 3), (64, 64, 128, 4, 3)]
    split = [(16, 128, 128, 4, 3), (32, 128, 128, 4, 3), (64, 64, 128, 4, 3),
             (64, 128, 128, 8, 3), (128, 64, 128, 8, 3), (64, 64, 256, 8, 3)]
    out: list[TileConfig] = []
    for bm, bk, bn, w, s in fused:
        for sp in ((4, 16) if quick else (1, 2, 4, 8, 16, 64)):
            out.append(TileConfig(mode="fused", block_m=bm, block_k=bk, block_n=bn, split=sp,
                                  num_warps=w, num_stages=s))
    for bm, bk, bn, w, s in split:
        for sp in ((1, 4) if quick else (1, 2, 4, 8)):
            out.append(TileConfig(mode="split", block_m=bm, block_k=bk, block_n=bn, split=sp,
                                  num_warps=w, num_stages=s))
    return out
