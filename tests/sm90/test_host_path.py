"""The sm90 host path on the CPU: every TileLang launch replaced by a no-op, so the torch
ops a training step issues around its kernels can be counted without a GPU. Each copy
there is a kernel launch on the GPU (~15 us of host time per launch on the H200 hosts),
and at 8192 tokens a training step is host-bound (docs/perf-notes.md, v11). The stubs
also record which kernel variants the host path launches: exactly the shipped ones
(``flash_qla_tl.precompile.variants``)."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_qla_sm90.arch import SM90
from tests.helpers import force_fused_backward

pytest.importorskip("tilelang", reason="TileLang is not installed")


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


#: The kernel builders each orchestrator launches, by module.
BUILDERS = {"forward": ("chunk_prepare_kernel", "chunk_fwd_ws_kernel"),
            "backward": ("chunk_bwd_dh_ws_kernel", "chunk_bwd_intra_kernel",
                         "group_sum_kernel", "chunk_bwd_fused_kernel"),
            "recurrent": ("recurrent_step_kernel",),
            "layout": ("chunk_layout_kernel", "zero_tail_kernel")}


@pytest.fixture
def built(monkeypatch):
    """``flash_qla.chunk_gated_delta_rule`` on CPU tensors through the sm90 host path,
    with every kernel builder replaced by a stub whose launchers do nothing (132 SMs).
    Returns the (builder name, static arguments) of every launcher built, in order:
    each configuration once (the launchers are kept per configuration)."""
    from flash_qla import api
    from flash_qla_tl import backend, backward, forward, launch, layout, recurrent

    built = []

    def stub(name):
        def builder(*static):
            built.append((name, static))
            return lambda *args: None
        builder.__name__ = name
        return builder

    for module in (forward, backward, recurrent, layout):
        for name in BUILDERS[module.__name__.rpartition(".")[2]]:
            monkeypatch.setattr(module, name, stub(name))
    monkeypatch.setattr(launch, "_LAUNCHERS", {})        # the stubs' launchers die here
    for module in (backward, backend):
        monkeypatch.setattr(module, "sm_count", lambda device: 132)
    kernels = backend.TileLangKernels(SM90)
    monkeypatch.setattr(api, "_select_kernels", lambda q, v, backend, *others: (None, kernels))
    return built


@pytest.fixture
def sm90_without_launches(built, monkeypatch):
    """The host path of :func:`built`; returns which backward each step took."""
    from flash_qla_tl import backward

    ran = []
    for name in ("chunk_bwd", "chunk_bwd_warmup"):
        monkeypatch.setattr(backward, name, _spy(getattr(backward, name), name, ran))
    return ran


@pytest.fixture
def fused_launches(monkeypatch):
    """The statics after (arch, dtype, K, V) of every launch of the forward kernel (and
    of none of the prepare's), in order."""
    from flash_qla_tl import forward

    fused = []
    real = forward.launcher
    monkeypatch.setattr(forward, "launcher", lambda builder, *static: (
        fused.append(static[4:]) if builder is forward.chunk_fwd_ws_kernel else None,
        real(builder, *static))[1])
    return fused


def _spy(fn, name, calls):
    def spied(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return spied


def _inputs(B, T, H, requires_grad):
    dt = torch.bfloat16
    q, k, v = (torch.randn(B, T, H, 128, dtype=dt) for _ in range(3))
    g = -torch.rand(B, T, H)
    beta = torch.rand(B, T, H, dtype=dt)
    h0 = torch.zeros(B, H, 128, 128)
    leaves = tuple(x.requires_grad_(requires_grad) for x in (q, k, v, g, beta, h0))
    return leaves, torch.randn(B, T, H, 128, dtype=dt), torch.randn(B, H, 128, 128)


# 1 x 8192 at 4 heads: the bounded segment split (auto); 4 x 2048 at 16: unsplit
@pytest.mark.parametrize("B, T, H, path", [(1, 8192, 4, "chunk_bwd_warmup"),
                                           (4, 2048, 16, "chunk_bwd")])
def test_training_step_converts_beta_once(sm90_without_launches, B, T, H, path):
    """bf16 beta becomes fp32 once per training step (the autograd Function converts it
    for the forward and saves that copy for the backward: ``Kernels.beta_dtype``), and
    dbeta goes back to bf16 (autograd's cast): two dtype copies per step (after the
    first, which fills the per-shape caches), no in-place copies, and every gradient in
    its leaf's dtype."""
    import flash_qla

    leaves, do, dht = _inputs(B, T, H, requires_grad=True)
    q, k, v, g, beta, h0 = leaves

    def step():
        o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                 output_final_state=True)
        return torch.autograd.grad((o, ht), leaves, (do, dht))

    step()                          # the first call fills the per-shape caches
    count = _OpCount()
    with count:
        grads = step()
    assert sm90_without_launches == [path, path]
    assert count.ops["aten._to_copy"] == 2, count.ops
    assert count.ops["aten.copy_"] == 0, count.ops
    assert [(x.shape, x.dtype) for x in grads] == [(x.shape, x.dtype) for x in leaves]


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("B, T, H, path", [(1, 8192, 4, "chunk_bwd_warmup"),
                                           (4, 2048, 16, "chunk_bwd")])
def test_training_forward_keeps_states_for_the_backward(sm90_without_launches, fused_launches,
                                                        B, T, H, path, save):
    """``save_chunk_states`` (default): the training forward's ``chunk_fwd_ws`` computes
    o and also stores h in q's dtype (warm-up flag as its split), and the backward
    launches no states-only recompute; False: the forward stores no h and the backward
    recomputes it (states only). Statics: (dtype, K, V, has_h0, store_h, warmup,
    h_in_dtype, states_only), trailing False dropped."""
    import flash_qla

    fused = fused_launches
    leaves, do, dht = _inputs(B, T, H, requires_grad=True)
    o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                             output_final_state=True,
                                             save_chunk_states=save)
    torch.autograd.grad((o, ht), leaves, (do, dht))
    warmup = path == "chunk_bwd_warmup"
    assert sm90_without_launches == [path]
    if save:
        assert fused == [(True, True, warmup, True)]                # o + h in dtype
    else:
        assert fused == [(True, False, True) if warmup else (True, False),   # o only
                         (True, True, warmup, True, True)]          # h recomputed


