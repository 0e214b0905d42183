"""Call sites of code written for FlashQLA 0.1.3 (the earlier ``flash-qla``), run on ours.

(a) SGLang's prefill call, (b) a Megatron-style patch of the module function in a
training step, (c) the ``flash_qla.utils`` names FlashQLA 0.1.3 exported, (d) every
FlashQLA 0.1.3 name deliberately not provided, plus the initial-state dtypes both
callers pass (bf16 / fp16, computed in fp32). The oracle is the fp64 token-by-token
recurrence (``flash_qla.reference``) through the helpers of ``tests/core/test_api.py``;
errors are relative L2 (``tests.helpers.rel_l2``: NaN never passes).

(a) and (b) run on the CPU (``torch`` backend) and, marked ``gpu``, the same checks on
CUDA in bf16 (K = V = 128, the Hopper kernels' head dims).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla import utils
from flash_qla.utils import (  # FlashQLA 0.1.3's flash_qla.utils.__all__, as its callers import
    fill_last_chunk_of_g,
    input_guard,
    l2norm,
    l2norm_bwd,
    l2norm_fwd,
    pack,
    pad_and_reshape,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    tensor_cache,
    unpack,
)
from tests.core.test_api import (
    FP64_TOL,
    Config,
    cu_tensor,
    errors,
    grads,
    l2_by_definition,
    make_inputs,
    oracle,
    too_large,
)
from tests.helpers import rel_l2

#: FlashQLA 0.1.3's ``flash_qla.utils.__all__``.
FLASHQLA_013_UTILS = (
    "pad_and_reshape", "pack", "unpack", "fill_last_chunk_of_g", "l2norm", "l2norm_fwd",
    "l2norm_bwd", "prepare_chunk_indices", "prepare_chunk_offsets", "tensor_cache",
    "input_guard",
)

#: Relative L2 tolerance vs fp64 of outputs and gradients, by q/k/v dtype (bf16: the
#: Hopper suite's 1e-2 / 2e-2 for beta and g, taken as one bound).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

#: id -> (device, q/k/v dtype); the CUDA one needs a GPU (marker ``gpu``).
TARGETS = {
    "cpu-fp32": ("cpu", torch.float32),
    "cpu-bf16": ("cpu", torch.bfloat16),
    "cuda-bf16": ("cuda", torch.bfloat16),
}


def targets(*names: str) -> list:
    return [pytest.param(*TARGETS[n], id=n,
                         marks=[pytest.mark.gpu] if TARGETS[n][0] == "cuda" else [])
            for n in names]


def on(device: str, inputs: dict) -> dict:
    """Leaf copies of ``inputs`` on ``device`` (same values and dtypes)."""
    return {n: x.detach().to(device).requires_grad_(x.requires_grad) for n, x in inputs.items()}


# --------------------------------------------------------------------------------------
# (a) SGLang prefill: states gathered from a pool by index in q's dtype, v-first,
#     int64 cu_seqlens, inference mode, the final state scattered back
# --------------------------------------------------------------------------------------

#: packed batch: an empty sequence and odd lengths; K = V = 128, GVA 2/4
SGLANG = Config(B=1, T=229, Hk=2, Hv=4, K=128, V=128, cu_seqlens=(0, 37, 37, 100, 229))
POOL_SIZE = 8
CACHE_INDICES = (5, 0, 3, 7)          # pool slot of each sequence (slot 0: the empty one)


def sglang_prefill(ssm_states, cache_indices, q, k, v, g, beta, query_start_loc):
    """SGLang's call site (its GDN prefill), verbatim in what it passes."""
    with torch.inference_mode():
        core_attn_out, final_state = flash_qla.chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta,
            initial_state=ssm_states[cache_indices].to(q.dtype),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=query_start_loc.long(), state_v_first=True)
        ssm_states[cache_indices] = final_state.to(ssm_states.dtype)
    return core_attn_out, final_state


