"""Shared machinery of ``bench_gated_delta_rule.py`` and ``profile/profile_gdr.py``.

What lives here (and nowhere else):

* the shape vocabulary and the benchmark grids (:class:`Shape`, :func:`forward_grid`, ...),
* model-realistic input generation (:func:`make_inputs`), identical in every process,
* one wrapper per implementation (ours, FLA, FlashInfer, FlashQLA) that gives each its
  own conventions (:data:`IMPLS`),
* timing (``triton.testing.do_bench`` median, rotating input buffers, CUDA-graph replay),
* the worker: every measurement runs in a fresh subprocess, ``python common.py --worker
  SPEC.json``, one per (implementation, shape). That is fair to FLA's autotuner (it tunes
  on the first shape a process sees and, by default, caches the result on disk: workers
  set ``FLA_CACHE_RESULTS=0``) and isolates FlashQLA 0.1.3, whose import name
  ``flash_qla`` is ours too.

The parent processes never import torch: they plan, spawn workers and render reports.
Shapes follow ``docs/gdn-math.md``: q, k ``[B,T,Hk,K]``, v ``[B,T,Hv,V]``,
g, beta ``[B,T,Hv]``, states ``[N,Hv,K,V]`` fp32, K = V = 128, chunk C = 64.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

HEAD_DIM = 128  # K = V = 128 everywhere (the head size of every model in the grid)
CHUNK = 64
L2_BYTES = 60e6  # inputs smaller than this are rotated so that no call finds them in L2
H200_BW = 4.3e12  # B/s, measured device copy (read + write), gdn-math.md
H200_FLOPS = 790e12  # FLOP/s, measured bf16 dense GEMM, gdn-math.md
FWD_FLOP_PER_TOKEN_HEAD = 176e3  # gdn-math.md cost model (FLA's unfused pipeline)
BWD_FLOP_PER_TOKEN_HEAD = 508e3
TOL = 2e-2  # relative error above which a peer's timing is flagged as a MISMATCH

# the core's dispatch.install_hint((9, 0)), spelled out: the benchmark must explain
# itself where flash_qla is not installed (tests/test_scripts.py keeps the two equal)
INSTALL_HINT = (
    'pip install -e packages/flash-qla-tilelang -e packages/flash-qla-sm90 (from a clone; '
    'after the 0.2 release: pip install "flash-qla[sm90]")'
)
NO_GPU_LINE = (
    "error: this benchmark needs a CUDA GPU (none is visible) and the kernels "
    f"({INSTALL_HINT}); run `--device cpu` for the small CPU demo."
)

# "ours" is the drop-in call: FLA's keywords, device cu_seqlens only, auto_cp=True (what
# FLA 0.5.2+ passes when it routes to an installed flash_qla). Ours in other conventions:
# "unsplit" (auto_cp=False: what the automatic split gains), "host-offsets" (also
# cu_seqlens_cpu), "fla-routed" (FLA's own chunk_gated_delta_rule with this package
# installed, which FLA routes to: must equal ours). "fla" is FLA with that routing off
# (FLA_FLASH_QLA=0), its own Triton kernels.
PEERS = ("fla", "flashinfer", "flashqla", "unsplit", "host-offsets", "fla-routed")
LABELS = {
    "ours": "FlashQLA (ours, drop-in call)",
    "fla": "FLA",
    "flashinfer": "FlashInfer",
    "flashqla": "FlashQLA (peer)",
    "unsplit": "FlashQLA (ours, auto_cp=False)",
    "host-offsets": "FlashQLA (ours, + cu_seqlens_cpu)",
    "fla-routed": "FLA routed to ours",
}
SHORT = {"ours": "ours", "fla": "FLA", "flashinfer": "FlashInfer", "flashqla": "FlashQLA-0.1.3",
         "unsplit": "unsplit", "host-offsets": "host-offsets", "fla-routed": "via-FLA"}
# our own code: runs on the CPU (torch backend) too
OURS_FAMILY = ("ours", "unsplit", "host-offsets")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# --------------------------------------------------------------------------------------
# Shapes and grids
# --------------------------------------------------------------------------------------

FWD_HEADS = [
    (2, 4),
    (2, 8),
    (4, 8),
    (4, 16),
    (8, 16),
    (8, 32),
    (16, 32),
    (16, 48),
    (16, 64),
    (16, 16),
    (32, 32),
]
FWD_LAYOUTS = [
    "1x32768",
    "1x8192",
    "1x2048",
    "2x16384",
    "4x8192",
    "8x4096",
    "8x1024",
    "varlen-a",
    "varlen-b",
]
BWD_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4), (16, 16), (8, 8), (4, 4)]
BWD_LAYOUTS = ["1x8192", "2x4096", "4x2048", "8x1024", "1x32768", "2x16384", "4x8192", "8x4096"]
QUICK = [
    "fwd:2/8@1x2048",
    "fwd:16/32@1x8192",
    "fwd:4/16@1x32768",
    "fwd:16/64@varlen-a",
    "bwd:16/16@1x8192",
]
CPU_TINY = ["fwd:2/4@1x128", "fwd:2/4@seqs=50+78", "bwd:2/2@1x64"]

# The serving grid (``--grid serve``): packed prefill batches of many short sequences, as
# an engine's prefill step sends them, from 256 to 16k tokens, in the engine's
# convention (inference mode, device cu_seqlens, states in a pool indexed per sequence).
SERVE_HEADS = [(16, 32), (16, 64)]
SERVE_LAYOUTS = ["4x64", "8x128", "16x256", "32x512", "serve-mix-2k", "serve-mix-16k"]
# Ragged serving mixes: (seed, sequences, tokens), lengths spread ~30x as varlen_mix does.
SERVE_MIXES = {"serve-mix-2k": (5, 16, 2048), "serve-mix-16k": (6, 64, 16384)}
CPU_SERVE = ["fwd:2/4@4x64", "fwd:2/4@seqs=50+78+1"]
#: State-pool dtypes of the serving grid (``--serve-pool-dtype``).
SERVE_POOL_DTYPES = ("float32", "bfloat16")

# Two seeded random mixes of 32k packed tokens: (seed, number of sequences).
VARLEN_MIXES = {"varlen-a": (1, 8), "varlen-b": (2, 40)}


def varlen_mix(seed: int, n: int, total: int = 32768) -> list[int]:
    """``n`` positive lengths summing to ``total``, log-uniformly spread over ~30x.

    Deterministic (``random.Random`` with an int seed is stable across Python
    versions); lengths are mostly not multiples of 64, as in real batches. No empty
    sequence (FLA 0.5.0 mis-handles those).
    """
    rng = random.Random(seed)
    w = [math.exp(rng.random() * math.log(30.0)) for _ in range(n)]
    s = sum(w)
    lens = [max(1, int(total * x / s)) for x in w]
    lens[-1] += total - sum(lens)
    if lens[-1] < 1:
        raise ValueError(f"cannot split {total} tokens into {n} sequences")
    return lens


def parse_layout(layout: str) -> list[int]:
    """Sequence lengths of a layout: ``BxT``, a named mix, or ``seqs=L1+L2+...``."""
    if layout in VARLEN_MIXES:
        return varlen_mix(*VARLEN_MIXES[layout])
    if layout in SERVE_MIXES:
        return varlen_mix(*SERVE_MIXES[layout])
    m = re.fullmatch(r"(\d+)x(\d+)", layout)
    if m:
        b, t = int(m.group(1)), int(m.group(2))
        if b < 1 or t < 1:
            raise ValueError(f"bad layout {layout!r}")
        return [t] * b
    m = re.fullmatch(r"seqs=(\d+(?:\+\d+)*)", layout)
    if m:
        lens = [int(x) for x in m.group(1).split("+")]
        if min(lens) < 1:
            raise ValueError(f"bad layout {layout!r}: empty sequence")
        return lens
    raise ValueError(
        f"bad layout {layout!r}: expected BxT (e.g. 8x4096), "
        f"{' / '.join(VARLEN_MIXES)} or seqs=L1+L2+..."
    )


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration. ``mode`` is ``fwd`` or ``bwd``."""

    mode: str
    hk: int
    hv: int
    layout: str

    @property
    def seqlens(self) -> list[int]:
        return parse_layout(self.layout)

    @property
    def tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def n_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def uniform(self) -> bool:
        return len(set(self.seqlens)) == 1

    @property
    def key(self) -> str:
        return f"{self.mode}:{self.hk}/{self.hv}@{self.layout}"

    @property
    def label(self) -> str:
        mixes = (*VARLEN_MIXES, *SERVE_MIXES)
        tail = f" ({self.n_seqs} seqs)" if self.layout in mixes else ""
        return f"{self.hk}/{self.hv} {self.layout}{tail}"

    def validate(self) -> Shape:
        if self.mode not in ("fwd", "bwd"):
            raise ValueError(f"bad mode {self.mode!r}")
        if self.hk < 1 or self.hv < 1 or self.hv % self.hk:
            raise ValueError(f"bad heads {self.hk}/{self.hv}: need Hv a multiple of Hk")
        parse_layout(self.layout)
        return self

    @classmethod
    def from_key(cls, key: str) -> Shape:
        m = re.fullmatch(r"(fwd|bwd):(\d+)/(\d+)@(\S+)", key)
        if not m:
            raise ValueError(f"bad shape {key!r}: expected MODE:HK/HV@LAYOUT")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)).validate()