@pytest.mark.parametrize("varlen, path", [(False, "chunk_bwd_warmup"), (True, "chunk_bwd")],
                         ids=["dense", "varlen"])
def test_captured_backward_of_a_bounded_forward_reads_its_kept_states(
        sm90_without_launches, fused_launches, monkeypatch, varlen, path):
    """A bounded-split training forward (eager) whose backward runs inside a CUDA-graph
    capture: dense, the bounded backward (its split is planned from the shape, the same
    at every replay); varlen (host offsets), the unsplit backward (the split would be
    planned from the call's lengths). Both read the states the bounded forward kept
    (same [K, V] layout, dtype and chunk rows) and launch no recompute."""
    import flash_qla
    from flash_qla import validation

    fused = fused_launches
    (q, k, v, g, beta, h0), do, dht = _inputs(1, 8192, 4, requires_grad=True)
    seqs = {}
    if varlen:
        cu = torch.tensor([0, 5000, 8192], dtype=torch.int32)
        seqs = dict(cu_seqlens=cu, cu_seqlens_cpu=cu)
        h0 = torch.zeros(2, 4, 128, 128, requires_grad=True)
        dht = torch.randn(2, 4, 128, 128)
    leaves = (q, k, v, g, beta, h0)
    o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], initial_state=h0,
                                             output_final_state=True, **seqs)
    monkeypatch.setattr(validation, "is_capturing", lambda device: True)
    torch.autograd.grad((o, ht), leaves, (do, dht))
    assert sm90_without_launches == [path]
    assert fused == [(True, True, True, True)]           # the bounded forward's, only


