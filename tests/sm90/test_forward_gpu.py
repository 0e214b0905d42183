"""Hopper forward kernels against the fp64 token-by-token recurrence (needs an H200/H100).

Tolerances (bf16 inputs): relative L2 of o and final state < 5e-3; fp16 tighter (2e-3).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference import recurrent_gated_delta_rule
from tests.helpers import rel_l2

pytestmark = pytest.mark.sm90

TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3}


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    Hk: int
    Hv: int
    lens: tuple[int, ...] | None = None   # varlen sequence lengths (B must be 1)
    pad: int = 0                          # padding tokens after the last sequence
    gate: str = "typical"                 # typical | zero | strong
    h0: bool = True
    dtype: torch.dtype = torch.bfloat16

    @property
    def id(self) -> str:
        lay = f"varlen{len(self.lens)}" if self.lens else "dense"
        return (f"B{self.B}-T{self.T}-Hk{self.Hk}-Hv{self.Hv}-{lay}-pad{self.pad}-{self.gate}"
                f"-h0{int(self.h0)}-{str(self.dtype)[6:]}")


def _lens(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(lo, hi + 1, (n,), generator=gen).tolist())


def _varlen(lens, Hk, Hv, pad=0, **kw) -> Case:
    return Case(1, sum(lens) + pad, Hk, Hv, lens=tuple(lens), pad=pad, **kw)


CASES = [
    Case(2, 1000, 2, 4),
    Case(1, 75, 1, 1),
    Case(1, 64, 4, 8, h0=False),
    Case(3, 4096, 16, 32),
    Case(1, 32768, 4, 16),
    Case(1, 4096, 16, 64),
    Case(2, 2048, 2, 16, gate="zero"),
    Case(2, 2048, 8, 8, gate="strong"),
    Case(2, 1000, 2, 4, dtype=torch.float16),
    _varlen([0, 64], 2, 4),
    _varlen([64, 0], 2, 4),
    _varlen([1, 63, 0, 75, 130, 1], 1, 2, pad=37),
    _varlen([1000, 1, 333, 64, 129], 4, 16, pad=5),
    _varlen(_lens(120, 1, 200, seed=1), 2, 8),
    _varlen([60000, 7, 300, 1200], 2, 4, gate="zero"),
]


def make_inputs(case: Case, device="cuda", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, T, Hk, Hv, K, V = case.B, case.T, case.Hk, case.Hv, 128, 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(randn(B, T, Hk, K), dim=-1)
    k = F.normalize(randn(B, T, Hk, K), dim=-1)
    v = randn(B, T, Hv, V)
    beta = torch.sigmoid(randn(B, T, Hv))
    if case.gate == "zero":
        g = torch.zeros(B, T, Hv)
    elif case.gate == "strong":
        g = -30 * torch.rand(B, T, Hv, generator=gen)
    else:
        g = F.logsigmoid(randn(B, T, Hv) + 3.0)
    N = len(case.lens) if case.lens else B
    h0 = randn(N, Hv, K, V) * 0.1 if case.h0 else None
    cu = None
    if case.lens:
        cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int32)
    to = dict(device=device)
    return dict(
        q=q.to(case.dtype).to(**to), k=k.to(case.dtype).to(**to), v=v.to(case.dtype).to(**to),
        g=g.to(**to), beta=beta.to(**to), initial_state=None if h0 is None else h0.to(**to),
        cu_seqlens=None if cu is None else cu.to(**to))


def reference(inp):
    f64 = {n: (t.double() if t is not None and t.is_floating_point() else t)
           for n, t in inp.items()}
    return recurrent_gated_delta_rule(
        f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], initial_state=f64["initial_state"],
        cu_seqlens=f64["cu_seqlens"], output_final_state=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_matches_recurrence(case):
    inp = make_inputs(case)
    g_cumsum, A, o, h, final = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True)
    o_ref, final_ref = reference(inp)
    tol = TOL[case.dtype]
    assert rel_l2(o, o_ref) < tol
    assert rel_l2(final, final_ref) < tol
    if case.pad:
        assert torch.equal(o[:, -case.pad:], torch.zeros_like(o[:, -case.pad:]))


def _check_with_states(case: Case, inp: dict) -> None:
    """The forward with h: o and the final state against the fp64 recurrence, h against
    the torch backend, padding tokens' o zero."""
    _, _, o, h, final = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True,
                                                             output_h=True)
    o_ref, final_ref = reference(inp)
    tol = TOL[case.dtype]
    assert rel_l2(o, o_ref) < tol and rel_l2(final, final_ref) < tol
    h_ref = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_h=True, backend="torch")[3]
    assert rel_l2(h.float(), h_ref.float()) < 5e-3
    if case.pad:
        assert torch.equal(o[:, -case.pad:], torch.zeros_like(o[:, -case.pad:]))


