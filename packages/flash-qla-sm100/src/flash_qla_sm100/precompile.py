"""The kernels this wheel ships compiled for B200 / B300 / GB200 / GB300 (``SHIPPED``,
filled by ``nox -s build``), and ``python -m flash_qla_sm100.precompile DIR [--jobs N]
[--arch sm100,sm103]``, which compiles them (nvcc, no GPU) into the TileLang cache DIR."""

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "kernel_cache"
if __name__ == "__main__":
    from flash_qla_tl.precompile import package_main
    package_main("flash_qla_sm100.arch")