def forward_grid() -> list[Shape]:
    return [Shape("fwd", hk, hv, lay) for hk, hv in FWD_HEADS for lay in FWD_LAYOUTS]


def serve_grid() -> list[Shape]:
    """The serving grid: :data:`SERVE_HEADS` x :data:`SERVE_LAYOUTS`, forward only."""
    return [Shape("fwd", hk, hv, lay) for hk, hv in SERVE_HEADS for lay in SERVE_LAYOUTS]


def backward_grid() -> list[Shape]:
    return [Shape("bwd", hk, hv, lay) for hk, hv in BWD_HEADS for lay in BWD_LAYOUTS]


def select_shapes(spec: str | None, modes: list[str], base: list[Shape]) -> list[Shape]:
    """Filter ``base`` by ``spec`` (comma-separated ``[MODE:]HK/HV@LAYOUT``, shell
    wildcards allowed) and ``modes``. A wildcard-free item that is not in ``base`` is
    added as a custom shape."""
    base = [s for s in base if s.mode in modes]
    if not spec:
        return base
    out: list[Shape] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        item_modes = modes
        m = re.match(r"(fwd|bwd):(.*)", item)
        if m:
            item_modes, item = [m.group(1)], m.group(2)
        if "@" not in item:
            raise ValueError(f"bad --shapes item {item!r}: expected HK/HV@LAYOUT")
        heads, layout = item.split("@", 1)
        hits = [
            s
            for s in base
            if s.mode in item_modes
            and fnmatch.fnmatchcase(f"{s.hk}/{s.hv}", heads)
            and fnmatch.fnmatchcase(s.layout, layout)
        ]
        if not hits and not any(c in item for c in "*?["):
            hk, _, hv = heads.partition("/")
            if not (hk.isdigit() and hv.isdigit()):
                raise ValueError(f"bad --shapes item {item!r}: heads must be HK/HV")
            hits = [Shape(md, int(hk), int(hv), layout).validate() for md in item_modes]
        if not hits:
            raise ValueError(f"--shapes item {item!r} matches no configuration")
        out += [s for s in hits if s not in out]
    return out


def shape_floor(shape: Shape) -> dict:
    """H200 floor of our forward: max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s).

    Bytes per token: q, k (Hk*K*2 B each), v, o (Hv*V*2 B each), A (Hv*64*2 B), the gates
    (g fp32 + beta bf16 = 6 B per value head); plus the initial and final state
    (N*Hv*K*V*4 B each), which this benchmark always reads and writes.
    """
    t, n, hk, hv, d = shape.tokens, shape.n_seqs, shape.hk, shape.hv, HEAD_DIM
    per_tok = hk * d * 2 * 2 + hv * d * 2 * 2 + hv * CHUNK * 2 + hv * 6
    nbytes = t * per_tok + 2 * n * hv * d * d * 4
    flops = FWD_FLOP_PER_TOKEN_HEAD * t * hv
    floor_s = max(nbytes / H200_BW, flops / H200_FLOPS)
    return {
        "bytes": nbytes,
        "flops": flops,
        "floor_ms": floor_s * 1e3,
        "bound": "memory" if nbytes / H200_BW >= flops / H200_FLOPS else "compute",
    }


def read_settings_csv(path: str) -> list[tuple[int, int, str]]:
    """Rows ``hk,hv,layout`` of a profile settings file (``#`` comments allowed)."""
    import csv

    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(line for line in f if not line.lstrip().startswith("#")):
            rows.append((int(row["hk"]), int(row["hv"]), row["layout"].strip()))
    return rows


# --------------------------------------------------------------------------------------
# Inputs (worker side: torch is imported lazily)
# --------------------------------------------------------------------------------------

GATES = {
    "model": "g = -exp(A_log) * softplus(a + dt_bias), a ~ N(0,1), per-head A_log = log U[1,16], "
    "dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Qwen3-Next/Mamba2 init)",
    "zero": "g = 0 (no decay at all: the longest memory, no gate-driven shortcut can apply)",
    "strong": "g = -exp(A_log) * softplus(a + 2): g ~ -2..-35 per token, the state is "
    "forgotten within a token or two (stresses exp underflow)",
}


def make_inputs(shape: Shape, gate: str, seed: int, device: str, with_grads: bool):
    """Model-realistic inputs in the canonical packed layout ``[1, T, H, D]``.

    Generated on ``device`` from a seeded generator: every worker process gets the
    same bits (checked through :func:`fingerprint`). A uniform ``BxT`` layout can be
    viewed as dense ``[B, T, ...]`` without copying.
    """
    import torch
    import torch.nn.functional as F

    t, hk, hv, n, d = shape.tokens, shape.hk, shape.hv, shape.n_seqs, HEAD_DIM
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    q = F.normalize(randn(1, t, hk, d), p=2, dim=-1).to(dtype)
    k = F.normalize(randn(1, t, hk, d), p=2, dim=-1).to(dtype)
    v = randn(1, t, hv, d).to(dtype)
    beta = torch.sigmoid(randn(1, t, hv)).to(dtype)
    a = randn(1, t, hv)
    cpu = torch.Generator().manual_seed(seed + 1)
    a_log = torch.log(torch.empty(hv).uniform_(1.0, 16.0, generator=cpu))
    dt = torch.exp(torch.empty(hv).uniform_(math.log(1e-3), math.log(1e-1), generator=cpu))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    a_log, dt_bias = a_log.to(device), dt_bias.to(device)
    if gate == "model":
        g = -torch.exp(a_log) * F.softplus(a + dt_bias)
    elif gate == "zero":
        g = torch.zeros_like(a)
    elif gate == "strong":
        g = -torch.exp(a_log) * F.softplus(a + 2.0)
    else:
        raise ValueError(f"unknown gate recipe {gate!r}; choose from {sorted(GATES)}")
    h0 = randn(n, hv, d, d) * 0.1
    lens = torch.tensor([0] + shape.seqlens, dtype=torch.int64).cumsum(0)
    inp = {
        "q": q,
        "k": k,
        "v": v,
        "g": g.float().contiguous(),
        "beta": beta,
        "h0": h0,
        "cu_seqlens_cpu": lens,
        "seqlens": shape.seqlens,
    }
    if with_grads:
        inp["do"] = randn(1, t, hv, d).to(dtype)
        inp["dht"] = randn(n, hv, d, d) * 0.1
    return inp


