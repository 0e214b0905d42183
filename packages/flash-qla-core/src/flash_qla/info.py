"""``python -m flash_qla info``: what this machine has and what FlashQLA will use on it.

GPUs are listed through the CUDA driver API of ``cuda-python`` (``pip install
"flash-qla[info]"``), so the command works before, and without, torch initialising
CUDA. Without cuda-python it says so and asks the driver library directly (ctypes);
without a driver it says that too. Versions of other packages are read from their
metadata, never by importing them (TileLang is not imported).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys
import traceback
from dataclasses import dataclass, field

from flash_qla import dispatch
from flash_qla.backend import KERNEL_API_VERSION, BackendSpec

__all__ = ["DeviceInfo", "DeviceQuery", "query_devices", "report"]

_CC_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
_CC_MINOR = 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
_MIN_DRIVER_CUDA = (12, 8)

#: How to get the ``info`` extra (cuda-python), published or from a clone.
INFO_EXTRA_HINT = dispatch.pip_command("info", '"packages/flash-qla-core[info]"')


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: tuple[int, int]
    memory_bytes: int


@dataclass
class DeviceQuery:
    """GPUs as the CUDA driver reports them (indices follow CUDA_VISIBLE_DEVICES)."""

    method: str  # how the driver was asked
    devices: list[DeviceInfo] = field(default_factory=list)
    driver_cuda: tuple[int, int] | None = None  # CUDA version the driver supports
    problem: str | None = None  # why no device could be listed
    notes: list[str] = field(default_factory=list)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_python_version() -> str | None:
    """cuda-python's version, or its cuda-bindings part installed without the meta-package."""
    version = _dist_version("cuda-python")
    if version is None and (bindings := _dist_version("cuda-bindings")) is not None:
        version = f"cuda-bindings {bindings}"
    return version


class _DriverCallError(RuntimeError):
    pass


