"""Input checks for every public entry point.

One function per check; each raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape, value or device) whose message names the argument,
what was expected and what was received. Shape vocabulary as in
:mod:`flash_qla.backend` (B, T, Hk, Hv, K, V, N, C).

Deliberately *not* checked (each would cost a pass over the data or a host sync):
finite values, ``g <= 0``, ``beta`` in (0, 1], and the contents of ``cu_seqlens``
while a CUDA graph is being captured. The contents of ``cu_seqlens`` are otherwise
checked, from ``cu_seqlens_cpu`` when given (no sync), else by copying ``cu_seqlens``
to the host (one sync per offsets tensor, :mod:`flash_qla.offsets`). Zero-length
sequences are valid, and so are tokens after ``cu_seqlens[-1]`` (padding: they belong
to no sequence).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

from flash_qla.backend import BackendSpec
from flash_qla.offsets import read_offsets

#: q/k/v dtypes every backend may accept; float64 only on the ``torch`` backend.
QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
#: The backend that also runs float64 (the reference implementation).
FLOAT64_BACKEND = "torch"


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _shape(x: torch.Tensor) -> str:
    return str(list(x.shape))


def check_is_tensor(name: str, x: object, *, optional: bool = False) -> None:
    """``x`` is a tensor (or None when ``optional``)."""
    if x is None and optional:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")


def check_rank(name: str, x: torch.Tensor, layout: str) -> None:
    """``x`` has as many dims as ``layout`` names, e.g. ``"[B, T, Hk, K]"``."""
    rank = layout.count(",") + 1
    if x.dim() != rank:
        raise ValueError(
            f"{name} must be {rank}-D {layout}; got {x.dim()}-D shape {_shape(x)}"
        )


def check_shape(name: str, x: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    """``x.shape`` equals ``expected`` (a rank check first, for a clearer message)."""
    check_rank(name, x, layout)
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {layout} = {list(expected)}; got {_shape(x)}"
        )


def check_qk_shapes(q: torch.Tensor, k: torch.Tensor) -> None:
    """q and k are ``[B, T, Hk, K]`` with the same shape, K >= 1."""
    check_rank("q", q, "[B, T, Hk, K]")
    check_shape("k", k, q.shape, "[B, T, Hk, K] (q's shape)")
    if q.shape[3] == 0:
        raise ValueError(f"q and k need a head dim K >= 1; got K=0 (shape {_shape(q)})")


def check_batch_time(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    """``x`` has q's B and T in its first two dims."""
    if tuple(x.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(
            f"{name} must have q's batch and time dims (B, T) = {tuple(q.shape[:2])}; "
            f"got {tuple(x.shape[:2])} (shape {_shape(x)})"
        )


def check_value_heads(Hk: int, Hv: int) -> None:
    """Hv is a positive multiple of Hk (GVA: value head h reads q/k head h // (Hv/Hk))."""
    if Hk <= 0 or Hv % Hk != 0 or Hv == 0:
        raise ValueError(
            f"v's head count Hv must be a positive multiple of q/k's Hk; "
            f"got Hv={Hv}, Hk={Hk}"
        )


def check_v_shape(v: torch.Tensor, q: torch.Tensor) -> None:
    """v is ``[B, T, Hv, V]`` with q's B, T and Hv a multiple of Hk."""
    check_rank("v", v, "[B, T, Hv, V]")
    check_batch_time("v", v, q)
    check_value_heads(q.shape[2], v.shape[2])
    if v.shape[3] == 0:
        raise ValueError(f"v needs a head dim V >= 1; got V=0 (shape {_shape(v)})")


def check_per_head(name: str, x: torch.Tensor, v: torch.Tensor) -> None:
    """``x`` (g or beta) is ``[B, T, Hv]`` matching v."""
    check_rank(name, x, "[B, T, Hv]")
    check_batch_time(name, x, v)
    check_shape(name, x, v.shape[:3], "[B, T, Hv] (Hv: v's heads)")


def check_qkv_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v share one dtype among bf16/fp16/fp32 (fp64 allowed, see check_backend)."""
    allowed = QKV_DTYPES + (torch.float64,)
    if q.dtype not in allowed:
        raise TypeError(f"q must have dtype in ({_names(allowed)}); got {q.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError("q, k, v must share one dtype; got "
                        f"q={q.dtype}, k={k.dtype}, v={v.dtype}")


def check_gate_dtype(name: str, g: torch.Tensor) -> None:
    """g is fp32 or bf16 (fp64 allowed, see check_backend)."""
    allowed = GATE_DTYPES + (torch.float64,)
    if g.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({_names(allowed)}); got {g.dtype}")


def check_beta_dtype(beta: torch.Tensor, q: torch.Tensor) -> None:
    """beta is in q's dtype or fp32."""
    if beta.dtype not in (q.dtype, torch.float32):
        expected = ("dtype torch.float32 (q's dtype)" if q.dtype == torch.float32
                    else f"q's dtype ({q.dtype}) or torch.float32")
        raise TypeError(f"beta must have {expected}; got {beta.dtype}")


def state_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of states and of the gate cumsum: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def check_state_dtype(name: str, state: torch.Tensor, q: torch.Tensor) -> None:
    """States are fp32 (fp64 when q/k/v are fp64)."""
    expected = state_dtype(q)
    if state.dtype != expected:
        raise TypeError(
            f"{name} must have dtype {expected} (q/k/v are {q.dtype}); got {state.dtype}"
        )


#: Initial-state dtypes for non-fp64 q/k/v (FlashQLA 0.1.3 and SGLang pass q's dtype);
#: the API converts the state to fp32 before the kernels (the recurrence runs in fp32).
INITIAL_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_initial_state_dtype(state: torch.Tensor, q: torch.Tensor) -> None:
    """initial_state is fp32, bf16 or fp16 (fp64, and only fp64, for fp64 q/k/v)."""
    if q.dtype == torch.float64:
        check_state_dtype("initial_state", state, q)
    elif state.dtype not in INITIAL_STATE_DTYPES:
        raise TypeError(
            f"initial_state must have dtype in ({_names(INITIAL_STATE_DTYPES)}) "
            f"(q/k/v are {q.dtype}; it is converted to float32); got {state.dtype}"
        )


def check_same_device(tensors: dict[str, torch.Tensor | None], reference: str = "q") -> None:
    """Every non-None tensor is on ``tensors[reference]``'s device. The error lists every
    tensor's device, so a call whose ``reference`` is the odd one out says so."""
    device = tensors[reference].device
    for name, x in tensors.items():
        if x is not None and x.device != device:
            devices = ", ".join(f"{n} {t.device}" for n, t in tensors.items() if t is not None)
            raise ValueError(
                f"{name} must be on {reference}'s device {device}; got {x.device} "
                f"(devices: {devices})"
            )


def check_cu_seqlens_kind(name: str, cu: torch.Tensor) -> None:
    """``cu`` is a 1-D int32/int64 tensor with at least two entries."""
    check_is_tensor(name, cu)
    if cu.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must have an integer dtype in ({_names(INDEX_DTYPES)}); "
                        f"got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D [N+1] with N >= 1; got shape {_shape(cu)}"
        )