def fingerprint(inp: dict) -> list[float]:
    """A cheap exact summary of the inputs, compared across worker processes."""
    out = []
    for name in ("q", "k", "v", "g", "beta", "h0", "do", "dht"):
        if name in inp:
            x = inp[name].double()
            out += [float(x.sum()), float(x.abs().sum())]
    return out


def input_bytes(inp: dict) -> int:
    return sum(
        x.numel() * x.element_size()
        for n, x in inp.items()
        if n in ("q", "k", "v", "g", "beta", "h0", "do", "dht")
    )


# --------------------------------------------------------------------------------------
# Implementations (worker side)
# --------------------------------------------------------------------------------------


class Impl:
    """One implementation as the worker drives it.

    ``load`` imports it (ImportError means "not installed"); ``prepare`` turns the
    canonical inputs into its own conventions, outside any timing; ``call`` is what is
    timed; ``canon`` maps its raw outputs back to ``(o [B,T,Hv,V], ht [N,Hv,K,V])``.
    """

    name = "?"
    differentiable = True

    def load(self, ctx: dict):
        raise NotImplementedError

    def prepare(self, inp: dict, ctx: dict, requires_grad: bool = False) -> dict:
        raise NotImplementedError

    def call(self, args: dict):
        raise NotImplementedError

    def canon(self, out, args: dict):
        return out[0].reshape(1, -1, *out[0].shape[-2:]), out[1]

    def leaves(self, args: dict) -> list:
        return [args[n] for n in ("q", "k", "v", "g", "beta", "h0")]

    def fwd_bwd(self, args: dict, inp: dict):
        """One training step: the forward with grad, then the gradients of every leaf for
        the output gradients ``inp["do"]``, ``inp["dht"]`` (the fwd+bwd timing)."""
        import torch

        o, ht = self.canon(self.call(args), args)
        return torch.autograd.grad((o, ht), self.leaves(args), (inp["do"], inp["dht"]))


def _fla_style_call(fn, a: dict, **extra):
    """``fn`` called with FLA's keywords on the arguments of :func:`_fla_style_args`."""
    return fn(**a["views"](a), initial_state=a["h0"], output_final_state=True,
              use_qk_l2norm_in_kernel=False, cu_seqlens=a["cu"], **extra)


