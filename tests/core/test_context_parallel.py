"""Context parallelism (``cp_context``) on the CPU: gloo process groups of 2 and 4 ranks
(``torch.multiprocessing``, spawn), fp64 on the torch backend.

Each rank calls ``flash_qla.chunk_gated_delta_rule`` on its slice of the packed tokens
with a context; its outputs, final states and the gradients of a loss summed over the
ranks must equal, to 1e-10, the same slices of the unsharded single-process call (one
case instead compares with a chain of single-process calls, one per sequence piece, to
check the states handed across rank boundaries and their gradients).

One spawn per group size runs every case (starting the processes is most of the cost);
each rank writes its measured errors to a JSON file and the tests below read them. A
rank that raises ends the spawn at once (``torch.multiprocessing`` stops the others),
a collective left waiting gives up after :data:`COLLECTIVE_TIMEOUT_S`, and the whole run
after :data:`RUN_TIMEOUT_S`; the failure is then reported by every test of that size.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
import traceback
import types
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import flash_qla
from flash_qla import context_parallel as cp
from tests.helpers import rel_l2

TOL = 1e-10
WORLD_SIZES = (2, 4)
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 240
K = 16


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]      # sequence lengths; the total is a multiple of 4
    Hk: int = 2
    Hv: int = 2
    V: int = 16
    h0: bool = True            # pass initial states
    final: bool = True         # output_final_state
    l2norm: bool = False       # use_qk_l2norm_in_kernel
    duck: bool = False         # a plain object with FLA's fields, empty sequences kept
    chained: bool = False      # loss on every piece's final state; chained reference


CASES = {
    "one-long-sequence": Case((300,), l2norm=True),
    "varlen-crossing-V8": Case((37, 150, 5, 100), V=8),
    "rank-boundary-at-sequence-boundary": Case((64, 64, 100, 28)),
    "empty-sequences": Case((50, 0, 90, 0, 60)),
    "empty-sequences-kept-duck-context": Case((50, 0, 90, 0, 60), duck=True),
    "gva-Hv2Hk": Case((120, 180), Hk=2, Hv=4),
    "no-states-fla-usage": Case((100, 156), h0=False, final=False),
    "boundary-states-in-loss": Case((37, 150, 5, 100), chained=True),
}


# --------------------------------------------------------------------------------------
# The split, computed here independently of flash_qla.context_parallel
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    seq: int          # global sequence
    start: int        # global tokens [start, end) on this rank
    end: int
    starts_here: bool
    ends_here: bool


def _pieces(bounds: list[int], rank: int, world: int, keep_empty: bool) -> list[Piece]:
    """The sequence pieces on ``rank`` of an even split: non-empty intersections, plus
    (``keep_empty``) each empty sequence on the rank whose range holds its offset (the
    last rank for one at the very end)."""
    part = bounds[-1] // world
    lo, hi = rank * part, (rank + 1) * part
    out = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e > s and max(s, lo) < min(e, hi):
            out.append(Piece(n, max(s, lo), min(e, hi), s >= lo, e <= hi))
        elif e == s and keep_empty and (lo <= s < hi or s == hi == bounds[-1]):
            out.append(Piece(n, s, s, True, True))
    return out


def _rank_counts(bounds: list[int], pieces: list[Piece], rank: int,
                 world: int) -> tuple[int, int]:
    """``(pre_num_ranks, post_num_ranks)`` by FLA's definition."""
    part = bounds[-1] // world
    first, last = pieces[0], pieces[-1]
    pre = 0 if first.starts_here else rank - bounds[first.seq] // part
    post = 0 if last.ends_here else (bounds[last.seq + 1] - 1) // part - rank
    return pre, post


# --------------------------------------------------------------------------------------
# One case on one rank
# --------------------------------------------------------------------------------------

def _inputs(case: Case, seed: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T, N, Hk, Hv, V = sum(case.lens), len(case.lens), case.Hk, case.Hv, case.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": randn(1, T, Hk, K), "k": F.normalize(randn(1, T, Hk, K), dim=-1),
        "v": randn(1, T, Hv, V), "g": F.logsigmoid(randn(1, T, Hv) + 2),
        "beta": torch.rand(1, T, Hv, generator=gen, dtype=torch.float64),
        "h0": randn(N, Hv, K, V), "junk": randn(len(case.lens) + 2, Hv, K, V),
        "w_o": randn(1, T, Hv, V), "w_f": randn(world, N + 2, Hv, K, V),
    }


