"""The proof switch (CPU): ``FLASH_QLA_PROOF_ARCH=sm100|sm120`` makes the sm90 loader
build a Blackwell arch's portable kernels for sm_90a with WGMMA off, and ``python -m
flash_qla info`` says so; SM120 trains on per-sub-chunk states."""

from __future__ import annotations

import os
import subprocess
import sys

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
    assert (served.smem_limit, served.sub_chunk, served.slots, served.reg_budgets,
            served.column_sums) == (arch.smem_limit, arch.sub_chunk, arch.slots,
                                    arch.reg_budgets, arch.column_sums)


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


def test_sm120_trains_on_sub_chunk_states(monkeypatch):
    """SM120's training step (launches stubbed, CPU): the training forward keeps h in q's
    dtype with a row per 32-token sub-chunk (``layout.state_rows`` 2), the sweep stores dS1
    the same way, and the gradients come from the sub-chunk kernel with the states split
    over V (never the fused kernel, which SM120 does not build), then the GVA sums."""
    pytest.importorskip("tilelang", reason="TileLang is not installed")
    from flash_qla_tl import backward, forward
    from flash_qla_tl.backend import TileLangKernels
    from flash_qla_tl.layout import state_rows

    launched = []

    def launcher(builder, arch, *static):
        assert arch is SM120
        return lambda *args: launched.append((builder.__name__, args))

    for module in (forward, backward):
        monkeypatch.setattr(module, "launcher", launcher)
    B, T, Hk, Hv, D = 2, 200, 1, 2, 128                       # 4 chunks per sequence
    q = torch.randn(B, T, Hk, D, dtype=torch.bfloat16)
    v = torch.randn(B, T, Hv, D, dtype=torch.bfloat16)
    g, beta = -torch.rand(B, T, Hv), torch.rand(B, T, Hv)
    kernels = TileLangKernels(SM120)
    common = dict(scale=D ** -0.5, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None)
    g_cumsum, A, o, h, _ = kernels.fwd(q, q, v, g, beta, output_final_state=False,
                                       output_h=False, keep_states=True, **common)
    assert state_rows(SM120) == 2
    assert h.shape == (2 * B * 4, Hv, D, D) and h.dtype == torch.bfloat16
    kernels.bwd(q, q, v, g_cumsum, beta, A, torch.randn_like(o), dht=None, states=h, **common)
    names = [name for name, _ in launched]
    assert names == ["chunk_prepare_kernel", "chunk_fwd_ws_kernel",
                     "chunk_bwd_dh_ws_kernel", "chunk_bwd_intra_split_kernel",
                     "group_sum_kernel", "group_sum_kernel"], names
    dS1 = launched[2][1][10]
    assert dS1.shape == h.shape and dS1.dtype == torch.bfloat16
    assert launched[3][1][7] is h or launched[3][1][7].data_ptr() == h.data_ptr()
    with pytest.raises(ValueError, match="sm120 builds no fused backward"):
        backward.chunk_bwd(q, q, v, g_cumsum, beta, A, torch.randn_like(o), arch=SM120,
                           dht=None, states=h, fused=True, **common)
