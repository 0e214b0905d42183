"""Prefill on an engine's state pool: ``chunk_gated_delta_rule(..., initial_state=pool,
state_indices=idx, output_final_state=True)`` (:mod:`flash_qla.state_pool`).

Every case runs on the CPU (``torch`` backend) and, marked ``gpu``, the same checks on
CUDA in bf16 with K = V = 128 (the sm90 kernel, which reads and writes the pool rows
itself), against the fp64 token-by-token recurrence from the pool rows as stored. The
rows the call must not touch (slots no sequence names, a padding sequence's) are
compared bit for bit; the written rows within the pool dtype's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference import recurrent_gated_delta_rule
from tests.helpers import rel_l2

#: id -> (device, q/k/v dtype, K = V); the CUDA one needs a GPU (marker ``gpu``).
TARGETS = {
    "cpu-fp32": ("cpu", torch.float32, 16),
    "cpu-bf16": ("cpu", torch.bfloat16, 16),
    "cuda-bf16": ("cuda", torch.bfloat16, 128),
}
#: Relative L2 bound vs fp64 by q/k/v dtype, and the extra of a pool row rounded to its
#: dtype (bf16 / fp16 keep 8 / 11 significant bits: ~2^-9 / 2^-12 relative per element).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 4e-3, torch.float16: 5e-4}


def targets(*names: str) -> list:
    return [pytest.param(*TARGETS[n], id=n,
                         marks=[pytest.mark.gpu] if TARGETS[n][0] == "cuda" else [])
            for n in names]


ALL = ("cpu-fp32", "cpu-bf16", "cuda-bf16")


@dataclass(frozen=True)
class Batch:
    """A packed prefill batch: ``lens`` tokens per sequence (0: empty), ``padding``
    tokens after the last, the pool slot of each sequence (negative: padding row)."""
    lens: tuple[int, ...]
    slots: tuple[int, ...]
    pool_size: int
    Hk: int = 2
    Hv: int = 4
    padding: int = 0

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.lens:
            out.append(out[-1] + n)
        return out


#: slots permuted, an empty sequence (keeps its row: read and written back), a one-token
#: sequence, one over two chunks, a padding row (-1), padding tokens, unlisted slots
RAGGED = Batch(lens=(37, 0, 1, 150, 64, 20), slots=(5, 2, 7, 0, -1, 3), pool_size=9,
               padding=11)
#: many short sequences, as an engine's prefill step
SHORT = Batch(lens=(16,) * 8, slots=(8, 1, 6, 3, 0, 5, 2, 7), pool_size=12)


def make_batch(batch: Batch, device, dtype, K, *, pool_dtype, v_first, seed=0):
    """``(inputs, pool, idx, cu)``: q, k (unit norm), v, g, beta of the batch; a random
    pool ``[P, Hv, K, V]`` (v-first ``[P, Hv, V, K]``) in ``pool_dtype``; the slots as int32."""
    gen = torch.Generator().manual_seed(seed)
    T = batch.cu_seqlens[-1] + batch.padding

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs = dict(
        q=randn(1, T, batch.Hk, K).to(dtype),
        k=F.normalize(randn(1, T, batch.Hk, K), dim=-1).to(dtype),
        v=randn(1, T, batch.Hv, K).to(dtype),
        g=F.logsigmoid(randn(1, T, batch.Hv) + 3).float(),
        beta=torch.sigmoid(randn(1, T, batch.Hv)).to(dtype),
    )
    pool = randn(batch.pool_size, batch.Hv, K, K).to(pool_dtype)
    inputs = {n: x.to(device) for n, x in inputs.items()}
    idx = torch.tensor(batch.slots, dtype=torch.int32, device=device)
    cu = torch.tensor(batch.cu_seqlens, dtype=torch.int32, device=device)
    return inputs, pool.to(device), idx, cu


def expected(inputs, pool, batch: Batch, *, v_first, l2norm=False):
    """``(o, rows)`` by the fp64 recurrence: each sequence from its pool row as stored
    (zeros for a negative slot); rows ``[N, Hv, K, V]`` fp64 final states."""
    x = {n: t.detach().cpu().double() for n, t in inputs.items()}
    rows = pool.detach().cpu().double()
    if v_first:
        rows = rows.transpose(-1, -2)
    h0 = torch.stack([rows[s] if s >= 0 else torch.zeros_like(rows[0])
                      for s in batch.slots])
    q, k = x["q"], x["k"]
    if l2norm:
        q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    return recurrent_gated_delta_rule(q, k, x["v"], x["g"], x["beta"], initial_state=h0,
                                      cu_seqlens=torch.tensor(batch.cu_seqlens),
                                      output_final_state=True)


def run_pool(inputs, pool, idx, cu, **kwargs):
    with torch.inference_mode():
        return flash_qla.chunk_gated_delta_rule(**inputs, initial_state=pool,
                                                state_indices=idx, cu_seqlens=cu,
                                                **kwargs)


def row(pool, slot, v_first):
    """Pool row ``slot`` as ``[Hv, K, V]``."""
    return pool[slot].transpose(-1, -2) if v_first else pool[slot]


def written_errors(pool, ref_rows, batch: Batch, v_first) -> dict:
    return {s: rel_l2(row(pool, s, v_first), ref_rows[n])
            for n, s in enumerate(batch.slots) if s >= 0}


# --------------------------------------------------------------------------------------
# Values against fp64
# --------------------------------------------------------------------------------------

POOLS = {"pool-fp32": torch.float32, "pool-bf16": torch.bfloat16}
LAYOUTS = {"k-first": False, "v-first": True}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pool_name", POOLS)
@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_pool_rows_read_and_written(device, dtype, K, pool_name, layout):
    """o and each written row against the fp64 recurrence started from the rows as
    stored; the pool object itself is the final state returned."""
    v_first, pool_dtype = LAYOUTS[layout], POOLS[pool_name]
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=pool_dtype,
                                       v_first=v_first)
    o_ref, rows_ref = expected(inputs, pool, RAGGED, v_first=v_first)
    o, final = run_pool(inputs, pool, idx, cu, output_final_state=True,
                        state_v_first=v_first)
    assert final is pool and pool.dtype == pool_dtype
    assert rel_l2(o, o_ref) < TOL[dtype]
    errs = written_errors(pool, rows_ref, RAGGED, v_first)
    tol = TOL[dtype] + ROUNDING[pool_dtype]
    assert {s: e for s, e in errs.items() if not e < tol} == {}, errs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_unnamed_slots_and_padding_rows_untouched(device, dtype, K, layout):
    """Slots no sequence names stay bit for bit; so does nothing else: the padding
    sequence (slot -1) reads no row (its o is the zero-state one) and writes none."""
    v_first = LAYOUTS[layout]
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=torch.bfloat16,
                                       v_first=v_first)
    before = pool.clone()
    o_ref, _ = expected(inputs, pool, RAGGED, v_first=v_first)
    o, _ = run_pool(inputs, pool, idx, cu, output_final_state=True, state_v_first=v_first)
    unnamed = sorted(set(range(RAGGED.pool_size)) - set(RAGGED.slots))
    assert unnamed == [1, 4, 6, 8]
    assert torch.equal(pool[unnamed], before[unnamed])
    pad = RAGGED.slots.index(-1)
    bos, eos = RAGGED.cu_seqlens[pad], RAGGED.cu_seqlens[pad + 1]
    assert rel_l2(o[:, bos:eos], o_ref[:, bos:eos]) < TOL[dtype]
    T_used = RAGGED.cu_seqlens[-1]
    assert torch.equal(o[:, T_used:], torch.zeros_like(o[:, T_used:]))   # padding tokens


@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_empty_sequence_writes_its_row_back_unchanged(device, dtype, K):
    """A zero-length sequence's final state is its initial one: its row is written
    back exactly (a bf16 row survives the round trip through fp32)."""
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=torch.bfloat16,
                                       v_first=True)
    empty = RAGGED.slots[RAGGED.lens.index(0)]
    before = pool[empty].clone()
    run_pool(inputs, pool, idx, cu, output_final_state=True, state_v_first=True)
    assert torch.equal(pool[empty], before)


@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_all_padding_rows_leave_the_pool_alone(device, dtype, K):
    """Every slot negative: the pool is bit for bit unchanged and o is the call's from
    zero states."""
    batch = Batch(lens=SHORT.lens, slots=(-1,) * len(SHORT.lens), pool_size=3)
    inputs, pool, idx, cu = make_batch(batch, device, dtype, K, pool_dtype=torch.float32,
                                       v_first=False)
    before = pool.clone()
    o, final = run_pool(inputs, pool, idx, cu, output_final_state=True)
    with torch.inference_mode():
        o_zero, _ = flash_qla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu)
    assert final is pool and torch.equal(pool, before)
    assert rel_l2(o, o_zero) < TOL[dtype]


@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_many_short_sequences_int64_slots(device, dtype, K):
    """An engine's step (8 sequences of 16 tokens, slots permuted, int64) against fp64."""
    inputs, pool, _, cu = make_batch(SHORT, device, dtype, K, pool_dtype=torch.float32,
                                     v_first=False)
    idx = torch.tensor(SHORT.slots, dtype=torch.int64, device=device)
    o_ref, rows_ref = expected(inputs, pool, SHORT, v_first=False)
    o, _ = run_pool(inputs, pool, idx, cu.long(), output_final_state=True)
    assert rel_l2(o, o_ref) < TOL[dtype]
    errs = written_errors(pool, rows_ref, SHORT, False)
    assert max(errs.values()) < TOL[dtype], errs