def _fla_style_args(inp: dict, ctx: dict, requires_grad: bool, cu_dtype) -> dict:
    """q..h0 in FLA's layout; dense ``[B,T]`` view for ``--dense-batch`` uniform layouts,
    else packed ``[1,T]`` with cu_seqlens (none for one sequence)."""
    lens = inp["seqlens"]
    args = {}
    for n in ("q", "k", "v", "g", "beta", "h0"):
        x = inp[n].detach().clone()
        args[n] = x.requires_grad_(requires_grad)
    dense = len(lens) == 1 or (ctx.get("dense_batch") and len(set(lens)) == 1)
    if dense:
        b = len(lens)
        args["views"] = lambda a: {
            n: a[n].view(b, -1, *a[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")
        }
        args["cu"], args["cu_cpu"] = None, None
    else:
        args["views"] = lambda a: {n: a[n] for n in ("q", "k", "v", "g", "beta")}
        # one cu_seqlens tensor shared by every buffer set: caches keyed on it (FLA's
        # tensor_cache) hit in every rotation and during graph capture
        memo = f"_cu_{cu_dtype}"
        if memo not in inp:
            cu_cpu = inp["cu_seqlens_cpu"].to(cu_dtype)
            inp[memo] = (cu_cpu.to(inp["q"].device), cu_cpu)
        args["cu"], args["cu_cpu"] = inp[memo]
    return args


OURS_SRC = os.path.join(REPO, "packages", "flash-qla-core", "src")


def import_ours():
    """Our ``flash_qla``: the installed one, else the monorepo's source tree (a checkout
    that was never ``pip install``-ed still runs the torch backend)."""
    try:
        import flash_qla
    except ImportError:
        if not os.path.exists(os.path.join(OURS_SRC, "flash_qla", "__init__.py")):
            raise
        sys.path.insert(0, OURS_SRC)
        import flash_qla
    if not callable(getattr(flash_qla, "chunk_gated_delta_rule", None)):
        raise ImportError(f"{flash_qla.__file__} has no chunk_gated_delta_rule yet")
    return flash_qla


def segment_len_arg(text: str) -> int | str:
    """``--ours-segment-len``: a segment length in tokens (a multiple of 64), or "off"
    (``auto_cp=False``: never split); without the option the backend decides. Raises
    ``argparse.ArgumentTypeError`` (argparse prints its message) on anything else."""
    if text == "off":
        return text
    try:
        tokens = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int (tokens per segment) or 'off', got {text!r}") from None
    if tokens <= 0 or tokens % 64:
        raise argparse.ArgumentTypeError(
            f"expected a positive multiple of 64 (tokens per segment), got {tokens}")
    return tokens


def shortcut_bound_arg(text: str) -> float:
    """``--ours-shortcut-bound``: the split's ``segment_shortcut_bound``, a float in
    [0, 1) (0: the exact split). Raises ``argparse.ArgumentTypeError`` otherwise."""
    try:
        bound = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a float in [0, 1), got {text!r}") from None
    if not 0.0 <= bound < 1.0:
        raise argparse.ArgumentTypeError(f"expected a float in [0, 1), got {bound}")
    return bound


class Ours(Impl):
    name = "ours"

    def load(self, ctx):
        flash_qla = import_ours()
        self.fn = flash_qla.chunk_gated_delta_rule
        self.backend = ctx.get("ours_backend")
        self.segment_len = ctx.get("ours_segment_len")
        self.shortcut_bound = ctx.get("ours_shortcut_bound")
        return getattr(flash_qla, "__version__", "?")

    def prepare(self, inp, ctx, requires_grad=False):
        import torch

        return _fla_style_args(inp, ctx, requires_grad, torch.int32)

    def call(self, a):
        kw = {"backend": self.backend} if self.backend else {}
        if self.segment_len == "off":
            kw["auto_cp"] = False
        elif self.segment_len:
            kw["segment_len"] = self.segment_len
        else:
            kw["auto_cp"] = True                      # as FLA's flash_qla backend passes
        if self.shortcut_bound is not None:
            kw["segment_shortcut_bound"] = self.shortcut_bound
        return _fla_style_call(self.fn, a, **self.offsets(a), **kw)

    def offsets(self, a) -> dict:
        """The drop-in call: device ``cu_seqlens`` only (FLA never passes a host copy)."""
        return {}


class OursHostOffsets(Ours):
    """Ours also given ``cu_seqlens_cpu`` (a caller that keeps host offsets)."""

    name = "host-offsets"

    def offsets(self, a) -> dict:
        return {"cu_seqlens_cpu": a["cu_cpu"]}


class OursUnsplit(Ours):
    """Ours with ``auto_cp=False`` whatever ``--ours-segment-len`` says: the baseline a
    segment-parallel choice has to beat (its error column is split vs unsplit)."""

    name = "unsplit"

    def load(self, ctx):
        version = super().load(ctx)
        self.segment_len, self.shortcut_bound = "off", None
        return version


def _shorten_triton_autotuning(rep_ms: float) -> None:
    """Make every Triton autotuner of this process time each config for ``rep_ms`` (warm-up
    ``rep_ms / 4``) instead of Triton's 100 / 25 ms. Triton 3.x reads ``Autotuner.do_bench``
    (a property) at each tuning; autotuners given their own ``do_bench`` keep it."""
    import functools

    from triton.runtime.autotuner import Autotuner
    from triton.testing import do_bench

    short = functools.partial(do_bench, warmup=rep_ms / 4, rep=rep_ms)
    Autotuner.do_bench = property(lambda self: self._do_bench or short)


class FLA(Impl):
    """FLA's ``chunk_gated_delta_rule`` on its own Triton kernels: ``FLA_FLASH_QLA=0``, or
    FLA 0.5.2+ routes the call to an importable ``flash_qla`` (ours) and measures us."""

    name = "fla"
    route_to_flash_qla = "0"

    def load(self, ctx):
        os.environ["FLA_FLASH_QLA"] = self.route_to_flash_qla     # read when FLA imports
        if ctx.get("fla_tune_rep_ms"):
            _shorten_triton_autotuning(ctx["fla_tune_rep_ms"])
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self.fn = chunk_gated_delta_rule
        return getattr(fla, "__version__", "?")

    def prepare(self, inp, ctx, requires_grad=False):
        import torch

        return _fla_style_args(inp, ctx, requires_grad, torch.int64)

    def call(self, a):
        return _fla_style_call(self.fn, a, cu_seqlens_cpu=a["cu_cpu"])


class FLARouted(FLA):
    """FLA's ``chunk_gated_delta_rule`` as its users call it (device cu_seqlens only) with
    this package installed: FLA routes it to ``flash_qla`` (ours); equals the drop-in
    "ours" column but for FLA's own host work around the call."""

    name = "fla-routed"
    route_to_flash_qla = "1"

    def call(self, a):
        return _fla_style_call(self.fn, a)


def flashinfer_gdn_generation(version: str) -> str:
    """How FlashInfer ``version`` runs its SM90 GDN prefill.

    ``"cute-dsl"`` (0.7 on): CuTe-DSL kernels that each process compiles in memory on its
    first call (seconds per kernel, no nvcc; nvidia-cutlass-dsl must be importable).
    ``"cpp-module"`` (before 0.7, and versions that do not parse): a C++/CUDA module,
    prebuilt (AOT) or else JIT-compiled by nvcc on first use (> 7.5 min on the H200 host).
    """
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return "cute-dsl" if m and (int(m.group(1)), int(m.group(2))) >= (0, 7) else "cpp-module"


FLASHINFER_CP = {"auto": "auto", "on": True, "off": False}


def flashinfer_call_options(version: str, cp: str = "auto") -> dict:
    """Keywords our call adds to FlashInfer's ``chunk_gated_delta_rule`` beyond 0.6.x's
    (``q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens``, which
    0.7.x keeps with the same meaning): none for 0.6.x; for 0.7.x its own defaults made
    explicit, ``backend="auto"`` and ``use_cp`` (``--flashinfer-cp``: ``auto``, ``on``,
    ``off``). ``max_seqlen`` is added per call (see :class:`FlashInfer`). Raises
    ``ValueError`` for ``cp`` other than ``auto`` on a version without ``use_cp``."""
    if cp not in FLASHINFER_CP:
        raise ValueError(f"flashinfer cp must be one of {sorted(FLASHINFER_CP)}, got {cp!r}")
    if flashinfer_gdn_generation(version) != "cute-dsl":
        if cp != "auto":
            raise ValueError(f"FlashInfer {version} has no use_cp (0.7+ has)")
        return {}
    return {"backend": "auto", "use_cp": FLASHINFER_CP[cp]}


class FlashInfer(Impl):
    """FlashInfer's GDN prefill, forward only, in its own conventions, 0.6.x and 0.7.x
    alike: packed ``[T,H,K]``, cu_seqlens mandatory (int64), g = alpha = exp(g_log) fp32
    ``[T,Hv]``, beta fp32 ``[T,Hv]``, states ``[N,Hv,V,K]``.

    0.7.x (CuTe-DSL kernels on SM90) also gets, see :func:`flashinfer_call_options`:
    ``backend="auto"``, ``use_cp`` (``--flashinfer-cp``; its ``auto`` takes the
    context-parallel kernels when sequences x heads is below half the SMs) and
    ``max_seqlen``, the longest sequence of the call, known on the host without a sync,
    which its docs ask batched callers to pass (the CP kernels size their grids by it;
    without it they assume one sequence of all the tokens)."""

    name = "flashinfer"
    differentiable = False

    def load(self, ctx):
        import flashinfer
        import flashinfer.gdn_prefill as gdn

        self.fn = gdn.chunk_gated_delta_rule
        version = getattr(flashinfer, "__version__", "?")
        try:
            self.options = flashinfer_call_options(version, ctx.get("flashinfer_cp") or "auto")
        except ValueError as e:
            raise ImportError(str(e)) from None
        self.pass_max_seqlen = bool(self.options)
        capability = tuple(ctx.get("capability") or (0, 0))
        if (self.pass_max_seqlen and capability[:1] == (9,)
                and getattr(gdn, "chunk_gated_delta_rule_sm90", "") is None):
            # 0.7.x swallows the kernel module's ImportError and fails at the first call
            raise ImportError("FlashInfer's SM90 CuTe-DSL GDN kernel did not import "
                              "(is nvidia-cutlass-dsl importable?)")
        return version

    def prepare(self, inp, ctx, requires_grad=False):
        t = inp["q"].shape[1]
        return {
            "q": inp["q"].reshape(t, *inp["q"].shape[2:]).contiguous(),
            "k": inp["k"].reshape(t, *inp["k"].shape[2:]).contiguous(),
            "v": inp["v"].reshape(t, *inp["v"].shape[2:]).contiguous(),
            "alpha": inp["g"].reshape(t, -1).exp().float().contiguous(),
            "beta": inp["beta"].reshape(t, -1).float().contiguous(),
            "h0_vk": inp["h0"].transpose(-1, -2).contiguous(),
            "cu": inp["cu_seqlens_cpu"].to(inp["q"].device),
            "max_seqlen": int(max(inp["seqlens"])),
        }

    def call(self, a):
        extra = dict(self.options)
        if self.pass_max_seqlen:
            extra["max_seqlen"] = a["max_seqlen"]
        return self.fn(
            a["q"],
            a["k"],
            a["v"],
            g=a["alpha"],
            beta=a["beta"],
            scale=None,
            initial_state=a["h0_vk"],
            output_final_state=True,
            cu_seqlens=a["cu"],
            **extra,
        )

    def canon(self, out, a):
        o, ht_vk = out
        return o.reshape(1, *o.shape), ht_vk.transpose(-1, -2)


class FlashQLA013(Impl):
    """FlashQLA 0.1.3, imported from ``--flashqla-path`` ahead of everything else."""

    name = "flashqla"

    def load(self, ctx):
        path = ctx.get("flashqla_path")
        if not path:
            raise ImportError("no --flashqla-path given")
        path = os.path.realpath(path)
        sys.path.insert(0, path)
        import flash_qla

        where = os.path.realpath(getattr(flash_qla, "__file__", "") or "")
        if not where.startswith(path + os.sep):
            raise RuntimeError(f"imported the wrong flash_qla ({where}), not the one under {path}")
        self.fn = flash_qla.chunk_gated_delta_rule
        return getattr(flash_qla, "__version__", "?")

    def prepare(self, inp, ctx, requires_grad=False):
        import torch

        return _fla_style_args(inp, ctx, requires_grad, torch.int32)

    def call(self, a):
        return _fla_style_call(self.fn, a)


# --------------------------------------------------------------------------------------
# The serving convention (``--grid serve``): states in a pool, inference mode
# --------------------------------------------------------------------------------------


def serve_pool(inp: dict, pool_dtype: str, v_first: bool):
    """``(pool, slots)``: the batch's initial states ``h0`` stored at seeded, permuted slots
    of a pool of ``2 N + 1`` rows (the other rows zero), ``[P, Hv, K, V]`` (``v_first``:
    ``[P, Hv, V, K]``) in ``pool_dtype``; slots ``[N]`` int32 on the device. Every
    implementation gets the same rows at the same slots."""
    import torch

    h0 = inp["h0"]
    n = h0.shape[0]
    slots = torch.randperm(2 * n + 1, generator=torch.Generator().manual_seed(n))[:n]
    rows = h0.transpose(-1, -2) if v_first else h0
    pool = rows.new_zeros((2 * n + 1, *rows.shape[1:]), dtype=getattr(torch, pool_dtype))
    pool[slots.to(h0.device)] = rows.to(pool.dtype)
    return pool, slots.to(device=h0.device, dtype=torch.int32)


def _pool_rows(pool, slots, v_first: bool):
    """The pool's rows at ``slots`` as ``[N, Hv, K, V]`` fp32 (a final-state check)."""
    rows = pool[slots.long()].float()
    return rows.transpose(-1, -2) if v_first else rows


class OursServe(Ours):
    """Ours as an engine calls it: inference mode, device cu_seqlens only, states read
    from and written into a v-first pool (``state_indices``: no gather / scatter)."""

    def prepare(self, inp, ctx, requires_grad=False):
        a = super().prepare(inp, ctx, requires_grad=False)
        a["pool"], a["slots"] = serve_pool(inp, ctx.get("serve_pool_dtype", "float32"), True)
        return a

    def call(self, a):
        import torch

        kw = {"backend": self.backend} if self.backend else {}
        with torch.inference_mode():
            o, _ = self.fn(**a["views"](a), initial_state=a["pool"], state_indices=a["slots"],
                           output_final_state=True, cu_seqlens=a["cu"], state_v_first=True,
                           **kw)
        return o, a["pool"]

    def canon(self, out, a):
        o = out[0]
        return o.reshape(1, -1, *o.shape[-2:]), _pool_rows(a["pool"], a["slots"], True)


class FLAServe(FLA):
    """FLA as an engine calls it on a state pool: the rows gathered, the call (inference
    mode), the final states scattered back, all in the timed call (FLA has no pool
    indices in its chunked prefill); its [N, Hv, K, V] state layout."""

    def load(self, ctx):
        return f"{super().load(ctx)} (gather / scatter)"

    def prepare(self, inp, ctx, requires_grad=False):
        a = super().prepare(inp, ctx, requires_grad=False)
        a["pool"], a["slots"] = serve_pool(inp, ctx.get("serve_pool_dtype", "float32"), False)
        a["slots64"] = a["slots"].long()
        return a

    def call(self, a):
        import torch

        pool, slots = a["pool"], a["slots64"]          # an engine's int64 indices
        with torch.inference_mode():
            o, ht = self.fn(**a["views"](a), initial_state=pool[slots],
                            output_final_state=True, use_qk_l2norm_in_kernel=False,
                            cu_seqlens=a["cu"], cu_seqlens_cpu=a["cu_cpu"])
            pool[slots] = ht.to(pool.dtype)
        return o, pool

    def canon(self, out, a):
        o = out[0]
        return o.reshape(1, -1, *o.shape[-2:]), _pool_rows(a["pool"], a["slots"], False)


class FlashInferServe(FlashInfer):
    """FlashInfer on a v-first state pool through its own ``state_indices`` (read and
    written in place, ``output_state`` the pool); a version without them (0.6.x) gathers
    and scatters around the call."""

    def load(self, ctx):
        import inspect

        version = super().load(ctx)
        self.has_indices = "state_indices" in inspect.signature(self.fn).parameters
        return f"{version} ({'state_indices' if self.has_indices else 'gather / scatter'})"

    def prepare(self, inp, ctx, requires_grad=False):
        a = super().prepare(inp, ctx, requires_grad=False)
        a["pool"], a["slots"] = serve_pool(inp, ctx.get("serve_pool_dtype", "float32"), True)
        return a

    def call(self, a):
        import torch

        pool, slots = a["pool"], a["slots"]
        extra = dict(self.options)
        if self.pass_max_seqlen:
            extra["max_seqlen"] = a["max_seqlen"]
        common = dict(g=a["alpha"], beta=a["beta"], scale=None, output_final_state=True,
                      cu_seqlens=a["cu"], **extra)
        with torch.inference_mode():
            if self.has_indices:
                o, _ = self.fn(a["q"], a["k"], a["v"], initial_state=pool, output_state=pool,
                               state_indices=slots, **common)
            else:
                rows = slots.long()
                o, ht = self.fn(a["q"], a["k"], a["v"], initial_state=pool[rows], **common)
                pool[rows] = ht.to(pool.dtype)
        return o, pool

    def canon(self, out, a):
        o = out[0]
        return o.reshape(1, *o.shape), _pool_rows(a["pool"], a["slots"], True)


IMPLS = {"ours": Ours, "fla": FLA, "flashinfer": FlashInfer, "flashqla": FlashQLA013,
         "unsplit": OursUnsplit, "host-offsets": OursHostOffsets, "fla-routed": FLARouted}
#: The implementations of the serving grid (``--grid serve``), by peer name.
SERVE_IMPLS = {"ours": OursServe, "fla": FLAServe, "flashinfer": FlashInferServe}


def impl_for(spec: dict) -> Impl:
    """The implementation a worker drives: the serving convention's with ``serve``."""
    table = SERVE_IMPLS if spec.get("serve") else IMPLS
    return table[spec["impl"]]()


def static_unsupported(impl: str, shape: Shape, env: dict) -> str | None:
    """Why ``impl`` cannot run ``shape`` here, known without starting a worker."""
    if env.get("device") == "cpu" and impl not in OURS_FAMILY:
        return "skipped: needs a CUDA GPU (--device cpu runs ours only)"
    if env.get("serve") and impl not in SERVE_IMPLS:
        return "unsupported: the serving grid measures " + ", ".join(SERVE_IMPLS)
    if impl == "flashinfer" and shape.mode == "bwd":
        return "unsupported: forward only"
    if (
        impl == "fla"
        and shape.mode == "bwd"
        and shape.hv != shape.hk
        and tuple(env.get("capability") or (0, 0))[0] == 9
        and str(env.get("fla_version", "0.6")).startswith("0.5.0")
    ):
        return (
            "unsupported: FLA 0.5.0 has no GVA backward on Hopper (its Triton path "
            "refuses Triton>=3.4, its TileLang path rejects Hv != Hk); 0.5.2+ has one"
        )
    return None


# --------------------------------------------------------------------------------------
# Timing (worker side)
# --------------------------------------------------------------------------------------


def n_rotations(nbytes: int) -> int:
    """Buffer sets to rotate through: enough that 2x L2 lies between two uses of one."""
    if nbytes >= L2_BYTES:
        return 1
    return int(min(16, max(2, math.ceil(2 * L2_BYTES / max(nbytes, 1)) + 1)))


def time_back_to_back(fns: list, device: str, calls: int = 20, repeats: int = 3) -> float:
    """Ms per call of ``calls`` calls issued back to back (round-robin over ``fns``), with
    no L2 flush and no sync between them, the median of ``repeats`` such runs: the pace
    of a loop that issues calls continuously (a training or serving loop), host time
    included wherever it exceeds the GPU's. A host-bound call's single ``do_bench``
    median (flush, start event, one call, end event) swings by tens of percent from one
    run to the next (docs/perf-notes.md v21 call 5); this measure does not."""
    import torch

    for fn in fns:
        fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        if device == "cpu":
            t0 = time.perf_counter()
            for i in range(calls):
                fns[i % len(fns)]()
            runs.append((time.perf_counter() - t0) * 1e3 / calls)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / calls)
    return statistics.median(runs)


def time_fns(fns: list, device: str, warmup_ms: float, rep_ms: float) -> float:
    """Median ms of calling ``fns`` round-robin (one call per sample)."""
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    if device == "cpu":  # already warm (the first call ran); a few wall-clock samples
        samples = []
        deadline = time.perf_counter() + rep_ms / 1e3
        while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 50):
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    import triton.testing

    return float(triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def capture_graphs(fns: list, stream=None) -> list:
    """One CUDA graph per callable (warm-up on a side stream, then capture)."""
    import torch

    s = stream or torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            for _ in range(2):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
        graphs.append(g)
    torch.cuda.synchronize()
    return graphs


def rel_err(x, ref) -> float:
    import torch

    x, ref = x.detach().float(), ref.detach().to(x.device).float()
    if x.shape != ref.shape:
        raise ValueError(f"shape {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    if not torch.isfinite(x).all():
        return float("inf")
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def sync(device: str):
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------
# Worker tasks
# --------------------------------------------------------------------------------------

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _write(path: str, res: dict):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


def task_probe(spec: dict) -> dict:
    """Environment facts: device, versions, which implementations import."""
    import torch

    res = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.cuda.is_available(),
        "device_name": "cpu",
        "capability": None,
    }
    if res["cuda"]:
        res["device_name"] = torch.cuda.get_device_name()
        res["capability"] = list(torch.cuda.get_device_capability())
        res["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        import triton

        res["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        res["triton"] = f"unavailable ({type(e).__name__})"
    versions = {}
    try:
        flash_qla = import_ours()
        versions["ours"] = getattr(flash_qla, "__version__", "?")
        if not callable(getattr(flash_qla, "chunk_gated_delta_rule", None)):
            versions["ours"] = "error: flash_qla has no chunk_gated_delta_rule"
    except Exception as e:  # noqa: BLE001
        versions["ours"] = f"error: {type(e).__name__}: {e}"
    if res["cuda"]:
        for name, mod in (("fla", "fla"), ("fla-routed", "fla"), ("flashinfer", "flashinfer")):
            if name not in spec.get("peers", []):
                continue
            try:
                m = __import__(mod)
                versions[name] = getattr(m, "__version__", "?")
            except Exception as e:  # noqa: BLE001
                versions[name] = f"not installed ({type(e).__name__}: {e})"[:300]
        if ("flashinfer" in versions and not versions["flashinfer"].startswith("not")
                and flashinfer_gdn_generation(versions["flashinfer"]) == "cpp-module"):
            res["flashinfer_gdn_built"] = _flashinfer_gdn_built()
    res["versions"] = versions
    return res


def _flashinfer_gdn_built() -> bool:
    """Whether FlashInfer 0.6.x's SM90 GDN prefill module exists already (AOT or JIT
    cache); without it the first call JIT-compiles for more than 7.5 minutes on the H200
    host. (0.7.x compiles CuTe-DSL kernels in-process instead: nothing to look for.)"""
    import glob

    import flashinfer

    roots = [
        os.path.dirname(flashinfer.__file__),
        os.environ.get("FLASHINFER_WORKSPACE_BASE", ""),
        os.path.expanduser("~/.cache/flashinfer"),
    ]
    return any(
        glob.glob(os.path.join(r, "**", "gdn_prefill*.so"), recursive=True)
        for r in roots
        if r and os.path.isdir(r)
    )


def task_bench(spec: dict) -> dict:
    """Time one implementation on one shape; check it against ours' saved outputs."""
    import torch

    shape = Shape.from_key(spec["shape"])
    dev, mode = spec["device"], shape.mode
    res = {"impl": spec["impl"], "shape": shape.key, "status": "running"}
    out_path = spec["result_path"]
    impl = impl_for(spec)
    if dev != "cpu":
        torch.cuda.init()
    torch.manual_seed(0)
    inp = make_inputs(shape, spec["gate"], spec["seed"], dev, with_grads=(mode == "bwd"))
    res["fingerprint"] = fingerprint(inp)
    sync(dev)

    t0 = time.perf_counter()
    try:
        res["version"] = impl.load(spec)
    except ImportError as e:
        res.update(status="not installed", reason=f"{type(e).__name__}: {e}")
        return res
    res["import_s"] = time.perf_counter() - t0

    bwd = mode == "bwd"
    args = impl.prepare(inp, spec, requires_grad=bwd)
    # first call (compilation / autotuning / JIT included), in this fresh process
    with torch.set_grad_enabled(bwd):
        out = impl.call(args)
        o, ht = impl.canon(out, args)
        if bwd:
            grads = torch.autograd.grad((o, ht), impl.leaves(args), (inp["do"], inp["dht"]))
    sync(dev)
    res["first_call_s"] = time.perf_counter() - t0

    # correctness: ours saves its outputs, a peer compares against them
    outs = {"o": o, "ht": ht}
    if bwd:
        outs.update(zip(GRAD_NAMES, grads))
    ref_path = spec["ref_path"]
    if spec["impl"] == "ours":
        torch.save(
            {"fingerprint": res["fingerprint"], **{n: x.detach().cpu() for n, x in outs.items()}},
            ref_path,
        )
        res["err"] = {}
    elif os.path.exists(ref_path):
        ref = torch.load(ref_path)
        fp_ok = all(
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
            for a, b in zip(ref["fingerprint"], res["fingerprint"])
        )
        res["inputs_match"] = fp_ok
        res["err"] = {n: rel_err(x, ref[n]) for n, x in outs.items()}
        del ref
    else:
        res["err"] = None  # ours did not run: nothing to compare with
    del out, o, ht, outs
    if bwd:
        del grads
    _write(out_path, {**res, "status": "partial"})
    if spec.get("ref_only"):
        # ours run only to give the peers their reference (its row is kept from an
        # earlier call, see bench --resume): no timing
        res["status"] = "ok"
        _write(out_path, res)
        return res

    # timing: rotate buffer sets that would fit in L2
    nrot = n_rotations(input_bytes(inp)) if dev != "cpu" else 1
    res["rotations"] = nrot
    sets = [args] + [impl.prepare(inp, spec, requires_grad=bwd) for _ in range(nrot - 1)]
    wu, rep = spec["warmup_ms"], spec["rep_ms"]
    if not bwd:
        with torch.no_grad():
            calls = [lambda a=a: impl.call(a) for a in sets]
            res["eager_ms"] = time_fns(calls, dev, wu, rep)
            res["b2b_ms"] = time_back_to_back(calls, dev)
    else:
        steps = [lambda a=a: impl.fwd_bwd(a, inp) for a in sets]
        res["fwdbwd_eager_ms"] = time_fns(steps, dev, wu, rep)
        res["fwdbwd_b2b_ms"] = time_back_to_back(steps, dev)
        del steps
        kept = [impl.canon(impl.call(a), a) for a in sets]
        bwd_fns = [
            lambda a=a, oo=oo: torch.autograd.grad(
                oo, impl.leaves(a), (inp["do"], inp["dht"]), retain_graph=True
            )
            for a, oo in zip(sets, kept)
        ]
        res["eager_ms"] = time_fns(bwd_fns, dev, wu, rep)
        del kept, bwd_fns
    res["status"] = "ok"
    _write(out_path, res)

    # CUDA-graph replay (what an inference engine pays); failure costs only this column
    if dev == "cpu" or not spec.get("graphs", True):
        res["graph_status"] = "n/a (cpu)" if dev == "cpu" else "off"
        return res
    try:
        s = torch.cuda.Stream()
        if not bwd:
            with torch.no_grad():
                graphs = capture_graphs([lambda a=a: impl.call(a) for a in sets], s)
        else:
            # the forward runs on the capture stream so that autograd's backward ops
            # (which run on their forward's stream) land in the graph
            with torch.cuda.stream(s):
                kept = [impl.canon(impl.call(a), a) for a in sets]
            graphs = capture_graphs(
                [
                    lambda a=a, oo=oo: torch.autograd.grad(
                        oo, impl.leaves(a), (inp["do"], inp["dht"]), retain_graph=True
                    )
                    for a, oo in zip(sets, kept)
                ],
                s,
            )
        res["graph_ms"] = time_fns([g.replay for g in graphs], dev, wu, rep)
        res["graph_status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the reason is reported in the table notes
        res["graph_status"] = f"not capturable: {type(e).__name__}: {str(e)[:200]}"
    if bwd:
        _graph_fwd_bwd(impl, sets, inp, res, wu, rep)
    return res


def _graph_fwd_bwd(impl, sets: list, inp: dict, res: dict, wu: float, rep: float) -> None:
    """The training step (forward with grad + the gradients of every leaf) captured as
    one CUDA graph per buffer set and replayed: ``res["fwdbwd_graph_ms"]``, its device
    time without the host's launches (an implementation whose step cannot be captured,
    e.g. one that syncs, gets ``fwdbwd_graph_status`` instead)."""
    import torch

    try:
        graphs = capture_graphs([lambda a=a: impl.fwd_bwd(a, inp) for a in sets],
                                torch.cuda.Stream())
        res["fwdbwd_graph_ms"] = time_fns([g.replay for g in graphs], "cuda", wu, rep)
        res["fwdbwd_graph_status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the reason is reported in the table notes
        res["fwdbwd_graph_status"] = f"not capturable: {type(e).__name__}: {str(e)[:200]}"


def task_profile(spec: dict) -> dict:
    """Per-kernel device time (torch.profiler) of one implementation on one shape,
    forward and (unless skipped or unsupported) backward, per iteration."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    shape = Shape.from_key(spec["shape"])
    dev = spec["device"]
    impl = IMPLS[spec["impl"]]()
    res = {"impl": spec["impl"], "shape": shape.key, "status": "running"}
    inp = make_inputs(shape, spec["gate"], spec["seed"], dev, with_grads=True)
    try:
        res["version"] = impl.load(spec)
    except ImportError as e:
        res.update(status="not installed", reason=f"{type(e).__name__}: {e}")
        return res
    iters = int(spec.get("iters", 10))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])

    def kernels(fn) -> dict:
        for _ in range(1 if dev == "cpu" else 3):  # compile / autotune outside the profile
            fn()
        sync(dev)
        with profile(activities=acts) as prof:
            for _ in range(iters):
                fn()
            sync(dev)
        table: dict[str, dict] = {}
        if dev == "cpu" or spec.get("host"):  # aten ops by self CPU time
            for e in prof.key_averages():
                if e.self_cpu_time_total > 0:
                    table[e.key] = {"us": e.self_cpu_time_total / iters, "calls": e.count / iters}
        else:
            for e in prof.events():
                if str(getattr(e, "device_type", "")).endswith("CUDA"):
                    row = table.setdefault(e.name, {"us": 0.0, "calls": 0.0})
                    row["us"] += e.time_range.elapsed_us() / iters
                    row["calls"] += 1 / iters
        return table

    args = impl.prepare(inp, spec, requires_grad=False)
    with torch.no_grad():
        res["fwd"] = kernels(lambda: impl.call(args))
        if spec.get("host") and dev != "cpu":              # the forward's host wall, syncs
            res["fwd_host"] = host_wall(lambda: impl.call(args), iters)
    if spec.get("bwd"):
        why = static_unsupported(spec["impl"], Shape("bwd", shape.hk, shape.hv, shape.layout), spec)
        if why or not impl.differentiable:
            res["bwd_status"] = why or "unsupported: forward only"
        else:
            ga = impl.prepare(inp, spec, requires_grad=True)
            # the training forward (autograd records it; it may keep more for the backward)
            res["fwd_train"] = kernels(lambda: impl.call(ga))
            outs = impl.canon(impl.call(ga), ga)

            def bwd():
                return torch.autograd.grad(
                    outs, impl.leaves(ga), (inp["do"], inp["dht"]), retain_graph=True
                )

            res["bwd"] = kernels(bwd)
            if spec.get("host") and dev != "cpu":          # the backward's host wall, syncs
                res["bwd_host"] = host_wall(bwd, iters)
            res["bwd_status"] = "ok"
    res["status"] = "ok"
    return res


def host_wall(fn, iters: int) -> dict:
    """The host side of a call: ``wall_us``, the median wall-clock time until a call
    returns (no sync between calls: the host's own cost while the GPU runs behind), and
    ``syncs``, the messages of torch's sync debug mode for one call (each a host wait on
    the GPU)."""
    import warnings

    import torch

    samples = []
    for _ in range(max(iters, 20)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's message for each sync ("called a synchronizing CUDA operation"), not its
    # notice that the debug mode is a prototype
    syncs = [str(w.message).splitlines()[0] for w in caught
             if "synchronizing cuda operation" in str(w.message).lower()]
    return {"wall_us": statistics.median(samples), "syncs": syncs}


def host_behind_sleep(fn, calls: int = 10, sleep_ms: float = 200.0) -> dict:
    """The host's own cost of a call with the GPU out of the way: ``calls`` calls issued
    while the stream is still busy with a ``torch.cuda._sleep`` of ``sleep_ms``, so no
    call waits for the GPU unless it synchronises. ``held_us``: wall per call;
    ``held_synced``: whether the calls outlasted the sleep (a call waited for the GPU:
    a host sync, or a full launch queue), which makes ``held_us`` the GPU's time instead."""
    import torch

    torch.cuda.synchronize()
    # cycles at the SM clock (MHz from the device properties; 1.98 GHz on the H200)
    clock_mhz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) / 1e3 or 1980
    start = time.perf_counter()
    torch.cuda._sleep(int(sleep_ms * 1e3 * clock_mhz))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    slept = (time.perf_counter() - start) * 1e3
    return {"held_us": (t1 - t0) / calls * 1e6,
            "held_synced": (t1 - start) * 1e3 >= min(sleep_ms, slept) * 0.95}


def fla_cache_results(tuning: str) -> str:
    """``FLA_CACHE_RESULTS`` for a worker: "0" for ``per-shape`` (FLA autotunes on the
    worker's own shape), "1" for ``cached`` (FLA's default: Triton's on-disk autotune
    cache, keyed on heads and dims but not on T or B)."""
    if tuning not in ("per-shape", "cached"):
        raise ValueError(f"fla tuning: expected 'per-shape' or 'cached', got {tuning!r}")
    return "0" if tuning == "per-shape" else "1"


def worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    if "batch" in spec:
        return _worker_batch(spec)
    return _worker_one(spec)


def _worker_batch(spec: dict) -> int:
    """One process measures several configurations in turn (``--worker-per heads``):
    the imports and the peers' tuning are paid once per batch. Each item writes its own
    result; only the first keeps ``import_s`` / ``first_call_s`` (later ones are not a
    fresh process); none starts past ``deadline_epoch``."""
    one = {k: v for k, v in spec.items() if k != "batch"}
    for n, item in enumerate(spec["batch"]):
        if spec.get("deadline_epoch") and time.time() > spec["deadline_epoch"]:
            _write(item["result_path"], {"status": "error", "reason": "batch deadline reached"})
            continue
        _worker_one({**one, **item}, warm=n > 0)
        if spec.get("device") != "cpu":
            import torch

            torch.cuda.empty_cache()
    return 0


def _worker_one(spec: dict, warm: bool = False) -> int:
    out_path = spec["result_path"]
    if spec.get("task") == "probe" or spec["impl"] == "fla":
        os.environ["FLA_CACHE_RESULTS"] = fla_cache_results(spec.get("fla_tuning", "per-shape"))
    task = {"probe": task_probe, "bench": task_bench, "profile": task_profile}[spec["task"]]
    if spec.get("device") == "cpu":
        import torch

        # The CPU demo's tiny ops: extra intra-op threads only contend (the profiler
        # showed ~100x inflated times with 2 threads on a 2-core machine).
        torch.set_num_threads(1)
    try:
        res = task(spec)
    except Exception as e:  # noqa: BLE001 - a worker reports, the parent decides
        res = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:400]}"}
        if os.path.exists(out_path):  # keep what an earlier stage measured
            with open(out_path) as f:
                res = {**json.load(f), **res}
        traceback.print_exc()
    if warm:  # not a fresh process: its first call says nothing about first use
        res.pop("import_s", None)
        res["warm_first_call_s"] = res.pop("first_call_s", None)
    _write(out_path, res)
    return 0


# --------------------------------------------------------------------------------------
# Parent side: spawning workers
# --------------------------------------------------------------------------------------


def run_worker(
    spec: dict, scratch: str, name: str, timeout: float, env_extra: dict | None = None
) -> dict:
    """Run one worker in a fresh process group; return its result dict (never raises)."""
    return run_batch_worker(spec, [{}], scratch, name, timeout, env_extra)[0]


def run_batch_worker(
    spec: dict,
    items: list[dict],
    scratch: str,
    name: str,
    timeout: float,
    env_extra: dict | None = None,
) -> list[dict]:
    """Run one worker process over ``items`` (each a dict of spec entries, e.g. shape
    and ref_path, measured in turn in the same process; ``[{}]``: ``spec`` alone, the
    fresh-process default); return one result dict per item (never raises)."""
    os.makedirs(scratch, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    paths = [os.path.join(scratch, f"{safe}.{n}.result.json") for n in range(len(items))]
    items = [{**it, "result_path": p} for it, p in zip(items, paths)]
    spec = {**spec, **items[0]} if len(items) == 1 else {**spec, "batch": items}
    spec_path = os.path.join(scratch, f"{safe}.spec.json")
    log_path = os.path.join(scratch, f"{safe}.log")
    for p in paths:
        if os.path.exists(p):
            os.remove(p)
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", spec_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=REPO,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group, started above
            proc.wait()
            rc = None
        except BaseException:  # the parent is interrupted: take the worker down with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = (time.perf_counter() - t0) / len(items)
    return [_read_result(p, rc, timeout, log_path, wall) for p in paths]


def _read_result(path: str, rc: int | None, timeout: float, log_path: str, wall: float) -> dict:
    """The result a worker wrote to ``path``, its status settled from the exit code."""
    res = {}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    res["wall_s"] = wall
    if rc is None:
        res.update(
            status="timeout"
            if res.get("status") in (None, "partial", "running")
            else res["status"],
            reason=f"worker killed after {timeout:.0f} s",
        )
    elif not res.get("status") or res["status"] in ("partial", "running"):
        res.update(status="error", reason=f"worker exited with code {rc} ({log_path})")
    if rc not in (0, None) and res["status"] == "ok" and "graph_status" not in res:
        res["graph_status"] = f"worker died during graph capture (exit code {rc})"
    if res["status"] not in ("ok",):
        with open(log_path, errors="replace") as f:
            res["log_tail"] = "".join(f.readlines()[-25:])
    return res


def probe(peers: list[str], scratch: str, timeout: float = 300) -> dict:
    return run_worker({"task": "probe", "impl": "probe", "peers": peers}, scratch, "probe", timeout)


def probe_or_explain(peers: list[str], scratch: str, device: str, what: str) -> dict | None:
    """Probe the worker environment; None (after one clear line on stderr) when ``what``
    (``"benchmark"``, ``"profile"``) cannot run: no worker, no GPU, or our package missing."""
    info = probe(peers, scratch)
    if info.get("status") == "error" and "cuda" not in info:
        why = (f"error: cannot start a worker ({info.get('reason')}); this {what} needs "
               f"PyTorch, a CUDA GPU and {INSTALL_HINT} (or --device cpu)")
    elif device == "cuda" and not info.get("cuda"):
        why = NO_GPU_LINE.replace("benchmark", what)
    elif str(info.get("versions", {}).get("ours", "error")).startswith("error"):
        ours = str(info["versions"].get("ours", "error"))
        why = (f"error: our flash_qla is not importable ({ours[7:]}); {INSTALL_HINT} "
               "(or pip install -e packages/flash-qla-core).")
    else:
        return info
    print(why, file=sys.stderr)
    return None


def parse_peers(text: str) -> list[str]:
    """``--peers``: a comma-separated list among :data:`PEERS`, or 'none' / '' (no peer).
    Raises ValueError naming the unknown ones."""
    peers = [] if text.strip() in ("", "none") else [p.strip() for p in text.split(",")]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"unknown peer(s) {bad}; choose from {list(PEERS)} or 'none'")
    return list(dict.fromkeys(peers))


def peer_availability(peers: list[str], info: dict, device: str, flashqla_path: str | None,
                      flashinfer_jit: bool = False) -> dict:
    """Reason each peer cannot run at all here (from the probe ``info``), or None."""
    out = {}
    versions = info.get("versions", {})
    for peer in peers:
        why = None
        if peer in OURS_FAMILY:               # ours again: runs wherever ours does
            ours = str(versions.get("ours", "error"))
            why = f"not installed ({ours})" if ours.startswith("error") else None
        elif device == "cpu":
            why = "skipped: needs a CUDA GPU (--device cpu runs ours only)"
        elif peer == "flashqla":
            if not flashqla_path:
                why = "not installed: pass --flashqla-path"
            elif not flashqla_version(flashqla_path):
                why = f"not installed: no flash_qla/__init__.py under {flashqla_path}"
        elif str(versions.get(peer, "not installed")).startswith("not installed"):
            why = str(versions.get(peer, "not installed"))
        elif (peer == "flashinfer" and not flashinfer_jit
              and flashinfer_gdn_generation(str(versions.get(peer))) == "cpp-module"
              and not info.get("flashinfer_gdn_built")):
            why = (
                "skipped: FlashInfer's GDN module is not prebuilt (its JIT takes > 7.5 min); "
                "pass --flashinfer-jit to allow it"
            )
        out[peer] = why
    return out


def flashqla_version(path: str | None) -> str | None:
    """Version of the FlashQLA at ``path`` read from its sources (it cannot be imported
    in this process: its import name is ours)."""
    if not path:
        return None
    init = os.path.join(path, "flash_qla", "__init__.py")
    if not os.path.exists(init):
        return None
    with open(init) as f:
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
    return m.group(1) if m else "?"


def source_fingerprint() -> str:
    """First 12 hex digits of the sha256 over every ``packages/*/src/**/*.py`` (path and
    content): identifies the code that ran, even where the checkout's git data is stale
    (recompute it at a commit to match a result to it)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for path in sorted(Path(REPO, "packages").glob("*/src/**/*.py")):
        h.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def gpu_tag(device_name: str) -> str:
    """File-name tag of a device: 'NVIDIA H200' -> 'H200'."""
    name = re.sub(r"^NVIDIA\s+", "", device_name or "cpu").strip()
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name) or "gpu"


def need(module: str, pip_name: str | None = None, purpose: str = ""):
    """Import an optional reporting library, or return None after one clear line."""
    try:
        return __import__(module)
    except ImportError:
        print(
            f"note: {module} is not installed{' (' + purpose + ')' if purpose else ''}; "
            f"`pip install {pip_name or module}` to get it.",
            file=sys.stderr,
        )
        return None


def progress(items, desc: str):
    """tqdm over ``items`` when installed, else a plain counter on stderr."""
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="cfg", dynamic_ncols=True)
    except ImportError:

        class _Plain:
            def __init__(self, xs):
                self.xs = list(xs)

            def __iter__(self):
                for i, x in enumerate(self.xs):
                    print(f"{desc}: {i + 1}/{len(self.xs)}", file=sys.stderr, flush=True)
                    yield x

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Plain(items)


def format_table(rows: list[list], headers: list[str], fmt: str = "github") -> str:
    """tabulate when installed, else a minimal pipe table with the same content."""
    try:
        from tabulate import tabulate

        return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
    except ImportError:
        cells = [[str(c) for c in r] for r in [headers] + rows]
        w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
        return "\n".join(
            [line(cells[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|"]
            + [line(r) for r in cells[1:]]
        )


def new_scratch(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    print(
        "this module is the shared code of benchmark/bench_gated_delta_rule.py and "
        "profile/profile_gdr.py; run one of those.",
        file=sys.stderr,
    )
    sys.exit(2)