@pytest.mark.parametrize("device, dtype", targets("cpu-bf16", "cuda-bf16"))
def test_sglang_prefill(device, dtype):
    inputs = make_inputs(SGLANG, dtype, torch.float32, dtype, v_first=True)
    del inputs["initial_state"]
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(POOL_SIZE, SGLANG.Hv, SGLANG.V, SGLANG.K, generator=gen)  # fp32
    before = pool.clone()
    idx = torch.tensor(CACHE_INDICES)
    query_start_loc = torch.tensor(SGLANG.cu_seqlens, dtype=torch.int32)
    dev = {n: x.detach().to(device) for n, x in inputs.items()}      # serving: no grad
    pool_dev = pool.to(device)
    o, final_state = sglang_prefill(pool_dev, idx.to(device), **dev,
                                    query_start_loc=query_start_loc.to(device))

    # the oracle reads the state SGLang handed over: the pool rows rounded to q's dtype
    ref_inputs = {**inputs, "initial_state": before[idx].to(dtype)}
    ref_o, ref_final = oracle(ref_inputs, SGLANG, l2norm=True, v_first=True)
    assert (o.dtype, final_state.dtype) == (dtype, torch.float32)
    assert final_state.shape == (len(CACHE_INDICES), SGLANG.Hv, SGLANG.V, SGLANG.K)
    assert too_large(errors({"o": o, "pool": pool_dev[idx]},
                            {"o": ref_o, "pool": ref_final}), TOL[dtype]) == {}
    untouched = [i for i in range(POOL_SIZE) if i not in CACHE_INDICES]
    assert torch.equal(pool_dev[untouched].cpu(), before[untouched])
    # the empty sequence: its state passes through, only rounded to q's dtype on the way in
    assert torch.equal(pool_dev[CACHE_INDICES[1]].cpu(),
                       before[CACHE_INDICES[1]].to(dtype).float())


# --------------------------------------------------------------------------------------
# (b) Megatron-style training patch: the module-level function replaced by ours
# --------------------------------------------------------------------------------------

def _fla_not_installed(*args, **kwargs):
    raise ImportError("FLA is not installed")


#: Stands for megatron.core.ssm.gated_delta_net, which binds FLA's functions at import
#: (``from fla.ops.gated_delta_rule import chunk_gated_delta_rule``).
gated_delta_net = types.ModuleType("gated_delta_net")
gated_delta_net.chunk_gated_delta_rule = _fla_not_installed
gated_delta_net.l2norm = _fla_not_installed


def megatron_core_attention(q, k, v, g, beta, initial_state, num_value_heads):
    """Megatron's GatedDeltaNet.forward around the kernel call: L2-norm q/k outside the
    kernel, repeat q/k heads to the value heads, call the module-level function."""
    query = gated_delta_net.l2norm(q.contiguous())
    key = gated_delta_net.l2norm(k.contiguous())
    value = v
    groups = num_value_heads // query.shape[2]
    if groups > 1:
        query = query.repeat_interleave(groups, dim=2)
        key = key.repeat_interleave(groups, dim=2)
    return gated_delta_net.chunk_gated_delta_rule(
        query.contiguous(), key.contiguous(), value.contiguous(), g=g, beta=beta,
        initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=False)


#: dense batch (Megatron's layout), odd T over three chunks, GVA 2/4, K = V = 128
MEGATRON = Config(B=2, T=150, Hk=2, Hv=4, K=128, V=128)


