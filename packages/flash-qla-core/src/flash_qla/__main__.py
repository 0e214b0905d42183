"""Command line: ``python -m flash_qla info``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog or "flash-qla",
        description="FlashQLA: Gated DeltaNet chunked prefill kernels.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser(
        "info",
        help="GPUs, installed kernel backends, versions, and what to install",
        description="List the GPUs (through cuda-python, without initialising torch.cuda), "
                    "the kernel backends found and their versions, the TileLang/torch/CUDA "
                    "versions, and what to install for the GPUs found. Exits 1 when a "
                    "kernel package is installed but unusable.",
    )
    info.add_argument("-v", "--verbose", action="store_true",
                      help="show the tracebacks of kernel packages that failed to import")
    args = parser.parse_args(argv)

    if args.command == "info":
        from flash_qla.info import report

        text, status = report(verbose=args.verbose)
        print(text)
        return status
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main(prog="python -m flash_qla"))
