"""Backend discovery and selection (flash_qla.dispatch), on the CPU.

Fake kernel packages are real distributions: a ``*.dist-info`` directory with METADATA
and ``entry_points.txt`` written to a temporary directory, read by
``importlib.metadata`` like any installed package. ``dispatch._METADATA_PATH`` limits
discovery to that directory so the packages installed in the test environment do not
take part (the real ones are covered by test_packaging.py). A CUDA device is faked by
patching ``torch.cuda.get_device_capability`` / ``get_device_name``.
"""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import torch

from flash_qla import dispatch
from flash_qla.backend import KERNEL_API_VERSION

FAKE_MODULE = "flash_qla_fake_backends"
BROKEN_MODULE = "flash_qla_fake_broken"

FAKE_SOURCE = textwrap.dedent('''
    from flash_qla.backend import KERNEL_API_VERSION, BackendSpec

    LOADS = []  # names of the backends whose loader ran, in order


    class FakeKernels:
        def __init__(self, name):
            self.name = name


    def _loader(name):
        def load():
            LOADS.append(name)
            return FakeKernels(name)
        return load


    def _no_kernels():
        LOADS.append("fake120")
        raise NotImplementedError("fake-qla-rtx 0.0.1 ships no kernels yet")


    def _corrupt():
        raise OSError("kernel cache is corrupt")


    def _spec(name, dist, caps, *, version="0.2.0", api=KERNEL_API_VERSION, loader=None,
              notes=""):
        return BackendSpec(name=name, distribution=dist, version=version,
                           kernel_api_version=api, capabilities=caps,
                           head_dims=((128, 128),), dtypes=("bfloat16", "float16"),
                           loader=loader or _loader(name), notes=notes)


    HOPPER = _spec("fake90", "fake-qla-hopper", ((9, 0),))
    BLACKWELL = _spec("fake100", "fake-qla-blackwell", ((10, 0), (10, 3)))
    RTX = _spec("fake120", "fake-qla-rtx", ((12, 0), (12, 1)), version="0.0.1",
                loader=_no_kernels, notes="no kernels yet")
    OLD_SM90 = _spec("sm90", "flash-qla-sm90", ((9, 0),), version="0.1.0",
                     api=KERNEL_API_VERSION - 1)
    NEW_SM90 = _spec("sm90", "flash-qla-sm90", ((9, 0),), version="0.3.0",
                     api=KERNEL_API_VERSION + 1)
    CORRUPT = _spec("fake90", "fake-qla-hopper", ((9, 0),), loader=_corrupt)
    MISNAMED = _spec("other", "fake-qla-hopper", ((9, 0),))
    NOT_A_SPEC = object()
''')

BROKEN_SOURCE = 'raise ImportError("libfakekernels.so: cannot open shared object file")\n'

# dist name -> (version, entry points)
HOPPER = ("fake-qla-hopper", "0.2.0", {"fake90": f"{FAKE_MODULE}:HOPPER"})
BLACKWELL = ("fake-qla-blackwell", "0.2.0", {"fake100": f"{FAKE_MODULE}:BLACKWELL"})
RTX = ("fake-qla-rtx", "0.0.1", {"fake120": f"{FAKE_MODULE}:RTX"})
OLD_SM90 = ("flash-qla-sm90", "0.1.0", {"sm90": f"{FAKE_MODULE}:OLD_SM90"})
NEW_SM90 = ("flash-qla-sm90", "0.3.0", {"sm90": f"{FAKE_MODULE}:NEW_SM90"})
BROKEN = ("fake-qla-broken", "0.2.0", {"broken": f"{BROKEN_MODULE}:BACKEND"})
CORRUPT = ("fake-qla-hopper", "0.2.0", {"fake90": f"{FAKE_MODULE}:CORRUPT"})


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


