"""Picking a kernel backend for a call.

Kernel packages (``flash-qla-sm90`` ...) register a :class:`~flash_qla.backend.BackendSpec`
under the entry-point group :data:`ENTRY_POINT_GROUP`, named after their arch. The
``torch`` backend (the PyTorch reference in :mod:`flash_qla.reference`) is built in and
always available.

Nothing here runs at import: entry points are read on the first call that needs them
(:func:`get_kernels` on a CUDA tensor, or ``python -m flash_qla info``), and a backend's
kernels are loaded the first time it is picked.

Rules of :func:`get_kernels`:

* a non-CUDA device (CPU) always gets ``torch``;
* on CUDA, ``backend=`` or else the environment variable ``FLASH_QLA_BACKEND`` names the
  backend; otherwise the backends whose ``capabilities`` contain the device's compute
  capability are tried in name order;
* a backend declaring another kernel-API version than
  :data:`~flash_qla.backend.KERNEL_API_VERSION` is refused with the pip command that fixes
  it; one that cannot run the call's head dims / dtype is refused with a ``ValueError``
  naming them; a backend whose loader raises ``NotImplementedError`` (a package that
  ships no kernels yet) is skipped with its message kept for the error;
* a plugin that fails to import, or whose loader fails otherwise, is reported with the
  original exception chained, never skipped silently.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from flash_qla import offsets
from flash_qla.backend import KERNEL_API_VERSION, BackendSpec

__all__ = [
    "CAPABILITY_EXTRAS",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "TORCH_BACKEND",
    "BackendError",
    "BackendImportError",
    "BackendVersionError",
    "NoBackendError",
    "PluginFailure",
    "clear_cache",
    "discover",
    "get_kernels",
    "install_hint",
]

#: Entry-point group kernel packages register their ``BackendSpec`` under.
ENTRY_POINT_GROUP = "flash_qla.backends"
#: Environment variable naming the backend to use on CUDA devices.
ENV_VAR = "FLASH_QLA_BACKEND"
#: Which extra of ``flash-qla`` serves a compute capability (keep in step with the
#: extras of packages/flash-qla-core/pyproject.toml).
CAPABILITY_EXTRAS: dict[tuple[int, int], str] = {
    (9, 0): "sm90",
    (10, 0): "sm100",
    (10, 3): "sm100",
    (12, 0): "sm120",
    (12, 1): "sm120",
}

_CORE_DIST = "flash-qla"


class BackendError(RuntimeError):
    """A backend could not be found, imported or loaded."""


class BackendImportError(BackendError):
    """A kernel package's entry point failed to import (the cause is chained)."""


class BackendVersionError(BackendError):
    """A kernel package implements another kernel-API version than this core."""


class NoBackendError(BackendError):
    """No installed backend serves this CUDA device."""


