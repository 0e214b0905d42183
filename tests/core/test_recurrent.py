"""``flash_qla.fused_recurrent_gated_delta_rule`` (decode / speculative verify, FLA's
signature, optional state pool updated in place) against the fp64 token-by-token
recurrence, and against the chunked prefill it continues. CPU: the torch backend;
marked ``gpu``: the sm90 kernel (``recurrent_step``) in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference import recurrent_gated_delta_rule
from tests.helpers import rel_l2

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _dims(device):
    """(K, V, dtype, tolerance): small fp32 on the CPU, the kernels' 128 / bf16 on a GPU."""
    return (16, 16, torch.float32, 1e-5) if device == "cpu" else (128, 128, torch.bfloat16, 5e-3)


def _inputs(device, B, T, Hk, Hv, N, seed=0):
    K, V, dtype, _ = _dims(device)
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, Hv, generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen))
    h0 = 0.1 * torch.randn(N, Hv, K, V, generator=gen)
    to = dict(device=device)
    return (q.to(dtype).to(**to), k.to(dtype).to(**to), v.to(dtype).to(**to), g.to(**to),
            beta.to(**to), h0.to(**to))


def _reference(q, k, v, g, beta, h0, cu=None):
    f64 = [x.double() for x in (q, k, v, g, beta)]
    return recurrent_gated_delta_rule(*f64, initial_state=h0.double(), cu_seqlens=cu,
                                      output_final_state=True)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_matches_recurrence(device):
    """One token per sequence, B = 6 sequences, GVA 2/4, with and without h0."""
    q, k, v, g, beta, h0 = _inputs(device, 6, 1, 2, 4, 6)
    tol = _dims(device)[3]
    o, ht = flash_qla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0,
                                                       output_final_state=True)
    o_ref, ht_ref = _reference(q, k, v, g, beta, h0)
    assert rel_l2(o, o_ref) < tol and rel_l2(ht, ht_ref) < tol
    o0, _ = flash_qla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta)
    assert rel_l2(o0, _reference(q, k, v, g, beta, torch.zeros_like(h0))[0]) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_verify_tokens_varlen_with_state_pool(device):
    """Speculative verify: 1, 3, 0 and 2 tokens of four sequences packed with padding;
    their states live in a pool of 9 slots at scattered indices, read and updated in
    place; the other slots stay untouched, padding outputs are zero."""
    q, k, v, g, beta, _ = _inputs(device, 1, 8, 1, 2, 4, seed=1)
    K, V = q.shape[-1], v.shape[-1]
    cu = torch.tensor([0, 1, 4, 4, 6], device=device)
    slots = torch.tensor([7, 0, 3, 5], device=device)
    gen = torch.Generator().manual_seed(2)
    pool = (0.1 * torch.randn(9, 2, K, V, generator=gen)).to(device)
    before = pool.clone()
    o, out = flash_qla.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, initial_state=pool, cu_seqlens=cu, state_indices=slots)
    assert out is pool
    o_ref, ht_ref = _reference(q, k, v, g, beta, before[slots.long()], cu)
    tol = _dims(device)[3]
    assert rel_l2(o, o_ref) < tol
    assert rel_l2(pool[slots.long()], ht_ref) < tol
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])
    assert torch.equal(o[:, 6:], torch.zeros_like(o[:, 6:]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_pool_in_each_dtype_and_layout(device, pool_dtype, v_first):
    """The pool an engine's prefill takes (``chunk_gated_delta_rule(..., state_indices=)``:
    fp32 / bf16 / fp16, [P, Hv, K, V] or v-first [P, Hv, V, K]) is the pool decode reads
    and updates in place: rows read in fp32, final states written back rounded to the
    pool's dtype, in its layout; beta in q's dtype (read as given); two tokens per
    sequence with padding after the last one (zeros in o)."""
    q, k, v, g, beta, _ = _inputs(device, 1, 7, 1, 2, 3, seed=5)
    beta = beta.to(q.dtype)
    K, V = q.shape[-1], v.shape[-1]
    cu = torch.tensor([0, 2, 4, 6], device=device)
    slots = torch.tensor([4, 1, -1], device=device)
    gen = torch.Generator().manual_seed(6)
    rows = 0.1 * torch.randn(5, 2, K, V, generator=gen)
    pool = (rows.transpose(-1, -2) if v_first else rows).contiguous().to(device, pool_dtype)
    before = pool.clone()
    o, out = flash_qla.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, initial_state=pool, cu_seqlens=cu, state_indices=slots,
        state_v_first=v_first)
    assert out is pool
    canon = (before.transpose(-1, -2) if v_first else before).float()   # [P, Hv, K, V]
    start = torch.stack([canon[4], canon[1], torch.zeros_like(canon[0])])
    o_ref, ht_ref = _reference(q, k, v, g, beta, start, cu)
    after = (pool.transpose(-1, -2) if v_first else pool).float()
    tol = max(_dims(device)[3], 4e-3 if pool_dtype != torch.float32 else 0)
    assert rel_l2(o[:, :6], o_ref[:, :6]) < tol
    assert rel_l2(after[[4, 1]], ht_ref[:2]) < tol
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])
    assert torch.equal(o[:, 6:], torch.zeros_like(o[:, 6:]))