@pytest.mark.parametrize("case", [CASES[0], CASES[11], CASES[12]], ids=lambda c: c.id)
def test_agrees_with_torch_backend(case):
    inp = make_inputs(case, seed=3)
    ours = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True, output_h=True)
    ref = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True, output_h=True,
                                               backend="torch")
    for name, a, b, tol in zip(("g_cumsum", "A", "o", "h", "final_state"), ours, ref,
                               (1e-6, 4e-3, 5e-3, 5e-3, 5e-3)):   # A: bf16 rounding
        assert a.shape == b.shape, name
        assert rel_l2(a.float(), b.float()) < tol, name


def test_bitwise_deterministic():
    inp = make_inputs(CASES[12], seed=5)
    first = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True)
    again = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True)
    for a, b in zip(first, again):
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("training, fused", [(False, None), (True, True), (True, False)],
                         ids=["inference", "training-fused", "training-sweep"])
def test_longest_first_grid_matches_grid_order(training, fused, monkeypatch):
    """A batch whose grids take several waves (7 sequences x 32 heads on at most 132
    SMs) and packs its longest sequence late runs its CTAs longest first
    (``flash_qla_tl.layout.cta_order``): the recurrence, and in a training step the
    fused backward or the reverse sweep. Each CTA's work is the same in either order:
    o, the final states and every gradient equal the grid-order run's bit for bit, and
    o and the final states match the fp64 recurrence."""
    from flash_qla import api
    from flash_qla.offsets import KeptPlans
    from flash_qla_sm90.arch import served_arch
    from flash_qla_tl import forward, layout
    from tests.helpers import force_fused_backward

    if fused is not None:
        force_fused_backward(monkeypatch, fused)
    case = _varlen([64, 1, 150, 0, 999, 300, 77], 16, 32, pad=3)
    inp = make_inputs(case, seed=7)
    arch = served_arch()
    if not arch.ordered_grid:
        pytest.skip(f"{arch.name} keeps grid order (Arch.ordered_grid)")
    assert layout.cta_order(arch, inp["cu_seqlens"].cpu(), case.Hv, inp["q"].device)[1] == 1
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run():
        args = {n: (t.detach().clone().requires_grad_(training) if n in names else t)
                for n, t in inp.items()}
        o, final = flash_qla.chunk_gated_delta_rule(**args, output_final_state=True)
        if not training:
            return [o, final]
        loss = o.float().square().sum() + final.square().sum()
        return [o, final, *torch.autograd.grad(loss, [args[n] for n in names])]

    ordered = run()
    # the order is the forward's launch plan's (the backward takes the forward's plan):
    # no order, and no plan kept from the first run (neither the call's nor the launch's)
    monkeypatch.setattr(forward, "cta_order",
                        lambda arch, cu_cpu, Hv, device, cu=None: (layout.no_walk(device), 0))
    monkeypatch.setattr(forward, "_PLANS", KeptPlans(64))
    monkeypatch.setattr(api, "_CALLS", KeptPlans(64))
    in_grid_order = run()
    for a, b in zip(ordered, in_grid_order, strict=True):
        assert torch.equal(a, b)
    o_ref, final_ref = reference(inp)
    assert rel_l2(ordered[0], o_ref) < TOL[case.dtype]
    assert rel_l2(ordered[1], final_ref) < TOL[case.dtype]


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_captured_forward_keeps_the_eager_calls_grid_order(cu_dtype, monkeypatch):
    """A forward captured with device offsets only, after an eager call on the same
    offsets tensor, launches the longest-first order that call made (kept for the
    graph's life), and its replays equal the eager call bit for bit; int64 offsets
    (FLA's convention, which the kernels read as an int32 copy) too."""
    from flash_qla_sm90.arch import served_arch
    from flash_qla_tl import layout

    if not served_arch().ordered_grid:
        pytest.skip(f"{served_arch().name} keeps grid order (Arch.ordered_grid)")
    case = _varlen([64, 1, 150, 0, 999, 300, 77], 16, 32, pad=3)
    inp = make_inputs(case, seed=9)
    inp["cu_seqlens"] = inp["cu_seqlens"].to(cu_dtype)
    monkeypatch.setattr(layout, "_GRAPH_ORDERS", {})     # set by this capture, or absent
    with torch.inference_mode():
        eager = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            captured = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True)
        torch.cuda.current_stream().wait_stream(stream)
        key = (tuple(layout.host_chunks(inp["cu_seqlens"].cpu())), case.Hv,
               layout.sm_count(inp["q"].device), inp["q"].device)
        assert layout._GRAPH_ORDERS[key] is not None            # the graph reads it
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(eager, captured, strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 11, 12, 13, 14)] + [
    _varlen([1, 63, 0, 75, 130, 1], 1, 2, pad=37, dtype=torch.float16)], ids=lambda c: c.id)
