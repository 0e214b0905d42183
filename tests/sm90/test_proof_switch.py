"""The proof switch (CPU): ``FLASH_QLA_PROOF_ARCH=sm100|sm120`` makes the sm90 loader
build a Blackwell arch's portable kernels for sm_90a with WGMMA off, and ``python -m
flash_qla info`` says so; an arch that builds decode only refuses the chunked prefill,
and SM120, which builds no backward, refuses training, naming the GPU and the
alternative."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from flash_qla_sm90 import arch as sm90_arch
from flash_qla_sm100.arch import SM100
from flash_qla_sm120.arch import SM120
from flash_qla_tl.arch import DISABLE_WGMMA, proof


def test_without_the_variable_the_loader_serves_sm90(monkeypatch):
    monkeypatch.delenv(sm90_arch.PROOF_ENV, raising=False)
    assert sm90_arch.served_arch() is sm90_arch.SM90


@pytest.mark.parametrize("name, arch", [("sm100", SM100), ("sm120", SM120)])
def test_the_variable_serves_the_proof_twin(monkeypatch, name, arch):
    monkeypatch.setenv(sm90_arch.PROOF_ENV, name)
    served = sm90_arch.served_arch()
    assert served == proof(arch)
    assert (served.target, served.mma) == ("sm_90a", "mma_sync")
    assert dict(served.pass_configs)[DISABLE_WGMMA] is True
    # the kernels' traits stay the Blackwell arch's
    assert (served.smem_limit, served.slots, served.reg_budgets, served.column_sums,
            served.chunked) == (arch.smem_limit, arch.slots, arch.reg_budgets,
                                arch.column_sums, arch.chunked)


def test_an_unknown_value_is_refused(monkeypatch):
    monkeypatch.setenv(sm90_arch.PROOF_ENV, "sm80")
    with pytest.raises(ValueError, match="sm100, sm120"):
        sm90_arch.served_arch()


def test_only_an_mma_sync_arch_has_a_proof_twin():
    with pytest.raises(ValueError):
        proof(sm90_arch.SM90)


def test_info_says_which_kernels_the_sm90_backend_serves():
    env = {**os.environ, sm90_arch.PROOF_ENV: "sm100"}
    env.pop("FLASH_QLA_BACKEND", None)
    out = subprocess.run([sys.executable, "-m", "flash_qla", "info"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert "FLASH_QLA_PROOF_ARCH=sm100: serving the proof build" in \
        " ".join(out.stdout.split()), out.stdout[-3000:]


def test_decode_only_arch_refuses_the_chunked_prefill():
    """An arch that builds the decode step only (``Arch.chunked=False``; SM120 before
    its sub-chunk forward, here a copy of it)."""
    pytest.importorskip("tilelang", reason="TileLang is not installed")
    from flash_qla_tl.backend import TileLangKernels

    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    kernels = TileLangKernels(replace(SM120, chunked=False))
    with pytest.raises(NotImplementedError, match="FLA .*chunk_gated_delta_rule"):
        kernels.fwd(q, q, q, q[..., 0].float(), q[..., 0], scale=1.0, initial_state=None,
                    cu_seqlens=None, cu_seqlens_cpu=None, output_final_state=False,
                    output_h=False)
    with pytest.raises(NotImplementedError, match="101,376 bytes"):
        kernels.bwd(q, q, q, q[..., 0], q[..., 0], q, q, dht=None, scale=1.0,
                    initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None)


def test_inference_only_arch_refuses_training_before_its_forward(monkeypatch):
    """SM120 builds the forward and decode, not the backward (``Arch.training=False``):
    a call autograd would record is refused naming FLA before any kernel runs, on the
    arch and on its proof twin alike (the twin proves what the arch ships); inference
    calls are served (prepare + the sub-chunk forward)."""
    pytest.importorskip("tilelang", reason="TileLang is not installed")
    import flash_qla
    from flash_qla import api
    from flash_qla_tl import backend, backward, forward
    from flash_qla_tl.backend import TileLangKernels

    for module in (backward, backend):                    # the planner's SM count
        monkeypatch.setattr(module, "sm_count", lambda device: 132)

    assert SM100.training is True and SM120.training is False
    assert proof(SM120).training is False
    assert TileLangKernels(SM100).training_refusal(torch.device("cpu")) is None
    assert TileLangKernels(replace(SM120, chunked=False)).training_refusal(
        torch.device("cpu")) is None                                     # no forward
    kernels = TileLangKernels(SM120)
    monkeypatch.setattr(api, "_select_kernels", lambda q, v, backend, *o: (None, kernels))
    ran = []
    monkeypatch.setattr(forward, "launcher", lambda *a: (lambda *args: ran.append(a[0])))
    q = torch.randn(1, 128, 1, 128, dtype=torch.bfloat16)
    g, beta = -torch.rand(1, 128, 1), torch.rand(1, 128, 1, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="inference only.*FLA_FLASH_QLA=0"):
        flash_qla.chunk_gated_delta_rule(q.requires_grad_(), q, q, g, beta)
    assert ran == []
    with torch.no_grad():
        o, _ = flash_qla.chunk_gated_delta_rule(q, q, q, g, beta)
    assert o.shape == (1, 128, 1, 128) and len(ran) == 2          # prepare + forward
    with pytest.raises(NotImplementedError, match="inference only"):
        kernels.bwd(q, q, q, g, beta.float(), q, q, dht=None, scale=1.0,
                    initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None)