@pytest.mark.parametrize("B, T, H", [(1, 8192, 4), (4, 2048, 16)])
def test_low_level_backward_returns_dbeta_in_beta_dtype(sm90_without_launches, B, T, H):
    """``chunk_gated_delta_rule_bwd`` (no autograd to cast for it) returns dbeta in beta's
    dtype although the backward computes it from fp32 beta, and dg in fp32."""
    import flash_qla

    (q, k, v, g, beta, h0), do, dht = _inputs(B, T, H, requires_grad=False)
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta,
                                                                initial_state=h0)
    dq, dk, dv, dbeta, dg, dh0 = flash_qla.chunk_gated_delta_rule_bwd(
        q, k, v, g_cumsum, beta, A, do, dht, initial_state=h0)
    assert sm90_without_launches == ["chunk_bwd"]       # the low level never splits
    assert (dbeta.dtype, dbeta.shape) == (beta.dtype, beta.shape)
    assert (dg.dtype, dq.dtype, dv.dtype) == (torch.float32, q.dtype, v.dtype)


def test_unsplit_backward_keeps_states_in_q_dtype(sm90_without_launches, monkeypatch):
    """The unsplit two-kernel backward (4 x 2048 at 16 heads) hands the per-chunk
    gradient kernel h and dS1 in q's dtype, with no conversion copy."""
    import flash_qla
    from flash_qla_tl import backward

    seen = []
    real = backward.chunk_grads
    monkeypatch.setattr(backward, "chunk_grads", lambda *a, **kw: (
        seen.append((a[7].dtype, a[8].dtype)), real(*a, **kw))[1])
    (q, k, v, g, beta, h0), do, dht = _inputs(4, 2048, 16, requires_grad=False)
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta,
                                                                initial_state=h0)
    count = _OpCount()
    with count:
        flash_qla.chunk_gated_delta_rule_bwd(q, k, v, g_cumsum, beta, A, do, dht,
                                             initial_state=h0)
    assert sm90_without_launches == ["chunk_bwd"] and seen == [(q.dtype, q.dtype)], seen
    assert count.ops["aten._to_copy"] == 2, count.ops          # beta up, dbeta back only


def _spy_launches(monkeypatch, module, launched: list) -> None:
    """Record ``(builder name, static, args)`` of every launch ``module`` makes (the
    static arguments after the arch, which is SM90's)."""
    real = module.launcher

    def spy(builder, *static):
        run = real(builder, *static)
        assert static[0] is SM90
        return lambda *args: (launched.append((builder.__name__, static[1:], args)),
                              run(*args))[1]

    monkeypatch.setattr(module, "launcher", spy)


def test_gva_backward_writes_per_head_grads_in_q_dtype(sm90_without_launches, monkeypatch):
    """GVA (Hv = 2 Hk): the per-chunk gradient kernel writes dq, dk per value head in
    q's dtype and one reduction per tensor sums the heads (no cast copy after it)."""
    import flash_qla
    from flash_qla_tl import backward

    launched = []
    _spy_launches(monkeypatch, backward, launched)
    (q, k, v, g, beta, h0), do, dht = _inputs(4, 256, 4, requires_grad=False)
    q, k = q[:, :, :2].contiguous(), k[:, :, :2].contiguous()          # Hk = 2, Hv = 4
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta,
                                                                initial_state=h0)
    count = _OpCount()
    with count:
        dq, dk, *_ = flash_qla.chunk_gated_delta_rule_bwd(q, k, v, g_cumsum, beta, A, do,
                                                          dht, initial_state=h0)
    names = [name for name, _, _ in launched]
    assert names == ["chunk_bwd_dh_ws_kernel", "chunk_bwd_intra_kernel",
                     "group_sum_kernel", "group_sum_kernel"], names      # dq's, dk's sums
    intra = launched[1][2]
    assert intra[13].dtype == intra[14].dtype == q.dtype                 # dq, dk per head
    assert (dq.dtype, dq.shape, dk.dtype) == (q.dtype, q.shape, k.dtype)
    assert count.ops.get("aten.sum", 0) == 0, count.ops
    assert count.ops["aten._to_copy"] == 2, count.ops


