"""flash_qla.offsets: one host read per cu_seqlens tensor, and the API planning the
device-offsets call (FLA's convention) exactly as the call given ``cu_seqlens_cpu``.

The read itself (``_copy_to_host``) is replaced by a counting copy, so the cache rules
are checked on the CPU: a device tensor behaves the same apart from where it lives."""

from __future__ import annotations

import pytest
import torch

import flash_qla
from flash_qla import api, offsets


@pytest.fixture
def reads(monkeypatch):
    """Every host copy ``_kept_copy`` makes, in order; the cache starts empty."""
    made = []
    offsets.clear_cache()
    monkeypatch.setattr(offsets, "_copy_to_host", lambda t: (made.append(t), t.clone())[1])
    yield made
    offsets.clear_cache()


def test_same_tensor_is_read_once(reads):
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    first = offsets._kept_copy(cu)
    again = offsets._kept_copy(cu)
    assert again is first and len(reads) == 1
    assert first.tolist() == [0, 5, 5, 12] and first.dtype == torch.int32


def test_in_place_edit_is_read_again(reads):
    cu = torch.tensor([0, 5, 12])
    offsets._kept_copy(cu)
    cu[1] = 7                                         # bumps the version counter
    assert offsets._kept_copy(cu).tolist() == [0, 7, 12]
    assert len(reads) == 2


def test_equal_values_in_another_tensor_are_read_again(reads):
    offsets._kept_copy(torch.tensor([0, 5, 12]))
    offsets._kept_copy(torch.tensor([0, 5, 12]))
    assert len(reads) == 2


def test_inference_tensors_are_never_kept(reads):
    with torch.inference_mode():
        cu = torch.tensor([0, 5, 12])
    offsets._kept_copy(cu)
    offsets._kept_copy(cu)
    assert len(reads) == 2                            # no version counter: no cache


def test_cache_is_bounded(reads):
    kept = [torch.tensor([0, i]) for i in range(offsets.CACHE_SIZE + 3)]
    for cu in kept:
        offsets._kept_copy(cu)
    assert len(offsets._copies) == offsets.CACHE_SIZE
    offsets._kept_copy(kept[0])                       # the oldest was dropped
    assert len(reads) == len(kept) + 1


def test_host_offsets_passes_given_and_dense_through():
    cpu = torch.tensor([0, 3])
    assert offsets.host_offsets(torch.tensor([0, 3]), cpu) is cpu
    assert offsets.host_offsets(None, None) is None
    host = torch.tensor([0, 4, 9])
    assert offsets.host_offsets(host, None) is host   # already on the host


def _inputs(T=150, Hk=1, Hv=2, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, Hk, D, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, Hv, D, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen) + 3)
    beta = torch.rand(1, T, Hv, generator=gen)
    return q, k, v, g, beta


def test_api_resolves_device_offsets_once_per_step(monkeypatch):
    """The public call without ``cu_seqlens_cpu`` hands its backend the host offsets it
    read (the same object in the forward and the backward), planned and validated from
    them; a second layer with the same offsets tensor reads nothing."""
    seen, reads = [], []
    real_resolve = offsets.host_offsets
    monkeypatch.setattr(offsets, "host_offsets",
                        lambda cu, cpu: (reads.append(cu), real_resolve(cu, cpu))[1])
    real_auto = api._auto_segment_len

    def spy(kernels, q, v, cu_seqlens, cu_seqlens_cpu, bounded):
        seen.append(cu_seqlens_cpu)
        return real_auto(kernels, q, v, cu_seqlens, cu_seqlens_cpu, bounded)

    monkeypatch.setattr(api, "_auto_segment_len", spy)
    cu = torch.tensor([0, 60, 60, 150])
    q, k, v, g, beta = (x.requires_grad_() for x in _inputs())
    o, _ = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="torch")
    o.sum().backward()
    assert len(reads) == 1 and seen[0].tolist() == [0, 60, 60, 150]
    with_cpu, _ = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                                   cu_seqlens_cpu=cu.clone(), backend="torch")
    assert torch.equal(o, with_cpu)
    assert len(reads) == 1                            # given cu_seqlens_cpu: no read


def test_api_names_cu_seqlens_in_value_errors():
    """A bad device-style ``cu_seqlens`` is reported under its own name, not as the
    host copy the call made of it."""
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 90, 60]),
                                         backend="torch")
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must start at 0"):
        flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([1, 90]),
                                         cu_seqlens_cpu=torch.tensor([1, 90]), backend="torch")


def test_kept_offsets_never_reads(reads):
    """kept_offsets answers from the cache only: the copy of this very, unmodified tensor
    or None (what a capture may use to plan)."""
    cu = torch.tensor([0, 5, 12])
    assert offsets.kept_offsets(cu) is cu                 # a host tensor is its own copy
    fake_device = torch.tensor([0, 5, 12])
    assert offsets._copies.get(id(fake_device)) is None
    copy = offsets._kept_copy(fake_device)
    assert offsets._copies[id(fake_device)][3] is copy and len(reads) == 1
    fake_device[0] = 0                                    # in place: version bumped
    assert offsets._copies[id(fake_device)][1] != offsets.version_of(fake_device)


def test_api_kept_plan_never_hides_an_error():
    """A repeated call reuses its checked plan (``api._CALLS``), but an option of another
    type, offsets rewritten in place, or other shapes are checked again, with the same
    errors, and plan with the new offsets."""
    q, k, v, g, beta = _inputs()
    cu = torch.tensor([0, 60, 150])

    def run(q=q, k=k, v=v, g=g, beta=beta, cu=cu, final=True):
        return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                                output_final_state=final, backend="torch")

    run()
    kept = len(api._CALLS)
    run()
    assert len(api._CALLS) == kept                         # the same signature: kept
    with pytest.raises(TypeError, match=r"output_final_state: expected a bool"):
        run(final=1)                                       # 1 == True, but not a bool
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be at most T=120"):
        run(*(x[:, :120] for x in (q, k, v, g, beta)))
    cu[1] = 200                                            # in place: checked again
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        run()
    cu[1] = 90
    o, final_state = run()
    fresh_o, fresh_final = run(cu=torch.tensor([0, 90, 150]))
    assert torch.equal(o, fresh_o) and torch.equal(final_state, fresh_final)


def test_dispatch_clear_cache_forgets_every_kept_plan():
    """``flash_qla.dispatch.clear_cache`` (backends re-discovered, kernels reloaded)
    leaves no call plan holding a kernel of before: every :class:`offsets.KeptPlans`
    is emptied, the API's and any other."""
    from flash_qla import dispatch

    q, k, v, g, beta = _inputs()
    flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 60, 150]),
                                     backend="torch")
    other = offsets.KeptPlans(4)
    other.keep(("signature",), (), "plan")
    assert len(api._CALLS) > 0 and len(other) == 1
    dispatch.clear_cache()
    assert len(api._CALLS) == 0 and len(other) == 0