def test_inference_takes_beta_in_qs_dtype(case):
    """An inference call with beta in q's dtype (as FLA's models pass it) hands it to the
    prepare kernel as it is (which writes the recurrence's fp32 copy): o and the final
    state equal bit for bit those of the call with the same beta in fp32, through the
    automatic split too (the 60k-token case) and on a state pool, and match the fp64
    recurrence; NaN in beta's padding changes nothing."""
    inp = make_inputs(case, seed=5)
    inp["beta"] = inp["beta"].to(case.dtype)
    if case.pad:
        inp["beta"][:, -case.pad:] = float("nan")
    up = {**inp, "beta": inp["beta"].float()}
    with torch.inference_mode():
        o, final = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                    auto_cp=True)
        o32, final32 = flash_qla.chunk_gated_delta_rule(**up, output_final_state=True,
                                                        auto_cp=True)
        assert torch.equal(o, o32) and torch.equal(final, final32)
        o_ref, final_ref = reference(inp)
        assert rel_l2(o, o_ref) < TOL[case.dtype]
        assert rel_l2(final, final_ref) < TOL[case.dtype]
        if inp["cu_seqlens"] is None:
            return
        N, Hv = final.shape[:2]                 # a pool: slot N - n holds sequence n
        slots = torch.arange(N, 0, -1, dtype=torch.int32, device="cuda")
        pools = [torch.zeros(N + 2, Hv, 128, 128, device="cuda") for _ in range(2)]
        for pool in pools:
            pool[slots.long()] = inp["initial_state"]
        outs = [flash_qla.chunk_gated_delta_rule(
                    **{**args, "initial_state": pool}, state_indices=slots,
                    output_final_state=True)[0]
                for args, pool in zip((inp, up), pools, strict=True)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])
    assert rel_l2(outs[0], o_ref) < TOL[case.dtype]
    assert rel_l2(pools[0][slots.long()], final_ref) < TOL[case.dtype]


# NaN / Inf in tokens after cu_seqlens[-1] (a CUDA-graph bucket padded with stale memory):
# last chunks that end mid-chunk read them.
POISON_CASES = [CASES[11], _varlen(_lens(10, 1, 300, seed=4), 2, 4, pad=20), CASES[12],
                _varlen(_lens(80, 1, 150, seed=3), 2, 4, pad=41)]


@pytest.mark.parametrize("case", POISON_CASES, ids=lambda c: c.id)
def test_nan_padding_never_reaches_valid_tokens(case):
    """Valid tokens' o and the final states are bitwise those of the same call with zero
    padding; padding tokens' o is 0."""
    inp = make_inputs(case, seed=7)
    clean = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True)
    pad = slice(case.T - case.pad, case.T)
    for name, bad in (("q", float("nan")), ("k", float("nan")), ("v", float("inf")),
                      ("g", float("nan")), ("beta", float("nan"))):
        inp[name] = inp[name].clone()
        inp[name][:, pad] = bad
    dirty = flash_qla.chunk_gated_delta_rule_fwd(**inp, output_final_state=True)
    o_clean, o_dirty = clean[2], dirty[2]
    assert torch.equal(o_dirty[:, :pad.start], o_clean[:, :pad.start])
    assert torch.equal(o_dirty[:, pad], torch.zeros_like(o_dirty[:, pad]))
    assert torch.equal(dirty[4], clean[4])


