"""FlashQLA: Gated DeltaNet chunked prefill (forward and backward) for PyTorch.

``chunk_gated_delta_rule`` is the differentiable, FLA-compatible entry point;
``chunk_gated_delta_rule_fwd`` / ``chunk_gated_delta_rule_bwd`` are the low-level pair.
Importing this package needs no GPU and no TileLang, and loads no backend: kernel
backends are discovered on the first call (see :mod:`flash_qla.backend`).
"""

from importlib.metadata import PackageNotFoundError, version

from flash_qla import custom_ops, utils  # noqa: F401  (custom_ops: registers torch.ops.flash_qla)
from flash_qla.api import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_bwd,
    chunk_gated_delta_rule_fwd,
)
from flash_qla.recurrent import fused_recurrent_gated_delta_rule

try:
    __version__ = version("flash-qla")
except PackageNotFoundError:  # running from a source tree, not installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_bwd",
    "chunk_gated_delta_rule_fwd",
    "fused_recurrent_gated_delta_rule",
    "utils",
]

#: FlashQLA 0.1.3 names (the earlier ``flash-qla``) not provided here -> what to use.
NOT_PROVIDED = {
    "ops": (
        "flash_qla.ops (FlashQLA 0.1.3's internal module tree) is not part of this "
        "package: import chunk_gated_delta_rule, chunk_gated_delta_rule_fwd and "
        "chunk_gated_delta_rule_bwd from flash_qla itself, and the helpers (l2norm, pack, "
        "unpack, prepare_chunk_indices, ...) from flash_qla.utils"),
}


def __getattr__(name: str):
    """FlashQLA 0.1.3 names in :data:`NOT_PROVIDED` raise an ImportError naming the
    replacement (also for ``from flash_qla import ops``)."""
    if name in NOT_PROVIDED:
        raise ImportError(NOT_PROVIDED[name], name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
