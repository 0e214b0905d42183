"""TileLang device code of the Hopper backend: one module per quantity computed.

Importing this package imports nothing; each module below imports TileLang. The host
code names the builders through the :class:`Builder` handles at the end of this file,
which import their module on first call: a process whose kernels all come from the
kernel index (``flash_qla_tl.kernel_index``) never imports TileLang's front end.

- ``chunk_cumsum_inverse``: the gate's chunk cumsum and the gate-free per-chunk inverse
  A = (I + strictly_lower(diag(beta) K K^T))^-1 (``chunk_prepare_kernel``);
- ``chunk_state_output``: the forward's recurrence, chunk states h, output o and final
  state in one pass (``chunk_fwd_ws_kernel``; also the states-only recompute of h and
  the bounded segment split's warm-up walks);
- ``chunk_state_grad``: the backward's reverse sweep, the state gradient dS1 at every
  chunk's end and dh0 (``chunk_bwd_dh_ws_kernel``);
- ``chunk_input_grads``: dq, dk, dv, dbeta, dg of every chunk in parallel, given h and
  dS1 (``chunk_bwd_intra_kernel``);
- ``chunk_input_grads_split``: the same on sub-chunks with the state pair split over V,
  for an arch whose shared memory does not hold both states beside a chunk's tiles
  (``chunk_bwd_intra_split_kernel``: SM120);
- ``chunk_grads_fused``: the reverse sweep and every input gradient in one CTA per
  (sequence, value head) (``chunk_bwd_fused_kernel``), the alternative to the two
  kernels above;
- ``group_sum``: the GVA sum of the per-value-head dq, dk (``group_sum_kernel``);
- ``recurrent_step``: the token-by-token recurrence for decode and speculative verify,
  states read from and written to a pool by slot (``recurrent_step_kernel``);
- ``chunk_layout``: the chunk layout of a varlen call and the zeros of its padding
  tokens, from the device offsets (``chunk_layout_kernel``, ``zero_tail_kernel``);
- ``tile_ops``: tile steps the kernels share (TileLang macros); ``traits``: the static
  configuration every compiled kernel is keyed on.

The builders keep the names of their generated CUDA kernels (what a profiler shows).
The host code that launches them is one level up (``flash_qla_tl.forward``,
``flash_qla_tl.backward``); kernels never import it.
"""

from __future__ import annotations

import importlib
from typing import Any


class Builder:
    """A kernel builder named by its module and function, imported on first call.

    ``Builder("chunk_state_output", "chunk_fwd_ws_kernel")(*static)`` is
    ``chunk_state_output.chunk_fwd_ws_kernel(*static)``; ``index_name`` is what the
    kernel index files the variants under."""

    __slots__ = ("module", "function", "index_name", "_builder")

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function
        self.index_name = f"{module}.{function}"
        self._builder = None

    @property
    def __name__(self) -> str:
        return self.function

    def resolve(self):
        """The builder itself (imports its module, and with it TileLang)."""
        if self._builder is None:
            self._builder = getattr(importlib.import_module(f"{__name__}.{self.module}"),
                                    self.function)
        return self._builder

    def __call__(self, *static: Any):
        return self.resolve()(*static)

    def __getattr__(self, name: str):
        # the builder's own attributes (``program``, ``pass_configs``, ``cache_info``)
        if name.startswith("__") or name in Builder.__slots__:
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __repr__(self) -> str:
        return f"Builder({self.index_name})"


chunk_layout_kernel = Builder("chunk_layout", "chunk_layout_kernel")
zero_tail_kernel = Builder("chunk_layout", "zero_tail_kernel")
chunk_prepare_kernel = Builder("chunk_cumsum_inverse", "chunk_prepare_kernel")
chunk_fwd_ws_kernel = Builder("chunk_state_output", "chunk_fwd_ws_kernel")
chunk_bwd_dh_ws_kernel = Builder("chunk_state_grad", "chunk_bwd_dh_ws_kernel")
chunk_bwd_intra_kernel = Builder("chunk_input_grads", "chunk_bwd_intra_kernel")
chunk_bwd_intra_split_kernel = Builder("chunk_input_grads_split", "chunk_bwd_intra_split_kernel")
chunk_bwd_fused_kernel = Builder("chunk_grads_fused", "chunk_bwd_fused_kernel")
group_sum_kernel = Builder("group_sum", "group_sum_kernel")
recurrent_step_kernel = Builder("recurrent_step", "recurrent_step_kernel")
