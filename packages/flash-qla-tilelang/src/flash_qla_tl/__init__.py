"""FlashQLA's TileLang kernels and the host code that launches them, for every arch.

The arch packages (``flash_qla_sm90``, ``flash_qla_sm100``, ``flash_qla_sm120``) hold
only what differs between GPUs: their :class:`flash_qla_tl.arch.Arch` instances, fitted
constants, the ``flash_qla.backends`` entry point and their shipped kernel caches.
Importing this package imports nothing (no TileLang).

The package, by role (each module imports only those above it):

- ``arch``: :class:`~flash_qla_tl.arch.Arch`, the static traits of a target (no TileLang);
- ``kernels/``: TileLang device code, one module per quantity computed (its
  ``__init__`` lists them), and ``traits``, the configuration shared by every arch;
- ``kernel_index``, ``launch``: one launcher per compiled kernel configuration, loaded
  from the kernel index where it has it;
- ``layout``: shared host helpers (the chunk layout and padding zeros, which it
  launches; packing, dtype names, chunk counts);
- ``plan``: every per-call choice (state keeping, segment split, fused or two-kernel
  backward), returned with its reason;
- ``forward``, ``backward``: the orchestrators that launch the kernels;
- ``recurrent``: the token-by-token decode step (``flash_qla.recurrent``);
- ``precompile``: the kernels a wheel ships compiled, and the shipped cache;
- ``backend``: the :class:`flash_qla.backend.Kernels` the core calls.
"""