def _core_version() -> str:
    try:
        return importlib.metadata.version(_CORE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _load_torch_kernels() -> Any:
    from flash_qla.reference import TORCH_KERNELS

    return TORCH_KERNELS


#: The built-in PyTorch reference backend: any device, any head dims and dtype; slow.
TORCH_BACKEND = BackendSpec(
    name="torch",
    distribution=_CORE_DIST,
    version=_core_version(),
    kernel_api_version=KERNEL_API_VERSION,
    capabilities=(),
    head_dims=(),
    dtypes=(),
    loader=_load_torch_kernels,
    notes="PyTorch reference (flash_qla.reference); any device, slow",
)


# --------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PluginFailure:
    """An entry point of :data:`ENTRY_POINT_GROUP` that did not give a usable spec."""

    name: str
    value: str  # "module:attribute"
    distribution: str
    version: str
    error: BaseException

    def describe(self) -> str:
        return (f"{self.name} ({self.distribution} {self.version}): entry point "
                f"{self.value!r} failed: {type(self.error).__name__}: {self.error}")

    def as_exception(self) -> BackendImportError:
        exc = BackendImportError(f"backend {self.describe()}")
        exc.__cause__ = self.error
        return exc


@dataclass(frozen=True)
class _Discovery:
    specs: dict[str, BackendSpec]  # name -> spec, "torch" included
    failures: tuple[PluginFailure, ...]


_lock = threading.RLock()
_discovery: _Discovery | None = None
_kernels: dict[tuple[int, str], Any] = {}  # (device index, backend name) -> Kernels
_unavailable: dict[str, NotImplementedError] = {}  # backends whose loader said "no kernels"
_capabilities: dict[int, tuple[int, int]] = {}
# (device index, requested name or None, K, V, dtype name) -> (spec, kernels)
_picked: dict[tuple[int, str | None, int, int, str], tuple[BackendSpec, Any]] = {}
# the same picks by the call's own arguments and FLASH_QLA_BACKEND: a repeated call (every
# call of a model's layers) skips the normalisation and lookups below
_call_picks: dict[tuple, tuple[BackendSpec, Any]] = {}
_warned_failures = False

#: When not None, entry points are read only from distributions found on these paths
#: (tests use it to see their own fake distributions and nothing else).
_METADATA_PATH: list[str] | None = None


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    if _METADATA_PATH is None:
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    found = []
    for dist in importlib.metadata.distributions(path=list(_METADATA_PATH)):
        found.extend(ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
    return found


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"] or "?", dist.version or "?"


def _check_spec(ep_name: str, obj: object) -> None:
    if not isinstance(obj, BackendSpec):
        raise TypeError(f"expected a flash_qla.backend.BackendSpec, got {type(obj).__name__}")
    if obj.name != ep_name:
        raise ValueError(f"registered as {ep_name!r} but its BackendSpec is named {obj.name!r}")


def discover(*, refresh: bool = False) -> tuple[dict[str, BackendSpec], list[PluginFailure]]:
    """The backends installed: ``(specs by name, failed entry points)``.

    Imports every entry point of :data:`ENTRY_POINT_GROUP` (light objects: no TileLang,
    no compilation) once per process; ``refresh=True`` reads them again. ``torch`` is
    always among the specs. An entry point that fails to import, that is not a
    ``BackendSpec``, whose name another distribution also registers, or that claims the
    reserved name ``torch`` is returned as a :class:`PluginFailure` holding the original
    exception (a name registered twice is dropped from the specs: which one would run
    is not knowable).
    """
    global _discovery
    with _lock:
        if _discovery is None or refresh:
            specs: dict[str, BackendSpec] = {TORCH_BACKEND.name: TORCH_BACKEND}
            failures: list[PluginFailure] = []
            seen: dict[str, str] = {TORCH_BACKEND.name: f"{_CORE_DIST} (built in)"}
            for ep in sorted(_entry_points(), key=lambda e: (e.name, _dist_of(e))):
                dist_name, dist_version = _dist_of(ep)
                error: Exception | None = None
                if ep.name in seen:
                    error = ValueError(f"backend name {ep.name!r} is also registered by "
                                       f"{seen[ep.name]}")
                    if ep.name != TORCH_BACKEND.name:
                        specs.pop(ep.name, None)
                else:
                    seen[ep.name] = dist_name
                    try:
                        obj = ep.load()
                        _check_spec(ep.name, obj)
                        specs[ep.name] = obj
                    except Exception as exc:  # kept in PluginFailure, never dropped
                        error = exc
                if error is not None:
                    failures.append(PluginFailure(ep.name, ep.value, dist_name, dist_version,
                                                  error))
            _discovery = _Discovery(specs, tuple(failures))
        return dict(_discovery.specs), list(_discovery.failures)


def clear_cache() -> None:
    """Forget discovered backends, loaded kernels, picks and device capabilities, and
    the kept call plans, which hold loaded kernels (``flash_qla.offsets.clear_plans``)."""
    global _discovery, _warned_failures
    offsets.clear_plans()
    with _lock:
        _discovery = None
        _warned_failures = False
        _kernels.clear()
        _unavailable.clear()
        _capabilities.clear()
        _picked.clear()
        _call_picks.clear()


# --------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------

def pip_command(extra: str, clone_path: str) -> str:
    """The install command from a clone of the repository (``pip install -e
    <clone_path>``), first while 0.2 is not published (PyPI's ``flash-qla`` 0.1.x is
    another project), then the extra it will be (``pip install "flash-qla[extra]"``)."""
    return (f'pip install -e {clone_path} (from a clone; after the 0.2 release: '
            f'pip install "flash-qla[{extra}]")')


def install_hint(capability: tuple[int, int]) -> str:
    """The pip command that installs the kernels for ``capability``, or why there is none."""
    extra = CAPABILITY_EXTRAS.get(tuple(capability))
    if extra is None:
        served = ", ".join(f"{a}.{b}" for a, b in sorted(CAPABILITY_EXTRAS))
        return (f"no FlashQLA kernel package serves compute capability "
                f"{capability[0]}.{capability[1]} (served: {served}); set {ENV_VAR}=torch "
                f"to run the slow PyTorch reference")
    # the shared TileLang kernels are not on an index yet either: the clone's copy
    return pip_command(extra, f"packages/flash-qla-tilelang -e packages/flash-qla-{extra}")


def _fmt_caps(caps: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{a}.{b}" for a, b in caps) if caps else "any device"


def _label(spec: BackendSpec) -> str:
    return f"{spec.name} ({spec.distribution} {spec.version})"


def _pinned_requirement(distribution: str) -> str | None:
    """The requirement on ``distribution`` in this core's extras, e.g. ``flash-qla-sm90==0.2.*``."""
    try:
        requires = importlib.metadata.requires(_CORE_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        spec = req.split(";", 1)[0].strip()
        name = spec
        for sep in ("=", "<", ">", "!", "~", "[", " "):
            name = name.split(sep, 1)[0]
        if name.replace("_", "-").lower() == distribution.lower():
            return spec.replace(" ", "")
    return None


def _version_error(spec: BackendSpec) -> BackendVersionError:
    core = f"{_CORE_DIST} {_core_version()}"
    head = (f"backend {_label(spec)} implements kernel API v{spec.kernel_api_version}, "
            f"but {core} expects v{KERNEL_API_VERSION}. ")
    if spec.kernel_api_version > KERNEL_API_VERSION:
        extra = next((e for e in sorted(set(CAPABILITY_EXTRAS.values()))
                      if f"{_CORE_DIST}-{e}" == spec.distribution), None)
        target = f"{_CORE_DIST}[{extra}]" if extra else _CORE_DIST
        fix = f'pip install -U "{target}"'
        return BackendVersionError(head + f"{spec.distribution} is newer than the core; "
                                   f"upgrade the core: {fix}")
    pinned = _pinned_requirement(spec.distribution) or spec.distribution
    return BackendVersionError(head + f"{spec.distribution} is older than the core; "
                               f'install the compatible release: pip install -U "{pinned}"')


# --------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _capability(index: int) -> tuple[int, int]:
    cap = _capabilities.get(index)
    if cap is None:
        cap = tuple(torch.cuda.get_device_capability(index))
        _capabilities[index] = cap
    return cap


def _describe_device(index: int, cap: tuple[int, int]) -> str:
    name = torch.cuda.get_device_name(index)
    return f"cuda:{index} ({name}, compute capability {cap[0]}.{cap[1]})"


def _load(spec: BackendSpec, index: int) -> Any:
    """The spec's kernels, loaded once per (device index, name); errors are chained.
    Once loaded they are read without the lock (a dict read is atomic): the lock is
    taken only while nothing is loaded yet."""
    key = (index, spec.name)
    kernels = _kernels.get(key)
    if kernels is not None:
        return kernels
    with _lock:
        if key in _kernels:
            return _kernels[key]
        if spec.name in _unavailable:
            raise _unavailable[spec.name]
        try:
            kernels = spec.loader()
        except NotImplementedError as exc:
            _unavailable[spec.name] = exc
            raise
        except Exception as exc:
            raise BackendError(f"backend {_label(spec)} failed to load its kernels: "
                               f"{type(exc).__name__}: {exc}") from exc
        _kernels[key] = kernels
        return kernels


def _requested_backend(backend: str | None) -> tuple[str | None, str]:
    """The backend name asked for, if any, and where it came from."""
    if backend is not None:
        return backend, "backend= argument"
    env = os.environ.get(ENV_VAR, "").strip()
    return (env, ENV_VAR) if env else (None, "")


def _get_named(name: str, source: str, index: int, cap: tuple[int, int], K: int, V: int,
               dtype_name: str) -> tuple[BackendSpec, Any]:
    specs, failures = discover()
    spec = specs.get(name)
    if spec is None:
        for failure in failures:
            if failure.name == name:
                raise failure.as_exception()
        found = ", ".join(f"{s.name} {s.version}" for s in specs.values())
        raise ValueError(f"unknown FlashQLA backend {name!r} (from {source}); found: {found}")
    if spec.capabilities and cap not in spec.capabilities:
        raise ValueError(f"backend {_label(spec)} (from {source}) serves compute capability "
                         f"{_fmt_caps(spec.capabilities)}, not {_describe_device(index, cap)}")
    if spec.kernel_api_version != KERNEL_API_VERSION:
        raise _version_error(spec)
    reason = spec.rejection_reason(K=K, V=V, dtype_name=dtype_name)
    if reason is not None:
        raise ValueError(f"backend {_label(spec)} (from {source}) cannot run this call: {reason}")
    try:
        return spec, _load(spec, index)
    except NotImplementedError as exc:
        raise NoBackendError(f"backend {_label(spec)} (from {source}) has no kernels for "
                             f"{_describe_device(index, cap)}: {exc}") from exc


def _no_backend_error(index: int, cap: tuple[int, int], specs: dict[str, BackendSpec],
                      failures: list[PluginFailure], reasons: dict[str, str]) -> NoBackendError:
    lines = [f"no FlashQLA backend serves {_describe_device(index, cap)}.", "Backends found:"]
    for spec in specs.values():
        if spec.name == TORCH_BACKEND.name:
            lines.append(f"  - {_label(spec)}: the PyTorch reference, used on CUDA only when "
                         f"asked for ({ENV_VAR}=torch)")
            continue
        why = reasons.get(spec.name, f"serves compute capability {_fmt_caps(spec.capabilities)}")
        notes = f" [{spec.notes}]" if spec.notes else ""
        lines.append(f"  - {_label(spec)}: {why}{notes}")
    lines.extend(f"  - {failure.describe()}" for failure in failures)
    lines.append(f"Fix: {install_hint(cap)}")
    lines.append(f"(or set {ENV_VAR}=torch to run the slow PyTorch reference; called "
                 "through FLA's chunk_gated_delta_rule, set FLA_FLASH_QLA=0 to keep FLA's "
                 "own kernels on this GPU)")
    err = NoBackendError("\n".join(lines))
    if failures:
        err.__cause__ = failures[0].error
    return err


def _warn_failures(failures: list[PluginFailure]) -> None:
    global _warned_failures
    if failures and not _warned_failures:
        _warned_failures = True
        warnings.warn("FlashQLA: kernel packages failed to import (see python -m flash_qla "
                      "info): " + "; ".join(f.describe() for f in failures),
                      RuntimeWarning, stacklevel=4)


def _pick(index: int, cap: tuple[int, int], K: int, V: int,
          dtype_name: str) -> tuple[BackendSpec, Any]:
    specs, failures = discover()
    reasons: dict[str, str] = {}
    rejections: list[str] = []
    for spec in specs.values():
        if cap not in spec.capabilities:
            continue
        if spec.kernel_api_version != KERNEL_API_VERSION:
            raise _version_error(spec)
        reason = spec.rejection_reason(K=K, V=V, dtype_name=dtype_name)
        if reason is not None:
            rejections.append(f"{_label(spec)}: {reason}")
            continue
        try:
            kernels = _load(spec, index)
        except NotImplementedError as exc:
            reasons[spec.name] = str(exc)
            continue
        _warn_failures(failures)
        return spec, kernels
    if rejections:
        raise ValueError(f"no FlashQLA backend for {_describe_device(index, cap)} can run "
                         f"this call: " + "; ".join(rejections)
                         + f" (pass backend='torch' or set {ENV_VAR}=torch to run the slow "
                         f"PyTorch reference)")
    raise _no_backend_error(index, cap, specs, failures, reasons)


def get_kernels(device: torch.device, *, K: int, V: int, dtype: torch.dtype,
                backend: str | None = None) -> tuple[BackendSpec, Any]:
    """The backend and its loaded kernels for a call on ``device``.

    Args:
        device: the device of the call's tensors.
        K, V: q/k and value head dims.
        dtype: q/k/v dtype.
        backend: a backend name (``"sm90"``, ``"torch"`` ...) overriding both the
            automatic pick and ``FLASH_QLA_BACKEND``; on a non-CUDA device only ``"torch"``
            is accepted (``FLASH_QLA_BACKEND`` is ignored there).

    Returns:
        ``(spec, kernels)``, where ``kernels`` satisfies :class:`flash_qla.backend.Kernels`.
        Picks are cached per (device, requested name, K, V, dtype); kernels per
        (device index, backend name).

    Raises:
        ValueError: unknown backend name; a backend that cannot run these head dims,
            dtype or device.
        BackendVersionError: kernel-API mismatch (the message holds the pip command).
        BackendImportError: the kernel package asked for failed to import (its error is
            chained).
        NoBackendError: no installed backend serves this CUDA device (the message names
            the device, the backends found with versions and reasons, and the pip command
            to install one).
        BackendError: a backend's kernels failed to load (the cause is chained).
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (str) or None, got "
                        f"{type(backend).__name__}")
    call = (device, K, V, dtype, backend, os.environ.get(ENV_VAR))
    picked = _call_picks.get(call)
    if picked is None:
        device = torch.device(device)
        picked = _get_kernels(device, K, V, dtype, backend)
        if device.type != "cuda" or device.index is not None:   # not "the current GPU"
            _call_picks[call] = picked
    return picked


def _get_kernels(device: torch.device, K: int, V: int, dtype: torch.dtype,
                 backend: str | None) -> tuple[BackendSpec, Any]:
    dtype_name = _dtype_name(dtype)
    if device.type != "cuda":
        if backend is not None and backend != TORCH_BACKEND.name:
            known = sorted(discover()[0])
            if backend not in known and backend in set(CAPABILITY_EXTRAS.values()):
                raise ValueError(f"backend {backend!r} is not installed here (installed: "
                                 f"{known}) and runs on CUDA devices only; the tensors are "
                                 f"on {device}: use backend='torch' or move them to a GPU "
                                 f"where the {backend} package is installed")
            if backend not in known:
                raise ValueError(f"backend: unknown backend {backend!r}; installed: {known} "
                                 f"(tensors on {device} run on the 'torch' backend)")
            raise ValueError(f"backend {backend!r} runs on CUDA devices only; the tensors are "
                             f"on {device}: use backend='torch' or move them to a GPU")
        return TORCH_BACKEND, _load(TORCH_BACKEND, -1)

    index = _device_index(device)
    requested, source = _requested_backend(backend)
    key = (index, requested, K, V, dtype_name)
    picked = _picked.get(key)
    if picked is not None:
        return picked
    with _lock:
        cap = _capability(index)
        if requested is not None:
            picked = _get_named(requested, source, index, cap, K, V, dtype_name)
        else:
            picked = _pick(index, cap, K, V, dtype_name)
        _picked[key] = picked
    return picked