def _call(q, k, v, g, beta, h0, case: Case, **kw):
    return flash_qla.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0 if case.h0 else None,
        output_final_state=case.final, use_qk_l2norm_in_kernel=case.l2norm,
        backend="torch", **kw)


def _reference(case: Case, x: dict, bounds: list[int], world: int):
    """``(o, finals, grads)``: the loss of all ranks together, single-process. finals maps
    ``(rank, local index)`` of each piece whose final state the loss reads to it."""
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")}
    q, k, v, g, beta, h0 = leaves.values()
    views = [_pieces(bounds, r, world, case.duck) for r in range(world)]
    place = {}                                      # seq -> [(rank, i, piece)] in order
    for r, pieces in enumerate(views):
        for i, p in enumerate(pieces):
            place.setdefault(p.seq, []).append((r, i, p))
    finals = {}
    if not case.chained:                            # the unsharded call
        o, ht = _call(q, k, v, g, beta, h0, case,
                      cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
        for n, entries in place.items():
            r, i, p = entries[-1]
            if case.final and p.ends_here:
                finals[r, i] = ht[n]
    else:                                           # one call per piece, states chained
        outs = []
        for n in range(len(bounds) - 1):
            state = h0[n:n + 1]
            for r, i, p in place[n]:
                o_p, state = _call(*(t[:, p.start:p.end] for t in (q, k, v, g, beta)),
                                   state, case)
                outs.append(o_p)
                finals[r, i] = state[0]
        o = torch.cat(outs, dim=1)
    loss = (o * x["w_o"]).sum() + sum((f * x["w_f"][r, i]).sum() for (r, i), f in
                                      finals.items())
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return o.detach(), {key: f.detach() for key, f in finals.items()}, grads


def _context(case: Case, bounds: list[int], pieces: list[Piece], rank: int, world: int,
             group):
    """The rank's context: flash_qla's builder (FLA's semantics, checked against the
    split computed here), or a plain object with FLA's field names keeping empty
    sequences (no cu_seqlens_cpu, no is_first/is_last_rank)."""
    lo = rank * (bounds[-1] // world)
    local = [0, *(p.end - lo for p in pieces)]
    pre, post = _rank_counts(bounds, pieces, rank, world)
    if case.duck:
        return types.SimpleNamespace(group=group, pre_num_ranks=pre, post_num_ranks=post,
                                     cu_seqlens=torch.tensor(local, dtype=torch.int64))
    ctx = cp.build_cp_context(torch.tensor(bounds, dtype=torch.int64), group)
    assert ctx.cu_seqlens_cpu.tolist() == local, (ctx.cu_seqlens_cpu.tolist(), local)
    assert (ctx.pre_num_ranks, ctx.post_num_ranks) == (pre, post)
    assert (ctx.is_first_rank, ctx.is_last_rank) == (pre == 0, post == 0)
    return ctx


def _run_case(case: Case, seed: int, rank: int, world: int, group) -> dict:
    """This rank's errors: name -> relative L2 error (or max |x| where zero is due)."""
    bounds = [0, *torch.tensor(case.lens).cumsum(0).tolist()]
    x = _inputs(case, seed, world)
    o_ref, finals_ref, grads_ref = _reference(case, x, bounds, world)
    pieces = _pieces(bounds, rank, world, case.duck)
    part = bounds[-1] // world
    lo, hi = rank * part, (rank + 1) * part
    local = {n: x[n][:, lo:hi].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = torch.stack([x["h0"][p.seq] if p.starts_here else x["junk"][i]
                      for i, p in enumerate(pieces)]).requires_grad_()
    ctx = _context(case, bounds, pieces, rank, world, group)
    o, ht = _call(*local.values(), h0, case, cp_context=ctx)
    loss = (o * x["w_o"][:, lo:hi]).sum()
    for (r, i) in finals_ref:
        if r == rank:
            loss = loss + (ht[i] * x["w_f"][r, i]).sum()
    leaves = [*local.values(), h0]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    err = {"o": rel_l2(o, o_ref[:, lo:hi])}
    for (r, i), f in finals_ref.items():
        if r == rank:
            err[f"final_state[{i}]"] = rel_l2(ht[i], f)
    for name, d, d_ref in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
        err[name] = rel_l2(d, d_ref[:, lo:hi])
    if case.h0:
        for i, p in enumerate(pieces):
            if p.starts_here:
                err[f"dh0[{i}]"] = rel_l2(grads[5][i], grads_ref[5][p.seq])
            else:                                   # entry not read: gradient exactly 0
                err[f"dh0[{i}] (ignored entry)"] = grads[5][i].abs().max().item()
    return err


# --------------------------------------------------------------------------------------
# Bad input that needs a live group (every rank raises the same, or none waits)
# --------------------------------------------------------------------------------------

def _bad_inputs(rank: int, world: int, group) -> dict:
    """name -> "ok" or what happened instead."""
    bounds = [0, 100, 156]
    x = _inputs(Case((100, 156)), 7, world)
    part = bounds[-1] // world
    lo, hi = rank * part, (rank + 1) * part
    q, k, v, g, beta = (x[n][:, lo:hi] for n in ("q", "k", "v", "g", "beta"))
    good = cp.build_cp_context(torch.tensor(bounds), group)

    def ctx(**fields):
        return cp.CPContext(**{**vars(good), **fields})

    N = good.num_seqs
    checks = {
        "pre_num_ranks beyond rank": (ValueError, r"cp_context\.pre_num_ranks", dict(
            cp_context=ctx(pre_num_ranks=rank + 1, is_first_rank=None))),
        "post_num_ranks negative": (ValueError, r"cp_context\.post_num_ranks", dict(
            cp_context=ctx(post_num_ranks=-1, is_last_rank=None))),
        "pre_num_ranks a str": (TypeError, r"cp_context\.pre_num_ranks", dict(
            cp_context=ctx(pre_num_ranks="1"))),
        "is_first_rank contradicts": (ValueError, r"cp_context\.is_first_rank", dict(
            cp_context=ctx(is_first_rank=good.pre_num_ranks != 0))),
        "no rank counts": (ValueError, r"cp_context\.pre_num_ranks", dict(
            cp_context=ctx(pre_num_ranks=None, is_first_rank=None))),
        "cu_seqlens missing": (ValueError, r"cp_context\.cu_seqlens", dict(
            cp_context=ctx(cu_seqlens=None, cu_seqlens_cpu=None))),
        "cu_seqlens float": (TypeError, r"cp_context\.cu_seqlens", dict(
            cp_context=ctx(cu_seqlens=good.cu_seqlens.double(), cu_seqlens_cpu=None))),
        "cu_seqlens_cpu length": (ValueError, r"cp_context\.cu_seqlens_cpu", dict(
            cp_context=ctx(cu_seqlens_cpu=torch.zeros(N + 2, dtype=torch.int32)))),
        "initial_state global N": (ValueError, r"initial_state", dict(
            cp_context=good, initial_state=torch.zeros(N + 1, 2, K, 16, dtype=torch.float64))),
        "fewer tokens than cu_seqlens": (ValueError, r"cu_seqlens", dict(
            cp_context=good, trim=1)),
        "segment_len": (NotImplementedError, r"segment_len", dict(
            cp_context=good, segment_len=64)),
        # rank 1 claims its first sequence starts there, rank 0 that it goes on: every
        # rank raises after the one exchange
        "ranks disagree": (ValueError, r"contexts disagree", dict(cp_context=ctx(
            pre_num_ranks=0 if rank == 1 else good.pre_num_ranks,
            is_first_rank=True if rank == 1 else good.is_first_rank))),
        "builder: tokens not a multiple of ranks": (ValueError, r"cu_seqlens", dict(
            build=torch.tensor([0, 4 * world + 1]))),
    }
    result = {}
    for name, (exc, match, kw) in checks.items():
        try:
            if "build" in kw:
                cp.build_cp_context(kw["build"], group)
            else:
                trim = kw.pop("trim", 0)
                flash_qla.chunk_gated_delta_rule(
                    *(t[:, :t.shape[1] - trim] for t in (q, k, v, g, beta)),
                    backend="torch", **kw)
            result[name] = f"no error (expected {exc.__name__})"
        except exc as e:
            result[name] = "ok" if re.search(match, str(e)) else f"message: {e}"
        except Exception as e:                          # reported, not raised
            result[name] = f"{type(e).__name__}: {e}"
    return result


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank: every case, then the bad inputs; errors to ``rank<r>.json``."""
    torch.set_num_threads(1)
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        group = dist.new_group(list(range(world)))      # a group other than WORLD
        results = {name: _run_case(case, seed, rank, world, group)
                   for seed, (name, case) in enumerate(CASES.items())}
        results["bad-inputs"] = _bad_inputs(rank, world, group)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# The spawn (one per group size) and the tests
# --------------------------------------------------------------------------------------

_RUNS: dict[int, list[dict] | str] = {}     # world -> results, or why the run failed


def _spawn(world: int, tmp) -> list[dict]:
    """Every rank's results; raises what a rank raised, or TimeoutError."""
    context = mp.start_processes(_worker, args=(world, str(tmp / "init"), str(tmp)),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the {world}-rank run took over {RUN_TIMEOUT_S} s")
    out = []
    for r in range(world):
        with open(tmp / f"rank{r}.json") as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    def get(world: int) -> list[dict]:
        if world not in _RUNS:                      # a failed run is not retried
            try:
                _RUNS[world] = _spawn(world, tmp_path_factory.mktemp(f"cp{world}"))
            except Exception as e:
                _RUNS[world] = f"{type(e).__name__}: {e}"
        if isinstance(_RUNS[world], str):
            pytest.fail(f"the {world}-rank run failed: {_RUNS[world]}", pytrace=False)
        return _RUNS[world]
    return get


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sharded_call_equals_unsharded(cp_runs, world, name):
    bad = {f"rank {r} {key}": e for r, res in enumerate(cp_runs(world))
           for key, e in res[name].items() if not e < TOL}
    assert not bad, bad


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_contexts_raise_naming_the_field(cp_runs, world):
    bad = {f"rank {r} {key}": e for r, res in enumerate(cp_runs(world))
           for key, e in res["bad-inputs"].items() if e != "ok"}
    assert not bad, bad


def test_split_helper_matches_fla_definition():
    """The test's own split: 292 tokens over 4 ranks, a sequence over ranks 0-2."""
    bounds = [0, 37, 187, 192, 292]
    assert [(p.seq, p.start, p.end) for p in _pieces(bounds, 1, 4, False)] == [(1, 73, 146)]
    assert _rank_counts(bounds, _pieces(bounds, 1, 4, False), 1, 4) == (1, 1)
    assert _rank_counts(bounds, _pieces(bounds, 2, 4, False), 2, 4) == (2, 1)
    assert _rank_counts(bounds, _pieces(bounds, 3, 4, False), 3, 4) == (1, 0)


# --------------------------------------------------------------------------------------
# Bad contexts found without a process group
# --------------------------------------------------------------------------------------

def _tiny():
    return [torch.zeros(1, 8, 1, K, dtype=torch.float64) for _ in range(3)] + [
        torch.zeros(1, 8, 1, dtype=torch.float64) for _ in range(2)]


@pytest.mark.parametrize("context, exc, match", [
    pytest.param(object(), TypeError, r"cp_context: expected FLA's FLACPContext",
                 id="not-a-context"),
    pytest.param(cp.CPContext(), ValueError, r"cp_context\.group: .*got None", id="no-group"),
    pytest.param(cp.CPContext(group="world"), TypeError, r"cp_context\.group: .*ProcessGroup",
                 id="group-not-a-group"),
    pytest.param(cp.CPContext(layout="zigzag"), NotImplementedError,
                 r"cp_context\.layout='zigzag'", id="zigzag"),
    pytest.param(cp.CPContext(layout="diagonal"), ValueError, r"cp_context\.layout",
                 id="layout-unknown"),
    pytest.param(types.SimpleNamespace(group=None, layout=3), TypeError,
                 r"cp_context\.layout", id="layout-not-str"),
])
def test_context_checked_before_any_communication(context, exc, match):
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule(*_tiny(), cp_context=context, backend="torch")


def test_builder_needs_a_group():
    with pytest.raises(ValueError, match=r"group: .*got None"):
        cp.build_cp_context(torch.tensor([0, 8]), None)


def test_low_level_pair_still_rejects_cp_context():
    with pytest.raises(NotImplementedError, match="cp_context"):
        flash_qla.chunk_gated_delta_rule_fwd(*_tiny(), cp_context=cp.CPContext(),
                                             backend="torch")