@pytest.mark.parametrize("case", CASES + POISON_CASES[:2], ids=lambda c: c.id)
def test_forward_with_states_matches_recurrence(case):
    """The forward kernel storing h (fp32, ``output_h``): o and the final state against
    the fp64 recurrence, h against the torch backend, padding rows zero."""
    _check_with_states(case, make_inputs(case, seed=9))


@pytest.mark.parametrize("case", CASES + POISON_CASES[:2], ids=lambda c: c.id)
def test_prepare_matches_recurrence(case):
    """The prepare kernel (chunk_prepare: its inverse on register-chained mma.sync,
    ``unit_lower_inverse``): the whole forward against the fp64 recurrence (o, final
    state, h), its A against the torch backend's (fp64 substitution), padding rows zero
    and NaN padding never entering."""
    inp = make_inputs(case, seed=13)
    _, a_blk, *_ = flash_qla.chunk_gated_delta_rule_fwd(**inp)
    _, a_ref, *_ = flash_qla.chunk_gated_delta_rule_fwd(**inp, backend="torch")
    assert torch.isfinite(a_blk).all()
    assert rel_l2(a_blk.float(), a_ref.float()) < 4e-3
    _check_with_states(case, inp)
    if case.pad:                                  # NaN in k, g, beta past cu_seqlens[-1]
        pad = slice(case.T - case.pad, case.T)
        for name in ("k", "g", "beta"):
            inp[name] = inp[name].clone()
            inp[name][:, pad] = float("nan")
        _, a_dirty, *_ = flash_qla.chunk_gated_delta_rule_fwd(**inp)
        assert torch.equal(a_dirty[:, :pad.start], a_blk[:, :pad.start])


def test_high_level_options():
    """v-first state, qk L2-norm and in-kernel gate around the kernels vs the torch backend."""
    inp = make_inputs(CASES[12], seed=7)
    Hv = inp["v"].shape[2]
    A_log = torch.log(torch.empty(Hv, device="cuda").uniform_(1, 16))
    dt_bias = torch.randn(Hv, device="cuda") * 0.1
    kw = dict(q=inp["q"] * 3, k=inp["k"] * 3, v=inp["v"], g=torch.randn_like(inp["g"]),
              beta=inp["beta"], initial_state=inp["initial_state"].transpose(-1, -2).contiguous(),
              cu_seqlens=inp["cu_seqlens"], output_final_state=True, use_qk_l2norm_in_kernel=True,
              state_v_first=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o, final = flash_qla.chunk_gated_delta_rule(**kw)
    o_ref, final_ref = flash_qla.chunk_gated_delta_rule(**kw, backend="torch")
    assert rel_l2(o, o_ref) < 5e-3
    assert rel_l2(final, final_ref) < 5e-3


def test_no_recompilation_across_shapes():
    """B, T, H, N and sequence lengths are dynamic: one compiled kernel per static config."""
    from flash_qla_tl.kernels.chunk_cumsum_inverse import chunk_prepare_kernel
    from flash_qla_tl.kernels.chunk_state_output import chunk_fwd_ws_kernel

    builders = (chunk_prepare_kernel, chunk_fwd_ws_kernel)
    warm = [Case(1, 64, 1, 1), Case(8, 256, 16, 32)]
    for case in warm:
        flash_qla.chunk_gated_delta_rule_fwd(**make_inputs(case))
    before = [b.cache_info().currsize for b in builders]
    for case in (Case(2, 300, 2, 4), Case(1, 777, 4, 32), _varlen([5, 0, 900, 64], 1, 8),
                 Case(9, 100, 16, 32)):
        flash_qla.chunk_gated_delta_rule_fwd(**make_inputs(case))
    assert [b.cache_info().currsize for b in builders] == before


SEGMENT_CASES = [
    (Case(1, 32768, 2, 8), 2048),
    (Case(1, 8192, 4, 4, gate="strong"), 1024),
    (_varlen([60000, 7, 300, 1200], 2, 4, gate="zero"), 4096),
    (_varlen([0, 5000, 64, 1], 1, 2, pad=3), 1024),
]


@pytest.mark.parametrize("bound", [0.0, 2.0 ** -9], ids=["exact", "bounded"])
@pytest.mark.parametrize("case, segment_len", SEGMENT_CASES,
                         ids=[f"{c.id}-seg{s}" for c, s in SEGMENT_CASES])
def test_segment_parallel_forward(case, segment_len, bound):
    """The exact split (bound 0: three passes and the scan) and the bounded one (the
    default: one pass of chunk_fwd_ws with warm-up walks) against the fp64 recurrence;
    zero decay (every walk back to its sequence start) must be right too."""
    inp = make_inputs(case, seed=9)
    o, final = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                segment_len=segment_len,
                                                segment_shortcut_bound=bound)
    o_ref, final_ref = reference(inp)
    tol = TOL[case.dtype]
    assert rel_l2(o, o_ref) < tol
    assert rel_l2(final, final_ref) < tol