def _query_cuda_python(driver) -> DeviceQuery:
    query = DeviceQuery(method=f"cuda-python {_cuda_python_version() or '?'} "
                               f"(CUDA driver API)")

    def call(fn, *args):
        err, *rest = getattr(driver, fn)(*args)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise _DriverCallError(f"{fn} failed: {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else rest

    try:
        call("cuInit", 0)
    except _DriverCallError as exc:
        query.problem = f"the NVIDIA driver found no usable GPU ({exc})"
        return query
    except Exception as exc:  # cuda-python raises when libcuda cannot be loaded
        query.problem = f"no NVIDIA driver ({type(exc).__name__}: {exc})"
        return query
    version = call("cuDriverGetVersion")
    query.driver_cuda = (version // 1000, version % 1000 // 10)
    attr = driver.CUdevice_attribute
    for i in range(call("cuDeviceGetCount")):
        dev = call("cuDeviceGet", i)
        name = call("cuDeviceGetName", 256, dev)
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        major = call("cuDeviceGetAttribute",
                     attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = call("cuDeviceGetAttribute",
                     attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        memory = call("cuDeviceTotalMem", dev)
        query.devices.append(DeviceInfo(i, name, (int(major), int(minor)), int(memory)))
    return query


def _query_ctypes() -> DeviceQuery:
    query = DeviceQuery(method="ctypes on libcuda (cuda-python is not installed)")
    lib = None
    errors = []
    for candidate in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(candidate)
            break
        except OSError as exc:
            errors.append(str(exc))
    if lib is None:
        query.problem = f"no NVIDIA driver (libcuda could not be loaded: {errors[0]})"
        return query

    def call(fn, *args):
        rc = getattr(lib, fn)(*args)
        if rc != 0:
            raise _DriverCallError(f"{fn} failed with CUresult {rc}")

    try:
        call("cuInit", 0)
    except _DriverCallError as exc:
        query.problem = f"the NVIDIA driver found no usable GPU ({exc})"
        return query
    value, count, dev = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    call("cuDriverGetVersion", ctypes.byref(value))
    query.driver_cuda = (value.value // 1000, value.value % 1000 // 10)
    call("cuDeviceGetCount", ctypes.byref(count))
    for i in range(count.value):
        call("cuDeviceGet", ctypes.byref(dev), i)
        buf = ctypes.create_string_buffer(256)
        call("cuDeviceGetName", buf, 256, dev)
        major, minor, memory = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
        call("cuDeviceGetAttribute", ctypes.byref(major), _CC_MAJOR, dev)
        call("cuDeviceGetAttribute", ctypes.byref(minor), _CC_MINOR, dev)
        call("cuDeviceTotalMem_v2", ctypes.byref(memory), dev)
        query.devices.append(DeviceInfo(i, buf.value.decode(), (major.value, minor.value),
                                        memory.value))
    return query


def query_devices() -> DeviceQuery:
    """List the GPUs without touching ``torch.cuda``."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            query = _query_ctypes()
            if query.problem is None:     # a driver to ask: the supported query helps
                query.notes.append("cuda-python (the supported query) is not installed: "
                                   + INFO_EXTRA_HINT)
            return query
    return _query_cuda_python(driver)


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------

def _caps(spec: BackendSpec) -> str:
    return ", ".join(f"{a}.{b}" for a, b in spec.capabilities) or "any"


def _head_dims(spec: BackendSpec) -> str:
    return ", ".join(f"{k}x{v}" for k, v in spec.head_dims) or "any"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _torch_line() -> str:
    import torch  # the core needs it anyway; reading versions does not initialise CUDA

    cuda = torch.version.cuda
    built = f"CUDA {cuda}" if cuda else "CPU-only build"
    return f"{torch.__version__} ({built})"


def report(*, verbose: bool = False, query: DeviceQuery | None = None) -> tuple[str, int]:
    """The text of ``python -m flash_qla info`` and its exit status.

    The status is 1 when a kernel package is installed but unusable (failed to import,
    or written for another kernel API) or ``FLASH_QLA_BACKEND`` names no installed
    backend, else 0.
    """
    status = 0
    out: list[str] = []
    core_dir = os.path.dirname(os.path.abspath(__file__))
    out.append(f"FlashQLA {dispatch.TORCH_BACKEND.version} (kernel API v{KERNEL_API_VERSION}; "
               f"{core_dir})")
    out.append("")
    out.append("Environment")
    tilelang = _dist_version("tilelang")
    cuda_python = _cuda_python_version()
    specs, failures = dispatch.discover()
    specs = {s.name: s for s in sorted(specs.values(),
                                       key=lambda s: (s.capabilities != (), s.capabilities))}
    forced = os.environ.get(dispatch.ENV_VAR, "").strip()
    if forced and forced not in specs:
        status = 1
        broken = any(failure.name == forced for failure in failures)
        forced += ("  -- that package failed to import (below)" if broken else
                   f"  -- no such backend here (installed: {', '.join(specs)}): every "
                   "CUDA call would raise ValueError")
    out.extend(_table([
        ["Python", f"{platform.python_version()} ({sys.executable})"],
        ["torch", _torch_line()],
        ["TileLang", tilelang or "not installed (the kernel packages install it)"],
        ["cuda-python", cuda_python or f"not installed; {INFO_EXTRA_HINT}"],
        [dispatch.ENV_VAR, forced or "(unset: pick by GPU)"],
    ]))
    query = query if query is not None else query_devices()
    out.append("")
    out.append(f"GPUs (asked through {query.method}; torch.cuda not initialised)")
    out.extend(f"  note: {note}" for note in query.notes)
    if query.driver_cuda is not None:
        major, minor = query.driver_cuda
        warn = ("" if query.driver_cuda >= _MIN_DRIVER_CUDA
                else f"  -- too old: FlashQLA needs CUDA >= {_MIN_DRIVER_CUDA[0]}."
                     f"{_MIN_DRIVER_CUDA[1]}")
        out.append(f"  driver supports CUDA {major}.{minor}{warn}")
    if query.problem is not None:
        out.append(f"  {query.problem}: CPU tensors run on the torch backend")
    elif not query.devices:
        out.append("  the driver lists no GPU: CPU tensors run on the torch backend")
    else:
        rows = []
        for dev in query.devices:
            served = [s for s in specs.values() if dev.capability in s.capabilities]
            use = ", ".join(f"{s.name} ({s.distribution} {s.version})" for s in served)
            rows.append([f"cuda:{dev.index}", dev.name,
                         f"compute capability {dev.capability[0]}.{dev.capability[1]}",
                         f"{dev.memory_bytes / 2**30:.0f} GiB",
                         f"-> {use}" if use else "-> no backend installed"])
        out.extend(_table(rows))

    out.append("")
    out.append(f"Backends (entry-point group {dispatch.ENTRY_POINT_GROUP}, plus the built-in "
               f"torch)")
    rows = [["name", "distribution", "capability", "head dims", "dtypes", "API", "notes"]]
    for spec in specs.values():
        api = str(spec.kernel_api_version)
        if spec.kernel_api_version != KERNEL_API_VERSION:
            api += " (MISMATCH)"
            status = 1
        rows.append([spec.name, f"{spec.distribution} {spec.version}", _caps(spec),
                     _head_dims(spec), ", ".join(spec.dtypes) or "any", api, spec.notes])
    out.extend(_table(rows))
    for spec in specs.values():
        if spec.kernel_api_version != KERNEL_API_VERSION:
            out.append(f"  ! {dispatch._version_error(spec)}")
    for failure in failures:
        status = 1
        out.append(f"  ! BROKEN {failure.describe()}")
        if verbose:
            tb = traceback.format_exception(type(failure.error), failure.error,
                                            failure.error.__traceback__)
            out.extend("      " + line for chunk in tb for line in chunk.rstrip().splitlines())
    if failures and not verbose:
        out.append("    (run with --verbose for the tracebacks)")

    out.append("")
    out.append("What to install")
    installed = {spec.distribution for spec in specs.values()}
    if query.devices:
        for dev in query.devices:
            hint = dispatch.install_hint(dev.capability)
            extra = dispatch.CAPABILITY_EXTRAS.get(dev.capability)
            done = extra is not None and f"flash-qla-{extra}" in installed
            out.append(f"  cuda:{dev.index} ({dev.capability[0]}.{dev.capability[1]}): {hint}"
                       + ("  [installed]" if done else ""))
    else:
        out.append("  no GPU here: nothing more (the torch backend runs on the CPU).")
        out.append("  On a GPU machine: SM90 (H100/H200/H20) "
                   + dispatch.install_hint((9, 0))
                   + "; SM100/SM103 and SM120/SM121 the same with sm100 / sm120 "
                   "(portable kernels, not yet run on Blackwell).")
    return "\n".join(out), status