@pytest.mark.parametrize("device, dtype", targets("cpu-fp32", "cpu-bf16", "cuda-bf16"))
def test_megatron_patch_gradients(monkeypatch, device, dtype):
    """Training step through the patched module (initial state in the inputs' dtype:
    bf16 states get their gradient back in bf16) against autograd through fp64."""
    monkeypatch.setattr(gated_delta_net, "chunk_gated_delta_rule",
                        flash_qla.chunk_gated_delta_rule)
    monkeypatch.setattr(gated_delta_net, "l2norm", l2norm)
    inputs = make_inputs(MEGATRON, dtype, torch.float32, dtype)
    inputs["initial_state"] = inputs["initial_state"].detach().to(dtype).requires_grad_()
    dev = on(device, inputs)
    out = megatron_core_attention(**dev, num_value_heads=MEGATRON.Hv)
    ref = oracle(inputs, MEGATRON, l2norm=True)
    actual = {"o": out[0], "final_state": out[1], **grads(out, dev)}
    expected = {"o": ref[0], "final_state": ref[1], **grads(ref, inputs)}
    assert {n: actual[n].dtype for n in dev} == {n: x.dtype for n, x in dev.items()}
    assert too_large(errors(actual, expected), TOL[dtype]) == {}


# --------------------------------------------------------------------------------------
# Initial states in bf16 / fp16: converted to fp32, the recurrence in fp32
# --------------------------------------------------------------------------------------

SMALL = Config(B=1, T=150, Hk=1, Hv=2, K=16, V=8, cu_seqlens=(0, 0, 70, 71, 140))

# id -> (q/k/v dtype, initial-state dtype)
STATE_DTYPES = {
    "bf16-q-bf16-state": (torch.bfloat16, torch.bfloat16),
    "bf16-q-fp16-state": (torch.bfloat16, torch.float16),
    "fp16-q-fp16-state": (torch.float16, torch.float16),
    "fp32-q-bf16-state": (torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("dtypes", list(STATE_DTYPES))
def test_low_precision_initial_state_is_computed_in_fp32(dtypes, v_first):
    """The same outputs, bit for bit, as with the state converted to fp32 by the caller;
    the final state fp32; dh0 in the state's own dtype (the fp32 gradient, rounded)."""
    dtype, state_dtype = STATE_DTYPES[dtypes]
    inputs = make_inputs(SMALL, dtype, torch.float32, dtype, v_first=v_first)
    low = {**inputs, "initial_state": inputs["initial_state"].detach().to(state_dtype)
           .requires_grad_()}
    wide = {**inputs, "initial_state": low["initial_state"].detach().float().requires_grad_()}
    kwargs = dict(cu_seqlens=cu_tensor(SMALL), output_final_state=True, state_v_first=v_first)
    out_low = flash_qla.chunk_gated_delta_rule(**low, **kwargs)
    out_wide = flash_qla.chunk_gated_delta_rule(**wide, **kwargs)
    assert out_low[1].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(out_low, out_wide))
    (dh0_low,) = torch.autograd.grad(out_low[0].float().sum() + out_low[1].sum(),
                                     [low["initial_state"]])
    (dh0_wide,) = torch.autograd.grad(out_wide[0].float().sum() + out_wide[1].sum(),
                                      [wide["initial_state"]])
    assert dh0_low.dtype == state_dtype
    assert torch.equal(dh0_low, dh0_wide.to(state_dtype))


def test_low_level_pair_takes_a_bf16_initial_state():
    """Forward as with the fp32 state; the backward's dh0 stays fp32 (as FlashQLA's)."""
    inputs = {n: x.detach() for n, x in make_inputs(SMALL, torch.float32).items()}
    h0_bf16 = inputs["initial_state"].bfloat16()
    cu = cu_tensor(SMALL)
    low = flash_qla.chunk_gated_delta_rule_fwd(**{**inputs, "initial_state": h0_bf16},
                                               cu_seqlens=cu)
    wide = flash_qla.chunk_gated_delta_rule_fwd(**{**inputs, "initial_state": h0_bf16.float()},
                                                cu_seqlens=cu)
    assert all(torch.equal(a, b) for a, b in zip(low, wide) if a is not None)
    g_cumsum, A, o, _, _ = low
    dh0 = flash_qla.chunk_gated_delta_rule_bwd(
        inputs["q"], inputs["k"], inputs["v"], g_cumsum, inputs["beta"], A,
        torch.ones_like(o), initial_state=h0_bf16, cu_seqlens=cu)[5]
    assert dh0.dtype == torch.float32 and dh0.shape == h0_bf16.shape


# --------------------------------------------------------------------------------------
# (c) flash_qla.utils: FlashQLA 0.1.3's names, one behaviour check each
# --------------------------------------------------------------------------------------

def test_every_flashqla_utils_name_is_provided():
    assert set(FLASHQLA_013_UTILS) <= set(utils.__all__)


def test_l2norm_matches_definition_and_gradient():
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(3, 5, 2, 16, generator=gen, dtype=torch.float64)
    x = x64.bfloat16().requires_grad_()
    y = l2norm(x)
    ref_x = x.detach().double().requires_grad_()
    ref_y = l2_by_definition(ref_x)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, [x], dy.bfloat16())
    (ref_dx,) = torch.autograd.grad(ref_y, [ref_x], dy)
    assert (y.dtype, y.shape, dx.dtype) == (torch.bfloat16, x.shape, torch.bfloat16)
    assert rel_l2(y, ref_y) < 1e-2 and rel_l2(dx, ref_dx) < 2e-2