@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_dense_batch_rows_are_the_sequences(device, dtype, K):
    """Without cu_seqlens the B batch rows are the sequences, slot ``idx[b]`` each."""
    inputs, pool, _, _ = make_batch(SHORT, device, dtype, K, pool_dtype=torch.float32,
                                    v_first=False)
    dense = {n: x.reshape(8, 16, *x.shape[2:]) for n, x in inputs.items()}
    idx = torch.tensor([4, -1, 2, 0, 9, 1, 11, 7], dtype=torch.int32, device=device)
    batch = Batch(lens=SHORT.lens, slots=tuple(idx.tolist()), pool_size=SHORT.pool_size)
    o_ref, rows_ref = expected(inputs, pool, batch, v_first=False)
    with torch.inference_mode():
        o, _ = flash_qla.chunk_gated_delta_rule(**dense, initial_state=pool,
                                                state_indices=idx, output_final_state=True)
    assert rel_l2(o.reshape(o_ref.shape), o_ref) < TOL[dtype]
    errs = written_errors(pool, rows_ref, batch, False)
    assert max(errs.values()) < TOL[dtype], errs


@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_without_output_final_state_the_pool_is_only_read(device, dtype, K):
    """output_final_state=False: o from the pool rows, the pool unchanged, None back."""
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=torch.bfloat16,
                                       v_first=True)
    before = pool.clone()
    o_ref, _ = expected(inputs, pool, RAGGED, v_first=True)
    o, final = run_pool(inputs, pool, idx, cu, output_final_state=False, state_v_first=True)
    assert final is None and torch.equal(pool, before)
    assert rel_l2(o, o_ref) < TOL[dtype]