BOUNDED_CASES = [
    (Case(1, 8192, 2, 4), 1024),
    (Case(1, 4096, 4, 4, gate="strong"), 512),
    (_varlen([6000, 7, 300, 1200], 2, 4, gate="zero"), 1024),
    (_varlen([0, 3000, 64, 1], 1, 2, pad=3), 512),
    (Case(1, 5000, 2, 4), 960),             # 15 chunks: the planner's even cuts are no
]                                           # power of two


@pytest.mark.parametrize("bound", [2.0 ** -9, 0.25], ids=["default", "loose"])
@pytest.mark.parametrize("case, segment_len", BOUNDED_CASES,
                         ids=[f"{c.id}-seg{s}" for c, s in BOUNDED_CASES])
def test_bounded_split_agrees_with_torch_backend(case, segment_len, bound):
    """The kernel's warm-up walks (chunk_fwd_ws with warmup, searched in the kernel)
    against the torch backend's fwd_warmup (each segment and head run from the walk
    start of segments.warmup_starts) on the same inputs and bound: same walks, so the
    same dropped history. The loose bound drops a lot (walks of a chunk or two): a walk
    one chunk off would differ far beyond the tolerance. The typical-gate case does drop
    some at the default bound (the shortcut is taken there)."""
    from flash_qla import segments

    inp = make_inputs(case, seed=13)
    kw = dict(output_final_state=True, segment_len=segment_len, segment_shortcut_bound=bound)
    ours = flash_qla.chunk_gated_delta_rule(**inp, **kw)
    ref = flash_qla.chunk_gated_delta_rule(**inp, **kw, backend="torch")
    for name, a, b in zip(("o", "final_state"), ours, ref):
        assert a.shape == b.shape, name
        assert rel_l2(a.float(), b.float()) < TOL[case.dtype], name
    if case.gate == "typical" and not case.lens and bound < 0.01:
        plan = segments._plan((0, case.T), segment_len, inp["q"].device)
        gc = flash_qla.chunk_gated_delta_rule_fwd(**inp)[0]
        _, h0_from = segments.warmup_starts(gc.reshape(1, -1, case.Hv), plan, 2.0 ** -9)
        assert (h0_from < 0).any()


def test_bounded_split_is_bitwise_deterministic():
    """Repeated bounded-split calls (walks, warm-up kernel, final-state gather) give the
    same bits."""
    inp = make_inputs(_varlen([9000, 64, 3001], 2, 8), seed=17)
    first = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True, segment_len=1024)
    again = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True, segment_len=1024)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_automatic_split_matches_recurrence():
    """The automatic segment plan: one long sequence at few heads is split by the cost
    model and still matches the fp64 recurrence; a grid that fills the GPU is not planned
    for a split."""
    from flash_qla_tl import plan
    from flash_qla_tl.layout import sm_count

    case = Case(1, 32768, 2, 8)
    inp = make_inputs(case, seed=21)
    sms = sm_count(inp["q"].device)
    assert plan.segment_len([0, case.T], case.Hv, sms).value is not None
    o, final = flash_qla.chunk_gated_delta_rule(**inp, output_final_state=True)
    o_ref, final_ref = reference(inp)
    assert rel_l2(o, o_ref) < TOL[case.dtype]
    assert rel_l2(final, final_ref) < TOL[case.dtype]
    assert plan.segment_len([b * 4096 for b in range(9)], 32, sms).value is None