def test_l2norm_fwd_bwd_pair():
    """(y, rstd) with rstd over all dims but the last, fp32; l2norm_bwd gives autograd's
    gradient of the definition (fp32 out, as FlashQLA 0.1.3, also for bf16 inputs)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, generator=gen, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y, rstd = l2norm_fwd(x, eps=1e-6)
    ref_x = x.clone().requires_grad_()
    (ref_dx,) = torch.autograd.grad(l2_by_definition(ref_x), [ref_x], dy)
    assert rstd.shape == (4, 3)
    assert rel_l2(rstd, 1 / torch.sqrt(x.square().sum(-1) + 1e-6)) < FP64_TOL
    assert rel_l2(l2norm_bwd(y, rstd, dy), ref_dx) < FP64_TOL
    y16, rstd16 = l2norm_fwd(x.bfloat16())
    dx16 = l2norm_bwd(y16, rstd16, dy.bfloat16())
    assert (y16.dtype, rstd16.dtype, dx16.dtype) == (torch.bfloat16, torch.float32,
                                                     torch.float32)
    assert rel_l2(dx16, ref_dx) < 2e-2


def test_pack_and_unpack_are_inverse():
    """FlashQLA's test pattern: random lengths, padded rows packed; unpack gives the rows
    back zero-padded and drops tokens after the last sequence."""
    lens = [5, 1, 0, 9]
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0))                   # [0, 5, 6, 6, 15]
    x = torch.randn(len(lens), 9, 3, requires_grad=True)                # [N, L, H]
    packed = pack(x, cu)
    expected = torch.cat([x[n, :length] for n, length in enumerate(lens)])[None]
    assert packed.shape == (1, 15, 3) and torch.equal(packed, expected)
    with_padding = torch.cat([packed.detach(), torch.randn(1, 4, 3)], dim=1)
    back = unpack(with_padding, cu)
    keep = (torch.arange(9)[None, :] < torch.tensor(lens)[:, None])[..., None]  # [N, L, 1]
    assert back.shape == (4, 9, 3) and torch.equal(back, torch.where(keep, x.detach(), 0))
    (dx,) = torch.autograd.grad(packed.sum(), [x])
    assert torch.equal(dx, keep.expand_as(x).float())


def test_pad_and_reshape():
    x = torch.arange(2 * 5 * 3).reshape(2, 5, 3)
    chunks = pad_and_reshape(x, dim=1, chunk_size=2)                    # [2, 3, 2, 3]
    assert chunks.shape == (2, 3, 2, 3)
    assert torch.equal(chunks.reshape(2, 6, 3)[:, :5], x)
    assert not chunks[:, 2, 1].any()                                    # the zero padding
    assert torch.equal(pad_and_reshape(x, dim=-1, chunk_size=2),
                       pad_and_reshape(x, dim=2, chunk_size=2))


@pytest.mark.parametrize("reverse", [False, True], ids=["fill", "reverse"])
def test_fill_last_chunk_of_g(reverse):
    """Packed lengths 3 and 4 in chunks of 4: only the first sequence's chunk is partial."""
    g = torch.arange(1.0, 9.0).reshape(2, 1, 4)                         # [N, NC, C]
    out = fill_last_chunk_of_g(g.clone(), 0, torch.tensor([0, 3, 7]), chunk_size=4,
                               reverse=reverse)
    first = [1.0, 2.0, 7.0, 4.0] if reverse else [1.0, 2.0, 3.0, 3.0]
    assert out.tolist() == [[first], [[5.0, 6.0, 7.0, 8.0]]]
    dense = fill_last_chunk_of_g(torch.arange(1.0, 9.0).reshape(1, 2, 4), 6, None, 4,
                                 reverse=reverse)
    assert dense[0, 1].tolist() == ([5.0, 14.0, 7.0, 8.0] if reverse else [5.0, 6.0, 6.0, 6.0])