@pytest.fixture
def install(tmp_path, monkeypatch):
    """``install(*dists)``: make fake distributions visible to the dispatch."""
    (tmp_path / f"{FAKE_MODULE}.py").write_text(FAKE_SOURCE)
    (tmp_path / f"{BROKEN_MODULE}.py").write_text(BROKEN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "_METADATA_PATH", [str(tmp_path)])
    for module in (FAKE_MODULE, BROKEN_MODULE):
        monkeypatch.delitem(sys.modules, module, raising=False)

    def _install(*dists):
        for dist, version, entries in dists:
            info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            (info / "entry_points.txt").write_text(
                "[flash_qla.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
        dispatch.clear_cache()

    yield _install
    for module in (FAKE_MODULE, BROKEN_MODULE):
        sys.modules.pop(module, None)


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(capability, index=0)``: pretend cuda:index has this compute capability."""
    caps: dict[int, tuple[int, int]] = {}

    def capability(device=None):
        return caps[0 if device is None else int(device)]

    def name(device=None):
        return f"Fake GPU {0 if device is None else int(device)}"

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", name)

    def _set(cap, index=0):
        caps[index] = cap
        return torch.device("cuda", index)

    return _set


def loads():
    return sys.modules[FAKE_MODULE].LOADS


BF16 = torch.bfloat16
CALL = {"K": 128, "V": 128, "dtype": BF16}


# --------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------

def test_cpu_gets_the_torch_backend():
    spec, kernels = dispatch.get_kernels(torch.device("cpu"), K=64, V=32, dtype=torch.float32)
    assert spec is dispatch.TORCH_BACKEND
    from flash_qla.reference import TORCH_KERNELS

    assert kernels is TORCH_KERNELS


def test_cpu_ignores_env_override(install, monkeypatch):
    install(HOPPER)
    monkeypatch.setenv(dispatch.ENV_VAR, "fake90")
    spec, _ = dispatch.get_kernels(torch.device("cpu"), **CALL)
    assert spec.name == "torch"


def test_cpu_refuses_a_cuda_backend_argument(install):
    install(HOPPER)
    with pytest.raises(ValueError, match=r"backend 'fake90' runs on CUDA devices only"):
        dispatch.get_kernels(torch.device("cpu"), **CALL, backend="fake90")


def test_cpu_names_an_arch_backend_that_is_not_installed(install):
    """A real arch's name (sm90) that is not installed here: said so, with where it runs,
    not called unknown."""
    install(HOPPER)
    with pytest.raises(ValueError, match=r"backend 'sm90' is not installed here \(installed: "
                                         r"\['fake90', 'torch'\]\) and runs on CUDA devices"):
        dispatch.get_kernels(torch.device("cpu"), **CALL, backend="sm90")


def test_cpu_names_an_unknown_backend(install):
    install(HOPPER)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; installed: \['fake90', "
                                         r"'torch'\]"):
        dispatch.get_kernels(torch.device("cpu"), **CALL, backend="nope")


# --------------------------------------------------------------------------------------
# Automatic pick
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("capability", "expected"), [
    ((9, 0), "fake90"),
    ((10, 0), "fake100"),
    ((10, 3), "fake100"),
], ids=["sm90", "sm100", "sm103"])
def test_pick_by_capability(install, gpu, capability, expected):
    install(HOPPER, BLACKWELL, RTX)
    spec, kernels = dispatch.get_kernels(gpu(capability), **CALL)
    assert (spec.name, kernels.name) == (expected, expected)
    assert loads() == [expected]


def test_pick_per_device_and_cache(install, gpu):
    install(HOPPER, BLACKWELL)
    d0, d1 = gpu((9, 0), 0), gpu((10, 0), 1)
    first = dispatch.get_kernels(d0, **CALL)
    assert dispatch.get_kernels(d0, **CALL) is first
    assert dispatch.get_kernels(d0, K=128, V=128, dtype=torch.float16)[1] is first[1]
    assert dispatch.get_kernels(d1, **CALL)[0].name == "fake100"
    assert loads() == ["fake90", "fake100"]


def test_discovery_is_lazy_and_cached(install, gpu):
    install(HOPPER)
    assert dispatch._discovery is None
    dispatch.get_kernels(gpu((9, 0)), **CALL)
    assert dispatch._discovery is not None
    specs, failures = dispatch.discover()
    assert sorted(specs) == ["fake90", "torch"] and failures == []


def test_discovery_reads_installed_metadata(install, tmp_path, monkeypatch):
    """Without the test scope, entry points come from importlib.metadata.entry_points."""
    install(HOPPER)
    monkeypatch.setattr(dispatch, "_METADATA_PATH", None)
    specs, _ = dispatch.discover(refresh=True)
    assert specs["fake90"].distribution == "fake-qla-hopper"


# --------------------------------------------------------------------------------------
# No backend
# --------------------------------------------------------------------------------------

def test_missing_backend_error_names_device_backends_and_fix(install, gpu):
    install(BLACKWELL, RTX)
    with pytest.raises(dispatch.NoBackendError) as info:
        dispatch.get_kernels(gpu((9, 0)), **CALL)
    msg = str(info.value)
    assert "cuda:0 (Fake GPU 0, compute capability 9.0)" in msg
    assert "fake100 (fake-qla-blackwell 0.2.0): serves compute capability 10.0, 10.3" in msg
    assert "fake120 (fake-qla-rtx 0.0.1)" in msg
    assert "torch (flash-qla " in msg
    assert ('Fix: pip install -e packages/flash-qla-tilelang -e packages/flash-qla-sm90 '
            '(from a clone') in msg
    assert 'pip install "flash-qla[sm90]"' in msg
    assert f"{dispatch.ENV_VAR}=torch" in msg


def test_missing_backend_for_unknown_capability(install, gpu):
    install(HOPPER)
    with pytest.raises(dispatch.NoBackendError,
                       match=r"no FlashQLA kernel package serves compute capability 8\.0"):
        dispatch.get_kernels(gpu((8, 0)), **CALL)


def test_backend_without_kernels_is_reported_not_picked(install, gpu):
    install(RTX)
    with pytest.raises(dispatch.NoBackendError) as info:
        dispatch.get_kernels(gpu((12, 0)), **CALL)
    msg = str(info.value)
    assert "fake120 (fake-qla-rtx 0.0.1): fake-qla-rtx 0.0.1 ships no kernels yet" in msg
    assert "[no kernels yet]" in msg
    assert 'pip install "flash-qla[sm120]"' in msg
    with pytest.raises(dispatch.NoBackendError):
        dispatch.get_kernels(gpu((12, 0)), **CALL)
    assert loads() == ["fake120"]  # the loader's answer is remembered


def test_backend_without_kernels_named_explicitly(install, gpu):
    install(RTX)
    with pytest.raises(dispatch.NoBackendError, match="ships no kernels yet") as info:
        dispatch.get_kernels(gpu((12, 1)), **CALL, backend="fake120")
    assert isinstance(info.value.__cause__, NotImplementedError)


# --------------------------------------------------------------------------------------
# Kernel-API version
# --------------------------------------------------------------------------------------

def test_older_kernel_package_gets_pip_command(install, gpu):
    install(OLD_SM90)
    with pytest.raises(dispatch.BackendVersionError) as info:
        dispatch.get_kernels(gpu((9, 0)), **CALL)
    msg = str(info.value)
    assert (f"backend sm90 (flash-qla-sm90 0.1.0) implements kernel API "
            f"v{KERNEL_API_VERSION - 1}") in msg
    assert f"expects v{KERNEL_API_VERSION}" in msg
    pinned = dispatch._pinned_requirement("flash-qla-sm90") or "flash-qla-sm90"
    assert f'pip install -U "{pinned}"' in msg


def test_newer_kernel_package_asks_to_upgrade_the_core(install, gpu):
    install(NEW_SM90)
    with pytest.raises(dispatch.BackendVersionError,
                       match=r'is newer than the core; upgrade the core: '
                             r'pip install -U "flash-qla\[sm90\]"'):
        dispatch.get_kernels(gpu((9, 0)), **CALL)


def test_version_mismatch_on_explicit_backend(install, gpu):
    install(OLD_SM90)
    with pytest.raises(dispatch.BackendVersionError):
        dispatch.get_kernels(gpu((9, 0)), **CALL, backend="sm90")


# --------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------

def test_override_by_argument(install, gpu):
    install(HOPPER)
    spec, _ = dispatch.get_kernels(gpu((9, 0)), **CALL, backend="torch")
    assert spec is dispatch.TORCH_BACKEND


def test_override_by_env(install, gpu, monkeypatch):
    install(HOPPER)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.get_kernels(gpu((9, 0)), **CALL)[0].name == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "fake90")
    assert dispatch.get_kernels(gpu((9, 0)), **CALL)[0].name == "fake90"


def test_argument_beats_env(install, gpu, monkeypatch):
    install(HOPPER)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.get_kernels(gpu((9, 0)), **CALL, backend="fake90")[0].name == "fake90"


def test_torch_serves_a_gpu_no_package_serves(install, gpu, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    install(HOPPER)
    assert dispatch.get_kernels(gpu((8, 6)), K=64, V=64, dtype=torch.float32)[0].name == "torch"


def test_unknown_override_lists_found_backends(install, gpu, monkeypatch):
    install(HOPPER, BLACKWELL)
    monkeypatch.setenv(dispatch.ENV_VAR, "sm90")
    with pytest.raises(ValueError, match=r"unknown FlashQLA backend 'sm90' \(from "
                                         r"FLASH_QLA_BACKEND\); found: torch .*fake100 0\.2\.0"):
        dispatch.get_kernels(gpu((9, 0)), **CALL)


def test_override_for_another_capability(install, gpu):
    install(HOPPER, BLACKWELL)
    with pytest.raises(ValueError, match=r"serves compute capability 10\.0, 10\.3, not cuda:0"):
        dispatch.get_kernels(gpu((9, 0)), **CALL, backend="fake100")


# --------------------------------------------------------------------------------------
# What a backend supports
# --------------------------------------------------------------------------------------

def test_unsupported_head_dim(install, gpu):
    install(HOPPER)
    with pytest.raises(ValueError) as info:
        dispatch.get_kernels(gpu((9, 0)), K=64, V=256, dtype=BF16)
    msg = str(info.value)
    assert "supports head dims (K=128, V=128); got K=64, V=256" in msg
    assert "backend='torch'" in msg


def test_unsupported_dtype(install, gpu):
    install(HOPPER)
    with pytest.raises(ValueError, match=r"dtypes \['bfloat16', 'float16'\]; got float32"):
        dispatch.get_kernels(gpu((9, 0)), K=128, V=128, dtype=torch.float32)


def test_unsupported_head_dim_on_explicit_backend(install, gpu):
    install(HOPPER)
    with pytest.raises(ValueError, match=r"fake90 \(fake-qla-hopper 0\.2\.0\) \(from backend= "
                                         r"argument\) cannot run this call: .*got K=96"):
        dispatch.get_kernels(gpu((9, 0)), K=96, V=128, dtype=BF16, backend="fake90")


# --------------------------------------------------------------------------------------
# Broken plugins are reported
# --------------------------------------------------------------------------------------

def test_plugin_import_error_is_recorded(install):
    install(HOPPER, BROKEN)
    specs, failures = dispatch.discover()
    assert "broken" not in specs and "fake90" in specs
    (failure,) = failures
    assert (failure.name, failure.distribution, failure.version) == (
        "broken", "fake-qla-broken", "0.2.0")
    assert isinstance(failure.error, ImportError)


def test_plugin_import_error_raised_when_asked_for(install, gpu):
    install(BROKEN)
    with pytest.raises(dispatch.BackendImportError,
                       match=r"broken \(fake-qla-broken 0\.2\.0\): entry point "
                             r"'flash_qla_fake_broken:BACKEND' failed: ImportError: "
                             r"libfakekernels\.so") as info:
        dispatch.get_kernels(gpu((9, 0)), **CALL, backend="broken")
    assert isinstance(info.value.__cause__, ImportError)


def test_plugin_import_error_in_no_backend_error(install, gpu):
    install(BROKEN)
    with pytest.raises(dispatch.NoBackendError, match=r"(?s)Backends found:.*broken "
                                                      r"\(fake-qla-broken 0\.2\.0\)") as info:
        dispatch.get_kernels(gpu((9, 0)), **CALL)
    assert isinstance(info.value.__cause__, ImportError)


def test_plugin_import_error_warns_even_when_another_backend_serves(install, gpu):
    install(HOPPER, BROKEN)
    with pytest.warns(RuntimeWarning, match="libfakekernels"):
        assert dispatch.get_kernels(gpu((9, 0)), **CALL)[0].name == "fake90"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.get_kernels(gpu((9, 0)), K=128, V=128, dtype=torch.float16)  # warned once


def test_loader_failure_is_chained(install, gpu):
    install(CORRUPT)
    with pytest.raises(dispatch.BackendError,
                       match=r"fake90 \(fake-qla-hopper 0\.2\.0\) failed to load its kernels: "
                             r"OSError: kernel cache is corrupt") as info:
        dispatch.get_kernels(gpu((9, 0)), **CALL)
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize(("dists", "message"), [
    ([("fake-qla-x", "1.0", {"fake90": f"{FAKE_MODULE}:NOT_A_SPEC"})],
     "expected a flash_qla.backend.BackendSpec, got object"),
    ([("fake-qla-x", "1.0", {"fake90": f"{FAKE_MODULE}:MISNAMED"})],
     "registered as 'fake90' but its BackendSpec is named 'other'"),
    ([("fake-qla-x", "1.0", {"torch": f"{FAKE_MODULE}:HOPPER"})],
     "backend name 'torch' is also registered by flash-qla (built in)"),
    ([HOPPER, ("fake-qla-x", "1.0", {"fake90": f"{FAKE_MODULE}:HOPPER"})],
     "backend name 'fake90' is also registered by fake-qla-"),
], ids=["not-a-spec", "misnamed", "claims-torch", "duplicate"])
def test_bad_registrations_are_failures(install, dists, message):
    install(*dists)
    specs, failures = dispatch.discover()
    assert set(specs) == {"torch"}
    assert any(message in str(f.error) for f in failures), [str(f.error) for f in failures]
    assert specs["torch"] is dispatch.TORCH_BACKEND