def test_split_inside_graph_capture():
    """Inside a CUDA-graph capture: the automatic bounded split of a dense input is
    captured (its walks are recomputed from the live gates at every replay: a replay on
    new inputs equals the eager call on them, bitwise); the exact split raises a
    ValueError naming segment_len; a varlen batch is split by a plan laid out on the
    device from the live cu_seqlens: a replay after the offsets changed in place equals
    the eager split of the new lengths, bitwise, and the automatic choice (planned from
    the capture's cu_seqlens_cpu) replays as the eager automatic call."""
    dense = make_inputs(Case(1, 32768, 2, 8), seed=5)
    varlen = make_inputs(_varlen([20000, 12768], 2, 8), seed=6)
    varlen["cu_seqlens_cpu"] = varlen["cu_seqlens"].cpu()           # eager calls split it
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = [torch.cuda.CUDAGraph() for _ in range(4)]
    with torch.cuda.stream(stream):
        flash_qla.chunk_gated_delta_rule(**dense)                     # warm-up off-graph
        flash_qla.chunk_gated_delta_rule(**varlen)
        flash_qla.chunk_gated_delta_rule(**varlen, segment_len=2048)
        with torch.cuda.graph(graphs[0]):
            captured, _ = flash_qla.chunk_gated_delta_rule(**dense)
        with pytest.raises(ValueError, match="segment_len"), torch.cuda.graph(graphs[1]):
            flash_qla.chunk_gated_delta_rule(**dense, segment_len=2048,
                                             segment_shortcut_bound=0.0)
        with torch.cuda.graph(graphs[2]):
            live, live_final = flash_qla.chunk_gated_delta_rule(
                **varlen, segment_len=2048, output_final_state=True)
        with torch.cuda.graph(graphs[3]):
            captured_varlen, _ = flash_qla.chunk_gated_delta_rule(**varlen)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = make_inputs(Case(1, 32768, 2, 8), seed=7)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        dense[name].copy_(fresh[name])
    graphs[0].replay()
    graphs[3].replay()
    torch.cuda.synchronize()
    eager, _ = flash_qla.chunk_gated_delta_rule(**fresh)
    assert torch.equal(captured, eager)
    assert rel_l2(captured, reference(fresh)[0]) < TOL[torch.bfloat16]
    assert torch.equal(captured_varlen, flash_qla.chunk_gated_delta_rule(**varlen)[0])
    new = torch.tensor([0, 9000, 32768], dtype=torch.int32)       # other lengths, live
    varlen["cu_seqlens"].copy_(new.to(varlen["cu_seqlens"].device))
    varlen["cu_seqlens_cpu"] = new
    graphs[2].replay()
    torch.cuda.synchronize()
    want, want_final = flash_qla.chunk_gated_delta_rule(**varlen, segment_len=2048,
                                                        output_final_state=True)
    assert torch.equal(live, want) and torch.equal(live_final, want_final)
    assert rel_l2(live, reference(varlen)[0]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("lens, pad", [((), 0), ((0, 0), 37)], ids=["T0", "empty-seqs-pad"])
def test_calls_without_chunks(lens, pad):
    """No chunk to compute: T = 0 (dispatched to the torch backend) and a varlen batch of
    empty sequences followed by padding (the Hopper path, whose TMA descriptors need
    every dimension >= 1). A training step through both: o exact zeros, each sequence's
    final state its initial state, zero gradients of q, k, v, g, beta and dh0 = dht."""
    Hk, Hv, D, dev = 1, 2, 128, "cuda"
    T = sum(lens) + pad
    q, k = (F.normalize(torch.randn(1, T, Hk, D, device=dev), dim=-1).bfloat16()
            .requires_grad_() for _ in range(2))
    v = torch.randn(1, T, Hv, D, device=dev).bfloat16().requires_grad_()
    g = (-torch.rand(1, T, Hv, device=dev)).requires_grad_()
    beta = torch.rand(1, T, Hv, device=dev).bfloat16().requires_grad_()
    N = max(len(lens), 1)
    h0 = torch.randn(N, Hv, D, D, device=dev, requires_grad=True)
    cu = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev) if lens else None)
    o, final_state = flash_qla.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(final_state, h0.detach())
    do, dht = torch.randn_like(o), torch.randn_like(final_state)
    grads = torch.autograd.grad((o, final_state), (q, k, v, g, beta, h0), (do, dht))
    for name, grad in zip(("q", "k", "v", "g", "beta"), grads[:5]):
        assert torch.equal(grad, torch.zeros_like(grad)), name
    assert torch.equal(grads[5], dht)