def test_flashqla_reference_pipeline_gives_our_gate_cumsum():
    """FlashQLA 0.1.3's reference builds the chunk-local gate cumsum with unpack ->
    pad_and_reshape -> cumsum -> pack; it equals our forward's g_cumsum, and the chunk
    states unpacked by prepare_chunk_offsets start from each sequence's initial state."""
    cfg = Config(B=1, T=150, Hk=1, Hv=2, K=16, V=8, cu_seqlens=(0, 0, 70, 71, 140))
    inputs = {n: x.detach() for n, x in make_inputs(cfg).items()}
    cu = torch.tensor(cfg.cu_seqlens)
    g_cumsum, _, _, h, _ = flash_qla.chunk_gated_delta_rule_fwd(**inputs, cu_seqlens=cu,
                                                                output_h=True)
    g = pad_and_reshape(unpack(inputs["g"], cu), dim=1, chunk_size=64)  # [N, NC, C, Hv]
    ours = pack(g.cumsum(2).flatten(1, 2), cu)                          # [1, 140, Hv]
    assert rel_l2(ours, g_cumsum[:, :140]) < FP64_TOL
    offsets, total = prepare_chunk_offsets(cu, 64)
    starts = unpack(h, offsets)[:, 0]                                   # [N, Hv, K, V]
    nonempty = [1, 2, 3]
    assert h.shape[1] == total
    assert torch.equal(starts[nonempty], inputs["initial_state"][nonempty])
    assert prepare_chunk_indices(cu, 64).tolist() == [[1, 0], [1, 1], [2, 0], [3, 0], [3, 1]]


def test_tensor_cache_and_input_guard():
    calls = []

    @tensor_cache
    @input_guard
    def strides(x):
        calls.append(1)
        return x.stride()

    x = torch.zeros(3, 4).t()                                           # not contiguous
    assert strides(x) == (3, 1) and strides(x) == (3, 1)
    assert len(calls) == 1


# --------------------------------------------------------------------------------------
# (d) FlashQLA 0.1.3 names not provided: an ImportError naming the replacement
# --------------------------------------------------------------------------------------

# (module, name) -> regex the message must match (it names the replacement)
NOT_PROVIDED = {
    ("flash_qla.utils", "prepare_varlen_metadata"): r"cu_seqlens_cpu=cu_seqlens_cpu",
    ("flash_qla.utils", "L2NormFunction"): r"use flash_qla\.utils\.l2norm\(x, eps\)",
    ("flash_qla.utils", "l2norm_fwd_compiled"): r"use flash_qla\.utils\.l2norm_fwd\(",
    ("flash_qla.utils", "l2norm_bwd_compiled"): r"use flash_qla\.utils\.l2norm_bwd\(",
    ("flash_qla.utils", "index"): r"import the names from flash_qla\.utils directly",
    ("flash_qla.utils", "math"): r"import the names from flash_qla\.utils directly",
    ("flash_qla.utils", "contiguous"): r"import the names from flash_qla\.utils directly",
    ("flash_qla", "ops"): r"import chunk_gated_delta_rule, .* from flash_qla itself",
}