def test_gva_sum_reads_the_kernels_group_major_layout(sm90_without_launches, monkeypatch):
    """``chunk_bwd_intra_kernel`` writes value head hv = hk * G + g's dq, dk at
    ``[g, :, hk]`` of a ``[G, Tt, Hk, K]`` buffer; ``chunk_grads`` sums over g. A stand-in
    launch writes known per-value-head rows there by that rule: the returned dq, dk are
    each q/k head's sum over its own value heads (GVA 1:3, so a wrong group order shows)."""
    import flash_qla
    from flash_qla_tl import backward

    gen = torch.Generator().manual_seed(5)
    B, T, Hk, Hv, K = 1, 128, 2, 6, 128
    G = Hv // Hk
    per_head = {n: torch.randn(B * T, Hv, K, generator=gen).bfloat16() for n in ("dq", "dk")}

    def fill(*args):
        for n, buf in zip(("dq", "dk"), args[13:15]):
            assert buf.shape == (G, B * T, Hk, K), buf.shape
            for hv in range(Hv):
                buf[hv % G, :, hv // G] = per_head[n][:, hv].to(buf.dtype)

    def group_sum(x, out):                   # group_sum_kernel's contract: [G, M, K] -> [M, K]
        out.copy_(x.float().sum(dim=0))

    launches = {"chunk_bwd_intra_kernel": fill, "group_sum_kernel": group_sum}
    monkeypatch.setattr(backward, "launcher", lambda builder, *static: launches.get(
        builder.__name__, lambda *args: None))
    (q, k, v, g, beta, h0), do, dht = _inputs(B, T, Hv, requires_grad=False)
    q, k = q[:, :, :Hk].contiguous(), k[:, :, :Hk].contiguous()
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta,
                                                                initial_state=h0)
    dq, dk, *_ = flash_qla.chunk_gated_delta_rule_bwd(q, k, v, g_cumsum, beta, A, do, dht,
                                                      initial_state=h0)
    for name, got in (("dq", dq), ("dk", dk)):
        want = per_head[name].float().view(B, T, Hk, G, K).sum(3)     # [B, T, Hk, K]
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.01, msg=name)


_INDEX_OPS = ("aten.searchsorted", "aten.cumsum")     # layout._build's, on the device


def test_captured_bounded_split_reuses_its_segment_layout(sm90_without_launches, monkeypatch):
    """The bounded split's segment offsets never change (the plan keeps them), so their
    chunk layout, built by the first eager call, serves a later CUDA-graph capture too:
    the captured training step records none of the layout's index ops. A capture with
    no eager call before it builds the layout inside the graph and keeps nothing of it;
    the user's varlen offsets are rebuilt in every capture as before."""
    import flash_qla
    from flash_qla import validation
    from flash_qla_tl import layout

    capturing = {"on": False}
    for module in (validation, layout):
        monkeypatch.setattr(module, "is_capturing", lambda device: capturing["on"])
    inputs = {T: _inputs(1, T, 4, requires_grad=True) for T in (8192, 16384)}

    def step(T=8192):
        leaves, do, dht = inputs[T]
        o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                                 output_final_state=True)
        torch.autograd.grad((o, ht), leaves, (do, dht))

    step()                                                     # eager: layout kept
    capturing["on"] = True
    count = _OpCount()
    with count:
        step()                                                 # "captured": reused
    assert not any(count.ops[op] for op in _INDEX_OPS), count.ops
    count = _OpCount()
    with count:
        step(T=16384)                                          # a plan never run eagerly
    assert all(count.ops[op] for op in _INDEX_OPS), count.ops
    capturing["on"] = False
    count = _OpCount()
    with count:
        step(T=16384)                                          # so eager builds its own
    assert all(count.ops[op] for op in _INDEX_OPS), count.ops
    assert sm90_without_launches == ["chunk_bwd_warmup"] * 4