@pytest.mark.parametrize("device, dtype, K", targets("cpu-bf16", "cuda-bf16"))
def test_sglang_options_on_a_pool(device, dtype, K):
    """SGLang's prefill options (q/k L2-norm in the kernel, v-first states, int64
    offsets) with its gather / scatter replaced by the pool: same values as fp64."""
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=torch.bfloat16,
                                       v_first=True, seed=4)
    inputs["q"], inputs["k"] = inputs["q"] * 3, inputs["k"] * 0.5     # not unit norm
    o_ref, rows_ref = expected(inputs, pool, RAGGED, v_first=True, l2norm=True)
    o, _ = run_pool(inputs, pool, idx.long(), cu.long(), output_final_state=True,
                    state_v_first=True, use_qk_l2norm_in_kernel=True)
    assert rel_l2(o, o_ref) < TOL[dtype]
    errs = written_errors(pool, rows_ref, RAGGED, True)
    assert max(errs.values()) < TOL[dtype] + ROUNDING[torch.bfloat16], errs


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp16_pool_on_the_gpu(layout):
    """fp16 pool rows (the third pool dtype of the kernel) against fp64."""
    v_first = LAYOUTS[layout]
    inputs, pool, idx, cu = make_batch(RAGGED, "cuda", torch.bfloat16, 128,
                                       pool_dtype=torch.float16, v_first=v_first)
    o_ref, rows_ref = expected(inputs, pool, RAGGED, v_first=v_first)
    o, _ = run_pool(inputs, pool, idx, cu, output_final_state=True, state_v_first=v_first)
    assert rel_l2(o, o_ref) < TOL[torch.bfloat16]
    errs = written_errors(pool, rows_ref, RAGGED, v_first)
    assert max(errs.values()) < TOL[torch.bfloat16] + ROUNDING[torch.float16], errs


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Captured once, replayed on new tokens, offsets, slots and pool contents (same
    shapes): each replay matches fp64 from the pool as it stood, the pool rows are
    updated in place, nothing host-side is read during capture."""
    device, dtype, K = "cuda", torch.bfloat16, 128
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=torch.bfloat16,
                                       v_first=True, seed=2)          # the static buffers
    run_pool(inputs, pool, idx, cu, output_final_state=True, state_v_first=True)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        o, _ = flash_qla.chunk_gated_delta_rule(**inputs, initial_state=pool,
                                                state_indices=idx, cu_seqlens=cu,
                                                output_final_state=True, state_v_first=True)
    # a replay on another batch of the same shapes: other lengths, slots, contents
    other = Batch(lens=(64, 90, 0, 20, 8, 40), slots=(8, -1, 4, 1, 6, 2), pool_size=9,
                  padding=RAGGED.cu_seqlens[-1] + RAGGED.padding - 222)
    for batch, seed in ((RAGGED, 0), (other, 1)):
        new_inputs, new_pool, new_idx, new_cu = make_batch(
            batch, device, dtype, K, pool_dtype=torch.bfloat16, v_first=True, seed=seed)
        for name, x in new_inputs.items():
            inputs[name].copy_(x)
        pool.copy_(new_pool)
        idx.copy_(new_idx)
        cu.copy_(new_cu)
        before = pool.clone()
        o_ref, rows_ref = expected(new_inputs, before, batch, v_first=True)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2(o, o_ref) < TOL[dtype]
        errs = written_errors(pool, rows_ref, batch, True)
        assert max(errs.values()) < TOL[dtype] + ROUNDING[torch.bfloat16], errs
        unnamed = sorted(set(range(batch.pool_size)) - set(batch.slots))
        assert torch.equal(pool[unnamed], before[unnamed])


# --------------------------------------------------------------------------------------
# Errors (CPU)
# --------------------------------------------------------------------------------------

def _cpu_case(**overrides):
    inputs, pool, idx, cu = make_batch(SHORT, "cpu", torch.float32, 16,
                                       pool_dtype=torch.float32, v_first=False)
    kwargs = dict(inputs, initial_state=pool, state_indices=idx, cu_seqlens=cu,
                  output_final_state=True)
    kwargs.update(overrides)
    return kwargs


def test_grad_is_refused():
    kwargs = _cpu_case()
    kwargs["q"] = kwargs["q"].requires_grad_()
    with pytest.raises(NotImplementedError, match="state_indices is for inference"):
        flash_qla.chunk_gated_delta_rule(**kwargs)


def test_grad_is_refused_for_a_pool_that_requires_grad():
    kwargs = _cpu_case()
    kwargs["initial_state"].requires_grad_()
    with pytest.raises(NotImplementedError, match="inference"):
        flash_qla.chunk_gated_delta_rule(**kwargs)


BAD = {
    "index-dtype": (dict(state_indices=torch.zeros(8)), TypeError,
                    r"state_indices must have an integer dtype.*got torch.float32"),
    "index-shape": (dict(state_indices=torch.arange(7)), ValueError,
                    r"state_indices must be \[N\] = \[8\].*got shape \[7\]"),
    "no-pool": (dict(initial_state=None), ValueError, "state_indices needs initial_state"),
    "pool-shape": (dict(initial_state=torch.zeros(12, 4, 16, 8)), ValueError,
                   r"must be \[P, Hv, K, V\] = \[P, 4, 16, 16\]; got shape \[12, 4, 16, 8\]"),
    "pool-dtype": (dict(initial_state=torch.zeros(12, 4, 16, 16, dtype=torch.float64)),
                   TypeError, r"dtype in \(float32, bfloat16, float16\).*got torch.float64"),
    "pool-strided": (dict(initial_state=torch.zeros(12, 4, 16, 32)[..., :16]), ValueError,
                     "must be contiguous"),
    "slot-out-of-range": (dict(state_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 12])),
                          ValueError, r"state_indices\[7\] must be a slot .*< P = 12.*got 12"),
    "slot-twice": (dict(state_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 2])), ValueError,
                   "slot 2 at positions 2 and 7"),
    "segment_len": (dict(segment_len=100), ValueError, "segment_len: expected a positive "
                    "multiple"),
    "cp_context": (dict(cp_context=object()), NotImplementedError, "cp_context"),
    "head_first": (dict(head_first=True), NotImplementedError, "head_first"),
    "output_final_state": (dict(output_final_state=1), TypeError,
                           "output_final_state: expected a bool"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments(case):
    overrides, error, match = BAD[case]
    with torch.inference_mode(), pytest.raises(error, match=match):
        flash_qla.chunk_gated_delta_rule(**_cpu_case(**overrides))


def test_repeated_padding_slots_are_allowed():
    """Only non-negative slots must be distinct: several padding rows are fine."""
    idx = torch.tensor([0, -1, 2, -1, 4, -1, 6, 7], dtype=torch.int32)
    kwargs = _cpu_case(state_indices=idx)
    before = kwargs["initial_state"].clone()
    with torch.inference_mode():
        flash_qla.chunk_gated_delta_rule(**kwargs)
    assert torch.equal(kwargs["initial_state"][[1, 3, 5, 8, 9, 10, 11]],
                       before[[1, 3, 5, 8, 9, 10, 11]])


def test_auto_split_gathers_and_scatters(monkeypatch):
    """A call ``auto_cp`` splits (the planner's answer) does not run the backend's pool
    forward (its segments would race on the slot): the rows are gathered, the split
    runs, the final states are scattered; same values as fp64."""
    from flash_qla import api
    from flash_qla.reference import TORCH_KERNELS

    calls = []

    class Planning(type(TORCH_KERNELS)):
        def plan_segment_len(self, *args, **kwargs):
            calls.append("plan")
            return 64

        def fwd_pool(self, *args, **kwargs):
            calls.append("fwd_pool")
            return super().fwd_pool(*args, **kwargs)

    kernels = Planning()
    monkeypatch.setattr(api, "_select_kernels", lambda q, v, backend, *others: (None, kernels))
    inputs, pool, idx, cu = make_batch(RAGGED, "cpu", torch.float32, 16,
                                       pool_dtype=torch.float32, v_first=True)
    o_ref, rows_ref = expected(inputs, pool, RAGGED, v_first=True)
    o, _ = run_pool(inputs, pool, idx, cu, output_final_state=True, state_v_first=True,
                    auto_cp=True, segment_shortcut_bound=0.0)
    assert calls == ["plan"]
    assert rel_l2(o, o_ref) < TOL[torch.float32]
    errs = written_errors(pool, rows_ref, RAGGED, True)
    assert max(errs.values()) < TOL[torch.float32], errs


@pytest.mark.parametrize("bound", [0.0, 2.0 ** -9], ids=["exact", "bounded"])
@pytest.mark.parametrize("device, dtype, K", targets(*ALL))
def test_explicit_split_on_a_pool(device, dtype, K, bound):
    """segment_len=64 with a pool: the split (exact or bounded) from the gathered rows,
    the final states scattered: fp64's values, unnamed and padding rows untouched."""
    inputs, pool, idx, cu = make_batch(RAGGED, device, dtype, K, pool_dtype=torch.bfloat16,
                                       v_first=False)
    before = pool.clone()
    o_ref, rows_ref = expected(inputs, pool, RAGGED, v_first=False)
    o, _ = run_pool(inputs, pool, idx, cu, output_final_state=True, segment_len=64,
                    segment_shortcut_bound=bound)
    assert rel_l2(o, o_ref) < TOL[dtype]
    errs = written_errors(pool, rows_ref, RAGGED, False)
    assert max(errs.values()) < TOL[dtype] + ROUNDING[torch.bfloat16], errs
    unnamed = sorted(set(range(RAGGED.pool_size)) - set(RAGGED.slots))
    assert torch.equal(pool[unnamed], before[unnamed])


@pytest.mark.gpu
def test_long_sequence_split_by_the_planner_on_a_pool():
    """One 8192-token sequence at 2/4 heads (the sm90 planner splits it) beside a short
    one, on a pool: fp64's values through the split's gather / scatter."""
    from flash_qla import api

    batch = Batch(lens=(8192, 100), slots=(2, 0), pool_size=3, Hk=2, Hv=4)
    inputs, pool, idx, cu = make_batch(batch, "cuda", torch.bfloat16, 128,
                                       pool_dtype=torch.float32, v_first=True)
    _, kernels = api._select_kernels(inputs["q"], inputs["v"], None)
    assert api._auto_segment_len(kernels, inputs["q"], inputs["v"], cu, cu.cpu(),
                                 True) is not None                # the planner splits it
    before = pool.clone()
    o_ref, rows_ref = expected(inputs, pool, batch, v_first=True)
    o, _ = run_pool(inputs, pool, idx, cu, output_final_state=True, state_v_first=True)
    assert rel_l2(o, o_ref) < TOL[torch.bfloat16]
    errs = written_errors(pool, rows_ref, batch, True)
    assert max(errs.values()) < TOL[torch.bfloat16], errs
    assert torch.equal(pool[1], before[1])


def test_backend_without_a_pool_forward_gathers_and_scatters(monkeypatch):
    """A backend without ``fwd_pool`` runs its plain forward between a gather and a
    scatter: the same pool afterwards as the torch backend's."""
    from flash_qla import api
    from flash_qla.reference import TORCH_KERNELS

    class NoPool:
        fwd = TORCH_KERNELS.fwd

    kwargs, reference = _cpu_case(), _cpu_case()
    with torch.inference_mode():
        o_ref, _ = flash_qla.chunk_gated_delta_rule(**reference)
        monkeypatch.setattr(api, "_select_kernels",
                            lambda q, v, backend, *others: (None, NoPool()))
        o, final = flash_qla.chunk_gated_delta_rule(**kwargs)
    assert final is kwargs["initial_state"]
    assert torch.equal(o, o_ref) and torch.equal(final, reference["initial_state"])


SCATTERS = {  # slots -> rows of the pool written (the others keep their values)
    "permuted": ((3, 0, 2), {3: 0, 0: 1, 2: 2}),
    "padding-rows": ((-1, 2, -1, 0), {2: 1, 0: 3}),
    "padding-first": ((-1, -1, 1), {1: 2}),
    "all-padding": ((-1, -1), {}),
}


@pytest.mark.parametrize("case", SCATTERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_writes_each_named_row_once(case, layout):
    """``scatter_states`` (the split's and the torch backend's write, device ops only):
    row ``s`` gets the final state of the sequence naming it, in the pool's dtype and
    layout; rows no sequence names keep their values, whatever the padding rows."""
    from flash_qla.state_pool import scatter_states

    slots, written = SCATTERS[case]
    v_first = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(5, 2, 4, 3, generator=gen).bfloat16()
    pool = pool.transpose(-1, -2).contiguous() if v_first else pool
    final = torch.randn(len(slots), 2, 4, 3, generator=gen)
    expect = pool.clone()
    for s, n in written.items():
        expect[s] = (final[n].transpose(-1, -2) if v_first else final[n]).bfloat16()
    scatter_states(pool, torch.tensor(slots), final, v_first=v_first)
    assert torch.equal(pool, expect)


def test_no_tokens_keep_every_row():
    """A call without tokens (T = 0, run by the torch backend on any device): each
    named row is written back as it was read, the pool bit for bit unchanged."""
    kwargs = _cpu_case()
    kwargs.update({n: kwargs[n].reshape(8, 16, *kwargs[n].shape[2:])[:, :0]
                   for n in ("q", "k", "v", "g", "beta")})
    kwargs["initial_state"] = kwargs["initial_state"].bfloat16()
    del kwargs["cu_seqlens"]
    before = kwargs["initial_state"].clone()
    with torch.inference_mode():
        o, final = flash_qla.chunk_gated_delta_rule(**kwargs)
    assert o.shape == (8, 0, 4, 16) and final is kwargs["initial_state"]
    assert torch.equal(final, before)
