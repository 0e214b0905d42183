"""``flash_qla_sm90.kernels.launch`` on the CPU: a launcher is built once per (builder,
static arguments, traits revision), and calls the compiled module's function directly
only where TileLang's adapter would allocate nothing. No TileLang needed: the builders
and kernels here are stand-ins with the attributes the launcher reads."""

from __future__ import annotations

import pytest

from flash_qla_sm90.kernels import launch, traits


class _Adapter:
    """TileLang 0.1.15's tvm-ffi adapter as far as the launcher reads it."""

    def __init__(self, result_idx):
        self.result_idx = result_idx
        self.executable_calls = 0

    def _get_executable(self):
        self.executable_calls += 1
        return self.executable

    def executable(self, *args):
        return ("direct", args)


class _Kernel:
    def __init__(self, result_idx=()):
        self.adapter = _Adapter(list(result_idx))

    def __call__(self, *args):
        return ("adapter", args)


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
    other = launch.launcher(builder, "float16", 128, True)
    assert other is not first
    assert builder.builds == [("bfloat16", 128, True), ("float16", 128, True)]


def test_launcher_calls_the_module_function_directly():
    builder = _Builder()
    assert launch.launcher(builder, "bfloat16")(1, 2.0) == ("direct", (1, 2.0))


def test_launcher_keeps_the_adapter_when_it_allocates_outputs():
    # a kernel with out_idx: its adapter allocates those outputs, so it must run
    builder = _Builder(result_idx=(2,))
    assert launch.launcher(builder, "bfloat16")(1) == ("adapter", (1,))


def test_launcher_passes_other_callables_through():
    # a test stub or a recording wrapper returns a plain launcher
    def builder(*static):
        return lambda *args: ("stub", static, args)
    assert launch.launcher(builder, 64)(3) == ("stub", (64,), (3,))


def test_launcher_rebuilt_after_a_trait_changes(monkeypatch):
    builder = _Builder()
    first = launch.launcher(builder, "bfloat16")
    monkeypatch.setattr(traits, "BLOCK_V", traits.BLOCK_V)      # bumps traits.revision
    assert launch.launcher(builder, "bfloat16") is not first
    assert len(builder.builds) == 2


def test_launcher_never_confuses_builders(monkeypatch):
    # two builders, one static configuration: two launchers (keyed by the builder too)
    a, b = _Builder(), _Builder()
    assert launch.launcher(a, "bfloat16") is not launch.launcher(b, "bfloat16")
    assert (len(a.builds), len(b.builds)) == (1, 1)


@pytest.mark.parametrize("static", [("bfloat16", 128, 128, True, True)])   # test_compile's
def test_shipped_builders_resolve_through_the_launcher(static):
    """The real builders are looked up by TileLang once per configuration (compile-only:
    needs TileLang, no GPU); the launcher then serves the same kernel's function."""
    pytest.importorskip("tilelang", reason="TileLang is not installed")
    from flash_qla_sm90.kernels.chunk_fwd_ws import chunk_fwd_ws_kernel

    kernel = chunk_fwd_ws_kernel(*static)
    fn = launch.launcher(chunk_fwd_ws_kernel, *static)
    assert fn is launch.launcher(chunk_fwd_ws_kernel, *static)
    assert not kernel.adapter.result_idx          # every output is an argument
    assert callable(fn) and fn is not kernel      # the module function, not the adapter