@pytest.mark.parametrize("host_lengths", [True, False], ids=["cu_seqlens_cpu", "device-only"])
def test_captured_varlen_batch_is_split_on_the_device(sm90_without_launches, fused_launches,
                                                      monkeypatch, host_lengths):
    """Inside a CUDA-graph capture a varlen prefill (no grad) at few heads runs the
    bounded split (the warm-up flag set on the forward kernel) from a plan laid out on the
    device: the segment length is planned from cu_seqlens_cpu when given, else as if
    one sequence held nearly all the tokens; the lengths are never read on the host. A
    batch of 64 sequences (x 4 heads: more CTAs than SMs) stays unsplit either way."""
    import flash_qla
    from flash_qla import segments, validation
    from flash_qla_tl import layout

    for module in (validation, segments, layout):
        monkeypatch.setattr(module, "is_capturing", lambda device: True)
    monkeypatch.setattr(segments, "host_bounds", None)          # no host lengths used
    (q, k, v, g, beta, _), _, _ = _inputs(1, 8192, 4, requires_grad=False)
    cu = torch.tensor([0, 5000, 8192], dtype=torch.int32)
    h0 = torch.zeros(2, 4, 128, 128)
    o, ht = flash_qla.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
        cu_seqlens_cpu=cu if host_lengths else None)
    assert fused_launches == [(True, False, True)]    # has_h0, no h, warm-up
    assert o.shape == v.shape and ht.shape == h0.shape
    many = torch.arange(0, 8193, 128, dtype=torch.int32)                 # 64 sequences
    fused_launches.clear()
    flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=many,
                                     cu_seqlens_cpu=many if host_lengths else None)
    assert fused_launches == [(False, False)]            # no h0, no h, no warm-up


def test_stored_states_of_a_chunkless_batch_keep_one_row_for_tma(sm90_without_launches,
                                                                 monkeypatch):
    """A varlen batch of empty sequences (padding only) has no chunk; h and dS1 in q's
    dtype leave their kernels by TMA, whose descriptors need every dimension >= 1: the
    kernels get one row (never written), the callers none."""
    from flash_qla_tl import backward, forward

    launched = {}
    for module, name in ((forward, "fwd"), (backward, "sweep")):
        real = module.launcher

        def spy(builder, *static, real=real, name=name):
            run = real(builder, *static)
            return lambda *args: (launched.setdefault(name, args), run(*args))[1]

        monkeypatch.setattr(module, "launcher", spy)
    (q, k, v, g, beta, h0), do, _ = _inputs(1, 64, 2, requires_grad=False)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    A = torch.zeros(1, 64, 2, 64, dtype=q.dtype)
    p = backward.pack(q, k, v, g, beta, A, do, cu, arch=SM90)
    _, _, h = forward.state_output(p.q, p.k, p.v, p.g_cumsum, p.beta, p.A, p.layout,
                                   arch=SM90, scale=1.0, initial_state=None, num_chunks=0,
                                   alloc=torch.empty, h_in_dtype=True, order=p.plan.order)
    dS1, _ = backward.state_grads(q, k, do, g, beta, A, arch=SM90, scale=1.0, dht=None,
                                  cu_seqlens=cu,
                                  cu_seqlens_cpu=cu, packed=p)
    assert launched["fwd"][12].shape[0] == 1 and h.shape == (0, 2, 128, 128)
    assert launched["sweep"][10].shape[0] == 1 and dS1.shape == (0, 2, 128, 128)


@pytest.mark.parametrize("B, T, H, path", [(4, 2048, 16, "chunk_bwd"),
                                           (1, 8192, 4, "chunk_bwd_warmup")])