def check_cu_seqlens_batch(B: int) -> None:
    """Packed sequences need a single batch row."""
    if B != 1:
        raise ValueError(f"cu_seqlens requires B == 1 (packed sequences); got B={B}")


def check_cu_seqlens_cpu(cu_seqlens: torch.Tensor | None, cu_cpu: torch.Tensor) -> None:
    """``cu_seqlens_cpu`` is a host copy of ``cu_seqlens`` (same length)."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu was given without cu_seqlens; pass both")
    check_cu_seqlens_kind("cu_seqlens_cpu", cu_cpu)
    if cu_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be on the cpu; got {cu_cpu.device}")
    if cu_cpu.numel() != cu_seqlens.numel():
        raise ValueError(
            f"cu_seqlens_cpu must have cu_seqlens' length {cu_seqlens.numel()}; "
            f"got {cu_cpu.numel()}"
        )


def check_cu_seqlens_values(name: str, values: Sequence[int], T: int) -> None:
    """Starts at 0, non-decreasing (empty sequences allowed), ends at most at T."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0]={values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing; got {name}[{i - 1}]={values[i - 1]} > "
                f"{name}[{i}]={values[i]}"
            )
    if values[-1] > T:
        raise ValueError(
            f"{name}[-1] must be at most T={T} (tokens after it are padding); "
            f"got {values[-1]}"
        )


def is_capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``device``
    (torch.cuda.is_current_stream_capturing's query, called directly: several calls per
    training step)."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


