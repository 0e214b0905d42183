"""``python -m flash_qla_sm120.precompile DIR [--jobs N] [--arch sm120,sm121]``: the
kernels of the RTX 50xx / RTX PRO 6000 / DGX Spark wheel (the decode step so far) into
the TileLang cache DIR (nvcc, no GPU); ``SHIPPED`` is where the wheel keeps them."""

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "kernel_cache"
if __name__ == "__main__":
    from flash_qla_tl.precompile import package_main
    package_main("flash_qla_sm120.arch")