def test_fused_backward_launches(sm90_without_launches, monkeypatch, B, T, H, path):
    """With the fused kernel: the unsplit backward launches ``chunk_bwd_fused`` (h in q's
    dtype, the caller's dht) instead of the sweep and the per-chunk kernel; the bounded
    split (1 x 8192 at 4 heads) launches the boundary sweep (no dS1, dS at each segment's
    end) and then the fused kernel from those states."""
    import flash_qla
    from flash_qla_tl import backward

    force_fused_backward(monkeypatch, True)
    launched = []
    _spy_launches(monkeypatch, backward, launched)
    (q, k, v, g, beta, h0), do, dht = _inputs(B, T, H, requires_grad=True)
    o, final = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True)
    torch.autograd.backward([o, final], [do, dht])
    assert sm90_without_launches == [path]
    names = [name for name, _, _ in launched]
    fused = launched[-1]
    assert fused[1] == ("bfloat16", 128, 128, True)              # dht
    assert fused[2][7].dtype == q.dtype                          # h
    N = fused[2][17].shape[0]                                    # dh0 rows
    assert fused[2][10].shape == (N, H, 128, 128) == fused[2][17].shape   # dht per walk
    if path == "chunk_bwd":
        assert names == ["chunk_bwd_fused_kernel"] and N == B
        assert fused[2][10] is not fused[2][17]
    else:
        sweep = launched[0]
        assert names == ["chunk_bwd_dh_ws_kernel", "chunk_bwd_fused_kernel"]
        assert sweep[1][3:] == (True, True, False, True)          # dht, warm-up, boundary
        assert sweep[2][11] is fused[2][10] and N > 1             # its dh0 starts the walks
    assert q.grad.shape == q.shape and g.grad.shape == g.shape


def _training_step(B, T, *, h0: bool, dht: bool, save: bool, output_h: bool = False):
    """One forward with grad (GVA 2/4) and its backward, or with ``output_h`` a
    low-level forward returning h."""
    import flash_qla

    (q, k, v, g, beta, h), do, ht_grad = _inputs(B, T, 4, requires_grad=True)
    q, k = (x.detach()[:, :, :2].clone().requires_grad_() for x in (q, k))
    state = h if h0 else None
    if output_h:
        flash_qla.chunk_gated_delta_rule_fwd(q.detach(), k.detach(), v.detach(), g.detach(),
                                             beta.detach(), initial_state=state,
                                             output_h=True)
        return
    o, final = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                output_final_state=dht,
                                                save_chunk_states=save)
    outs, grads = ((o, final), (do, ht_grad)) if dht else ((o,), (do,))
    torch.autograd.backward(outs, grads)


def _decode_step(*, h0: bool, pool_dtype: torch.dtype | None = None, v_first: bool = False,
                 beta_dtype: torch.dtype = torch.float32):
    """One decode token for each of 4 sequences (GVA 2/4), from a state or from zeros,
    or (``pool_dtype``) on a state pool of that dtype; beta in ``beta_dtype``."""
    import flash_qla

    (q, k, v, g, beta, h), _, _ = _inputs(4, 1, 4, requires_grad=False)
    state = h.transpose(-1, -2).contiguous() if v_first else h
    extra = {}
    if pool_dtype is not None:
        state = torch.zeros(6, *state.shape[1:], dtype=pool_dtype)
        extra = {"state_indices": torch.tensor([5, 0, -1, 2], dtype=torch.int32)}
    flash_qla.fused_recurrent_gated_delta_rule(q[:, :, :2], k[:, :, :2], v, g,
                                               beta=beta.to(beta_dtype),
                                               initial_state=state if h0 else None,
                                               output_final_state=True,
                                               state_v_first=v_first, **extra)