def check_cu_seqlens(
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, q: torch.Tensor,
    *, host_read: bool = False, values: bool = True,
) -> int:
    """All cu_seqlens checks; returns N (sequences). Never syncs during graph capture.
    ``host_read``: ``cu_seqlens_cpu`` is the call's own host copy of ``cu_seqlens``
    (:func:`flash_qla.offsets.host_offsets`), so its values are reported as
    ``cu_seqlens``'. ``values=False``: kinds, shapes and devices only, nothing read
    (a traced call: its custom op checks the values, :mod:`flash_qla.custom_ops`)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            check_cu_seqlens_cpu(None, cu_seqlens_cpu)
        return q.shape[0]
    check_cu_seqlens_kind("cu_seqlens", cu_seqlens)
    check_cu_seqlens_batch(q.shape[0])
    if cu_seqlens_cpu is not None:
        check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
    if not values:
        return cu_seqlens.numel() - 1
    if cu_seqlens_cpu is not None:
        check_cu_seqlens_values("cu_seqlens" if host_read else "cu_seqlens_cpu",
                                cu_seqlens_cpu.tolist(), q.shape[1])
        # the same values where both are on the host (for a device cu_seqlens the check
        # would cost the sync that cu_seqlens_cpu exists to avoid: trusted there)
        if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens.long(),
                                                               cu_seqlens_cpu.long()):
            raise ValueError(f"cu_seqlens_cpu must hold cu_seqlens' values "
                             f"{cu_seqlens.tolist()}; got {cu_seqlens_cpu.tolist()}")
    elif not is_capturing(cu_seqlens.device):
        check_cu_seqlens_values("cu_seqlens", read_offsets(cu_seqlens).tolist(), q.shape[1])
    return cu_seqlens.numel() - 1


def state_layout(v_first: bool) -> str:
    return "[N, Hv, V, K] (v-first)" if v_first else "[N, Hv, K, V]"


def check_state(
    name: str, state: torch.Tensor, q: torch.Tensor, v: torch.Tensor, N: int,
    *, v_first: bool = False, initial: bool = False,
) -> None:
    """A state ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` when v_first) of the right dtype
    (``initial``: the initial state's dtypes, :func:`check_initial_state_dtype`)."""
    layout = state_layout(v_first)
    check_rank(name, state, layout)
    if state.shape[0] != N:
        raise ValueError(
            f"{name} must hold one state per sequence, N={N} (B, or len(cu_seqlens) - 1); "
            f"got N={state.shape[0]} (shape {_shape(state)})"
        )
    Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    check_shape(name, state, (N, Hv, V, K) if v_first else (N, Hv, K, V), layout)
    if initial:
        check_initial_state_dtype(state, q)
    else:
        check_state_dtype(name, state, q)


def check_scale(scale: object) -> None:
    """scale is None or a finite real number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError("scale must be a real number (a float, an int) or None; got "
                        f"{type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (or None for K ** -0.5); got {scale}")


def check_gate_params(
    use_gate_in_kernel: bool, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    v: torch.Tensor,
) -> None:
    """A_log ``[Hv]`` (required) and dt_bias ``[Hv]`` (optional) for the in-kernel gate."""
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(
                    f"{name} is only used with use_gate_in_kernel=True; got "
                    f"use_gate_in_kernel=False and {name} given"
                )
        return
    if A_log is None:
        raise ValueError("A_log is required when use_gate_in_kernel=True; got None")
    Hv = v.shape[2]
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_is_tensor(name, x, optional=name == "dt_bias")
        if x is None:
            continue
        check_shape(name, x, (Hv,), "[Hv]")
        if not x.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")


def check_index(name: str, value: object, expected: str) -> int:
    """``value`` as a Python int (ints, numpy / torch integer scalars; not a bool), else a
    TypeError saying ``{name}: expected {expected}`` and what was received."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} "
                        f"{value!r}") from None


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """``value`` is a bool (or None when optional)."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        kind = "a bool or None" if optional else "a bool"
        cls = type(value)           # numpy's bool type is also named "bool": say whose
        where = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
        raise TypeError(f"{name}: expected {kind}, got {where}{cls.__qualname__} {value!r}")


def check_backend(
    spec: BackendSpec, *, K: int, V: int, dtype: torch.dtype, uses_float64: bool
) -> None:
    """The selected backend runs these head dims and dtypes (``spec.rejection_reason``)."""
    if uses_float64 and spec.name != FLOAT64_BACKEND:
        raise TypeError(
            f"float64 inputs run only on the {FLOAT64_BACKEND!r} backend "
            f"(backend={FLOAT64_BACKEND!r}); the selected backend is {spec.name!r}"
        )
    if dtype == torch.float64:
        return  # the torch backend runs float64 whatever its dtype list says
    reason = spec.rejection_reason(K=K, V=V, dtype_name=str(dtype).replace("torch.", ""))
    if reason is not None:
        raise ValueError(f"backend {spec.name!r} cannot run this call (K={K}, V={V}): {reason}")


def uses_float64(*tensors: torch.Tensor | None) -> bool:
    """Whether any given tensor is float64."""
    return any(x is not None and x.dtype == torch.float64 for x in tensors)


def validate_forward(
    q, k, v, g, beta, *, initial_state, cu_seqlens, cu_seqlens_cpu,
    v_first: bool = False, gate_name: str = "g", host_read: bool = False,
    values: bool = True,
) -> int:
    """Every forward input check, in a fixed order; returns N (sequences).
    ``host_read``, ``values``: see :func:`check_cu_seqlens`. An eager call (``values``)
    whose tensors' types, shapes, dtypes and devices match a call that passed runs only
    the checks of the offsets' values (the others would pass again: :data:`_PASSED`)."""
    key = _signature(values, v_first, gate_name, q, k, v, g, beta, initial_state,
                     cu_seqlens)
    if key is not None and key in _PASSED:
        N = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, host_read=host_read,
                             values=values)
        if (key, N) in _PASSED:
            return N
    N = _validate_forward(q, k, v, g, beta, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          v_first=v_first, gate_name=gate_name, host_read=host_read,
                          values=values)
    if key is not None:
        if len(_PASSED) > 256:                  # bounded: a process sees few signatures
            _PASSED.clear()
        _PASSED.update((key, (key, N)))
    return N


#: Signatures of forward calls that passed :func:`validate_forward` (each with and
#: without the N it passed with: the state's check depends on N).
_PASSED: set = set()


def _signature(values: bool, *parts) -> tuple | None:
    """What the forward checks other than the offsets' values read of a call: each
    tensor's type, shape, dtype and device (None: absent), plus the options; None when
    not an eager call (``values`` False: shapes may be symbolic) or when a part is not a
    tensor (the full checks then say what is wrong)."""
    if not values:
        return None
    key = []
    for x in parts:
        if x is None or isinstance(x, (bool, str)):
            key.append(x)
        elif type(x) is torch.Tensor:
            key.append((x.shape, x.dtype, x.device))
        else:
            return None
    return tuple(key)


def _validate_forward(q, k, v, g, beta, *, initial_state, cu_seqlens, cu_seqlens_cpu,
                      v_first, gate_name, host_read, values) -> int:
    for name, x in (("q", q), ("k", k), ("v", v), (gate_name, g), ("beta", beta)):
        check_is_tensor(name, x)
    check_is_tensor("initial_state", initial_state, optional=True)
    check_is_tensor("cu_seqlens", cu_seqlens, optional=True)
    check_qk_shapes(q, k)
    check_v_shape(v, q)
    check_per_head(gate_name, g, v)
    check_per_head("beta", beta, v)
    check_qkv_dtypes(q, k, v)
    check_gate_dtype(gate_name, g)
    check_beta_dtype(beta, q)
    check_same_device({"q": q, "k": k, "v": v, gate_name: g, "beta": beta,
                       "initial_state": initial_state, "cu_seqlens": cu_seqlens})
    N = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, host_read=host_read, values=values)
    if initial_state is not None:
        check_state("initial_state", initial_state, q, v, N, v_first=v_first, initial=True)
    return N


def validate_backward_extras(q, v, g, A, do, dht, N: int, chunk: int) -> None:
    """Checks of the inputs only the low-level backward takes (g is the gate cumsum; A
    the forward's ``[B, T, Hv, chunk]`` inverse in q's dtype)."""
    for name, x in (("A", A), ("do", do)):
        check_is_tensor(name, x)
    check_is_tensor("dht", dht, optional=True)
    if g.dtype != state_dtype(q):
        raise TypeError(
            f"g (the forward's gate cumsum) must have dtype {state_dtype(q)}; got {g.dtype}"
        )
    check_rank("A", A, "[B, T, Hv, C]")
    check_shape("A", A, (*v.shape[:3], chunk), "[B, T, Hv, C]")       # C: the chunk
    if A.dtype != q.dtype:
        raise TypeError(f"A (the forward's inverse) must have q's dtype {q.dtype}; "
                        f"got {A.dtype}")
    check_shape("do", do, v.shape, "[B, T, Hv, V] (v's shape)")
    if do.dtype != q.dtype:
        raise TypeError(f"do must have q's dtype {q.dtype}; got {do.dtype}")
    check_same_device({"q": q, "A": A, "do": do, "dht": dht})
    if dht is not None:
        check_state("dht", dht, q, v, N)