def test_not_provided_table_is_complete():
    declared = {("flash_qla.utils", n) for n in utils.NOT_PROVIDED}
    declared |= {("flash_qla", n) for n in flash_qla.NOT_PROVIDED}
    assert declared == set(NOT_PROVIDED)


@pytest.mark.parametrize("module, name", list(NOT_PROVIDED),
                         ids=[f"{m}.{n}" for m, n in NOT_PROVIDED])
def test_not_provided_names_raise_naming_the_replacement(module, name):
    match = NOT_PROVIDED[(module, name)]
    with pytest.raises(ImportError, match=match):
        exec(f"from {module} import {name}", {})
    with pytest.raises(ImportError, match=match):
        getattr(utils if module == "flash_qla.utils" else flash_qla, name)


def test_unknown_names_stay_attribute_errors():
    assert not hasattr(utils, "no_such_helper") and not hasattr(flash_qla, "no_such_function")


def test_flashqla_positional_low_level_calls():
    """FlashQLA 0.1.3's test suite calls the pair positionally up to auto_cp /
    state_v_first: accepted (auto_cp changes nothing); the forward returns five values
    (FlashQLA's sixth, cp_cache, does not exist here)."""
    inputs = {n: x.detach() for n, x in make_inputs(SMALL).items()}
    q, k, v, g, beta, h0 = (inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    cu = cu_tensor(SMALL)
    result = flash_qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, h0, cu,
                                                  True, False, True, False)
    assert len(result) == 5
    g_cumsum, A, o, _, ht = result
    do, dht = torch.ones_like(o), torch.ones_like(ht)
    positional = flash_qla.chunk_gated_delta_rule_bwd(q, k, v, g_cumsum, beta, A, do, dht,
                                                      None, h0, cu, False, True)
    keywords = flash_qla.chunk_gated_delta_rule_bwd(q, k, v, g_cumsum, beta, A, do, dht,
                                                    initial_state=h0, cu_seqlens=cu)
    assert all(torch.equal(a, b) for a, b in zip(positional, keywords))


LOW_LEVEL_REJECTED = [
    pytest.param("fwd", {"state_v_first": True}, r"state_v_first=True .*transpose",
                 id="fwd-state_v_first"),
    pytest.param("fwd", {"enable_fwd_cp_cache": True}, r"enable_fwd_cp_cache=True",
                 id="fwd-enable_fwd_cp_cache"),
    pytest.param("fwd", {"cp_context": object()}, r"cp_context", id="fwd-cp_context"),
    pytest.param("bwd", {"state_v_first": True}, r"state_v_first=True .*transpose",
                 id="bwd-state_v_first"),
    pytest.param("bwd", {"cp_cache": object()}, r"cp_cache .*returns none",
                 id="bwd-cp_cache"),
]


@pytest.mark.parametrize("which, kwargs, match", LOW_LEVEL_REJECTED)
def test_flashqla_low_level_options_not_built_raise(which, kwargs, match):
    inputs = {n: x.detach() for n, x in make_inputs(SMALL).items()}
    cu = cu_tensor(SMALL)
    with pytest.raises(NotImplementedError, match=match):
        if which == "fwd":
            flash_qla.chunk_gated_delta_rule_fwd(**inputs, cu_seqlens=cu, **kwargs)
        else:
            g_cumsum, A, o, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**inputs, cu_seqlens=cu)
            flash_qla.chunk_gated_delta_rule_bwd(
                inputs["q"], inputs["k"], inputs["v"], g_cumsum, inputs["beta"], A,
                torch.ones_like(o), initial_state=inputs["initial_state"], cu_seqlens=cu,
                **kwargs)