def _pool_batch(pool_dtype: torch.dtype) -> dict:
    """An engine's prefill batch on a state pool: 3 sequences (one a padding row), GVA
    2/4, bf16, K = V = 128; the keyword arguments of the call but ``state_v_first``."""
    (q, k, v, g, beta, _), _, _ = _inputs(1, 200, 4, requires_grad=False)
    return dict(q=q[:, :, :2], k=k[:, :, :2], v=v, g=g, beta=beta,
                initial_state=torch.zeros(5, 4, 128, 128, dtype=pool_dtype),
                state_indices=torch.tensor([3, -1, 0], dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 64, 70, 190], dtype=torch.int32),
                output_final_state=True)


def _pool_prefill(batch: dict, v_first: bool) -> None:
    import flash_qla

    with torch.inference_mode():
        flash_qla.chunk_gated_delta_rule(**batch, state_v_first=v_first)


def test_pool_prefill_runs_on_the_pool_itself(built, monkeypatch):
    """The pool forward hands the pool to the recurrence kernel as its initial and final
    state and the int32 slots as they are: no gather, scatter, index or copy op on the
    host path (after the first call, which fills the layout caches)."""
    from flash_qla_tl import forward

    launches = []
    real = forward.launcher

    def spy(builder, *static):
        kernel = real(builder, *static)

        def launch(*args):
            launches.append((builder.__name__, static, args))
            return kernel(*args)
        return launch

    monkeypatch.setattr(forward, "launcher", spy)
    batch = _pool_batch(torch.bfloat16)
    _pool_prefill(batch, True)
    count = _OpCount()
    with count:
        _pool_prefill(batch, True)
    name, static, args = launches[-1]
    assert name == "chunk_fwd_ws_kernel" and static[-2:] == ("bfloat16", True)
    pool, idx = batch["initial_state"], batch["state_indices"]
    assert args[8] is pool and args[11] is pool and args[14] is idx
    gathers = {op for op in count.ops if any(word in op for word in (
        "index", "gather", "scatter", "where", "copy"))}
    assert gathers == set(), count.ops


def test_launched_variants_are_the_shipped_ones(built, monkeypatch):
    """Training steps over every option the host path distinguishes (initial state,
    state gradient, kept or recomputed h, unsplit or bounded split, fused or two-kernel
    backward, h returned), decode steps (from zeros, a state or a pool in 3 dtypes; both
    layouts; beta in fp32 or bf16) and prefills on a state pool (3 dtypes x 2 layouts)
    launch exactly the bf16 variants ``precompile.variants(SM90)``
    compiles ahead of time: none missing from the shipped cache, none shipped unused."""
    precompile = pytest.importorskip("flash_qla_tl.precompile")
    for fused in (False, True):
        force_fused_backward(monkeypatch, fused)
        for (B, T), h0, dht, save in itertools.product(((2, 256), (1, 8192)), (False, True),
                                                       (False, True), (False, True)):
            _training_step(B, T, h0=h0, dht=dht, save=save)
    for h0 in (False, True):
        _training_step(2, 256, h0=h0, dht=False, save=False, output_h=True)
    for v_first, beta_dtype in itertools.product((False, True),
                                                 (torch.float32, torch.bfloat16)):
        for h0 in (False, True):
            _decode_step(h0=h0, v_first=v_first, beta_dtype=beta_dtype)
        for pool_dtype in (torch.bfloat16, torch.float16):
            _decode_step(h0=True, pool_dtype=pool_dtype, v_first=v_first,
                         beta_dtype=beta_dtype)
    for pool_dtype, v_first in itertools.product(
            (torch.float32, torch.bfloat16, torch.float16), (False, True)):
        _pool_prefill(_pool_batch(pool_dtype), v_first)
    # (the varlen layout and padding zeros, variants without a dtype, are built on a
    # device only: CPU offsets take the layout's torch formula and are read on the host)
    shipped = {(b.__name__, args) for b, args in precompile.variants(SM90)
               if args[1:2] == ("bfloat16",)}
    assert set(built) == shipped, (sorted(set(built) - shipped), sorted(shipped - set(built)))