@pytest.mark.parametrize("device", DEVICES)
def test_negative_slot_is_a_padding_row(device):
    """As in the prefill on a pool: a sequence whose slot is negative starts from zeros
    and writes no pool row (in particular not row P - 1, which a Python-style negative
    index would hit); the named rows are read and updated as usual."""
    q, k, v, g, beta, _ = _inputs(device, 3, 1, 2, 4, 3, seed=3)
    K, V = q.shape[-1], v.shape[-1]
    gen = torch.Generator().manual_seed(4)
    pool = (0.1 * torch.randn(4, 4, K, V, generator=gen)).to(device)
    before = pool.clone()
    slots = torch.tensor([2, -1, 0], device=device, dtype=torch.int32)
    o, _ = flash_qla.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, initial_state=pool, state_indices=slots)
    start = torch.stack([before[2], torch.zeros_like(before[0]), before[0]])
    o_ref, ht_ref = _reference(q, k, v, g, beta, start)
    tol = _dims(device)[3]
    assert rel_l2(o, o_ref) < tol
    assert rel_l2(pool[[2, 0]], ht_ref[[0, 2]]) < tol
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_continues_the_chunked_prefill(device):
    """Prefill T - 2 tokens with chunk_gated_delta_rule, then decode the last two one by
    one from its final state (v-first, as engines keep it): the same outputs and final
    state as the chunked call over all T tokens."""
    q, k, v, g, beta, h0 = _inputs(device, 2, 70, 1, 2, 2, seed=3)
    tol = 3 * _dims(device)[3]
    v_first = h0.transpose(-1, -2).contiguous()
    o_all, ht_all = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=v_first,
                                                     output_final_state=True,
                                                     state_v_first=True)
    _, state = flash_qla.chunk_gated_delta_rule(
        q[:, :68], k[:, :68], v[:, :68], g[:, :68], beta[:, :68], initial_state=v_first,
        output_final_state=True, state_v_first=True)
    outs = []
    for t in (68, 69):
        o_t, state = flash_qla.fused_recurrent_gated_delta_rule(
            q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
            beta=beta[:, t:t + 1], initial_state=state, output_final_state=True,
            state_v_first=True)
        outs.append(o_t)
    assert rel_l2(torch.cat(outs, 1), o_all[:, 68:]) < tol
    assert rel_l2(state, ht_all) < tol


def test_fla_only_options_raise_naming_them():
    q, k, v, g, beta, h0 = _inputs("cpu", 1, 2, 1, 1, 1)
    with pytest.raises(NotImplementedError, match="gk"):
        flash_qla.fused_recurrent_gated_delta_rule(q, k, v, gk=g)
    with pytest.raises(NotImplementedError, match="allow_neg_eigval"):
        flash_qla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, allow_neg_eigval=True)
    with pytest.raises(NotImplementedError, match="train with"):
        flash_qla.fused_recurrent_gated_delta_rule(q.requires_grad_(), k, v, g, beta=beta)
    q = q.detach()
    with pytest.raises(ValueError, match=r"state_indices must be \[N\]"):
        flash_qla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0,
                                                   state_indices=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="state pool"):
        flash_qla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta,
                                                   initial_state=h0.double(),
                                                   state_indices=torch.tensor([0]))


def test_defaults_no_gate_unit_beta_and_sigmoid_beta():
    """g None: no decay; beta None: ones; use_beta_sigmoid_in_kernel: beta are logits."""
    q, k, v, g, beta, h0 = _inputs("cpu", 1, 5, 1, 1, 1, seed=4)
    o, _ = flash_qla.fused_recurrent_gated_delta_rule(q, k, v)
    ref, _ = _reference(q, k, v, torch.zeros_like(g), torch.ones_like(beta), 0 * h0)
    assert rel_l2(o, ref) < 1e-5
    logits = torch.logit(beta)
    o, _ = flash_qla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=logits,
                                                      use_beta_sigmoid_in_kernel=True)
    assert rel_l2(o, _reference(q, k, v, g, beta, 0 * h0)[0]) < 1e-5
