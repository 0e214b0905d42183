"""``flash_qla_tl.launch`` on the CPU: a launcher is built once per (builder,
static arguments), and calls the compiled module directly only for TileLang 0.1.15's
tvm-ffi adapter with nothing to allocate; anything else is called as it is. The builders
here are stand-ins with the attributes the launcher reads, except in the last test
(a shipped builder, compile-only: TileLang, no GPU)."""

from __future__ import annotations

import pytest

launch = pytest.importorskip("flash_qla_tl.launch", reason="TileLang is not installed")


@pytest.fixture(autouse=True)
def _fresh_launchers(monkeypatch):
    """Each test starts from an empty launcher table (stubs never outlive the test)."""
    monkeypatch.setattr(launch, "_LAUNCHERS", {})


class _Adapter:
    """An adapter as far as the launcher reads it (not TileLang's tvm-ffi class)."""

    def __init__(self, result_idx):
        self.result_idx = list(result_idx)

    def _get_executable(self):
        raise AssertionError("only TileLang's tvm-ffi adapter is bypassed")


class _Kernel:
    def __init__(self, result_idx=()):
        self.adapter = _Adapter(result_idx)

    def __call__(self, *args):
        return ("kernel", args)


class _Builder:
    """Counts builds per static arguments, like a ``tilelang.jit`` builder's lookups."""

    def __init__(self, result_idx=()):
        self.builds, self.result_idx = [], result_idx

    def __call__(self, *static):
        self.builds.append(static)
        return _Kernel(self.result_idx)


def test_launcher_built_once_per_static_configuration():
    builder = _Builder()
    first = launch.launcher(builder, "bfloat16", 128, True)
    assert launch.launcher(builder, "bfloat16", 128, True) is first
    assert launch.launcher(builder, "float16", 128, True) is not first
    assert builder.builds == [("bfloat16", 128, True), ("float16", 128, True)]


@pytest.mark.parametrize("result_idx", [(), (2,)])
def test_launcher_calls_other_adapters_through_the_kernel(result_idx):
    # another adapter class, or one that allocates outputs (out_idx): the kernel runs
    builder = _Builder(result_idx)
    assert launch.launcher(builder, "bfloat16")(1, 2.0) == ("kernel", (1, 2.0))


def test_launcher_passes_other_callables_through():
    # a test stub or a recording wrapper returns a plain launcher
    def builder(*static):
        return lambda *args: ("stub", static, args)
    assert launch.launcher(builder, 64)(3) == ("stub", (64,), (3,))


def test_launcher_never_confuses_builders():
    # two builders, one static configuration: two launchers (keyed by the builder too)
    a, b = _Builder(), _Builder()
    assert launch.launcher(a, "bfloat16") is not launch.launcher(b, "bfloat16")
    assert (len(a.builds), len(b.builds)) == (1, 1)


def test_shipped_builder_launches_its_compiled_module_directly():
    """A real builder (test_compile's fwd_ws_h variant: compile-only) resolves to the
    compiled module its tvm-ffi adapter would call, once per configuration."""
    from flash_qla_sm90.arch import SM90
    from flash_qla_tl.kernels.chunk_state_output import chunk_fwd_ws_kernel

    static = (SM90, "bfloat16", 128, 128, True, True)
    kernel = chunk_fwd_ws_kernel(*static)
    fn = launch.launcher(chunk_fwd_ws_kernel, *static)
    assert fn is launch.launcher(chunk_fwd_ws_kernel, *static)
    assert not kernel.adapter.result_idx          # every output is an argument
    assert fn is kernel.adapter._get_executable()
