"""The `kernelforge` command: doctor | build | demo."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the toolchain: versions, GPUs, whether each backend builds and runs")
    sub.add_parser("build", help="build every CUDA extension ahead of time (cached by source hash)")
    demo = sub.add_parser("demo", help="softmax on the best device here, checked against the reference and timed")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from kernelforge.doctor import run_doctor

        return run_doctor(sys.stdout)
    if args.command == "build":
        from kernelforge.doctor import run_build

        return run_build(sys.stdout)
    from kernelforge.demo import run_demo

    return run_demo(sys.stdout, device=args.device)


if __name__ == "__main__":
    sys.exit(main())
