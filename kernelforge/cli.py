"""The `kernelforge` command: doctor | build | demo | bench | tune | new-op."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the toolchain: versions, GPUs, whether each backend builds and runs")
    sub.add_parser("build", help="build every CUDA extension ahead of time (cached by source hash)")
    demo = sub.add_parser("demo", help="the example models (LM, ViT, GNN) at every optimization level this machine "
                                       "runs: checked against the native level, timed, tabled and plotted")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--out", default="demo-results", help="output directory (default demo-results)")
    demo.add_argument("--levels", default=None,
                      help="comma-separated levels (default the five, native,torchscript,compile,triton,cuda, and "
                           "fastest: torch.compile with kernelforge's kernels in CUDA graphs; also reference: "
                           "kernelforge's ops on their CPU implementations)")
    demo.add_argument("--size", choices=("small", "realistic"), default=None,
                      help="model sizes (default: realistic on a GPU, small on a CPU)")
    demo.add_argument("--repeat", type=int, default=None, help="timed calls per level (default 10 GPU, 3 CPU)")
    demo.add_argument("--workloads", default=None,
                      help="comma-separated workloads (default all: lm-forward,lm-train-step,vit-forward,gnn-forward,"
                           "lm-decode)")
    bench = sub.add_parser("bench", help="benchmark ops against eager, torch.compile and peers; JSON, CSV, Markdown, PNG")
    bench.add_argument("ops", nargs="*", default=["all"], help="op names (see kernelforge.bench.suites) or 'all'")
    bench.add_argument("--dtype", default="bf16,fp32", help="comma-separated: bf16, fp16, fp32 (default bf16,fp32)")
    bench.add_argument("--backend", default=None, help="comma-separated kernelforge backends only, no baselines")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    bench.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    bench.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    bench.add_argument("--crosscheck", action="store_true",
                       help="GPU: also time kernelforge's forward with triton.testing.do_bench, as an extra row")
    bench.add_argument("--compare", nargs=2, metavar=("OLD.json", "NEW.json"),
                       help="print speedups of NEW over OLD and flag regressions beyond noise; exit 1 if any")
    tune = sub.add_parser("tune", help="measure each op's fastest backend per input size on this GPU ahead of time "
                                       "(kernelforge.tuning); show or clear the cache of measurements")
    what = tune.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print the cache: this GPU's entries, the others counted")
    what.add_argument("--clear", action="store_true", help="delete the cache file")
    what.add_argument("--suite", action="append", default=None,
                      help="a benchmark suite whose shapes to run (repeatable; default: every suite of an op that "
                           "opts in to measurement)")
    what.add_argument("--model", choices=("lm", "vit", "gnn"), action="append", default=None,
                      help="an example model (the demo's realistic size) whose forward and backward to run")
    tune.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32 (default bf16)")
    new_op = sub.add_parser("new-op", help="write the files of a new op (reference, Triton, CUDA, op, tests, "
                                           "benchmark) from the templates, with TODOs where the math goes")
    new_op.add_argument("name", help="the op's name, a lower-case identifier (e.g. fused_gelu)")
    new_op.add_argument("--root", default=None, help="the source checkout to write into (default: this one)")
    new_op.add_argument("--force", action="store_true", help="overwrite the op's files if they exist")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from kernelforge.doctor import run_doctor

        return run_doctor(sys.stdout)
    if args.command == "build":
        from kernelforge.doctor import run_build

        return run_build(sys.stdout)
    if args.command == "bench":
        return _bench(args)
    if args.command == "new-op":
        return _new_op(args)
    if args.command == "tune":
        return _tune(args)
    return _demo(args)


def _demo(args) -> int:
    from kernelforge.demo import DEMO_LEVELS, UnknownWorkloadError, run_demo
    from kernelforge.models import LEVELS
    from kernelforge.models.levels import EXTRA_LEVELS

    levels = DEMO_LEVELS if args.levels is None else tuple(args.levels.split(","))
    unknown = [lv for lv in levels if lv not in LEVELS + EXTRA_LEVELS]
    if unknown:
        sys.stderr.write(f"kernelforge demo: unknown level(s) {unknown}; expected some of {LEVELS + EXTRA_LEVELS}\n")
        return 2
    realistic = None if args.size is None else args.size == "realistic"
    only = None if args.workloads is None else args.workloads.split(",")
    try:
        return run_demo(sys.stdout, device=args.device, out_dir=args.out, levels=levels, realistic=realistic,
                        repeat=args.repeat, only=only)
    except UnknownWorkloadError as err:
        sys.stderr.write(f"{err}\n")
        return 2


def _new_op(args) -> int:
    from pathlib import Path

    from kernelforge.scaffold import ScaffoldError, new_op, next_steps, project_root

    root = Path(args.root) if args.root else project_root()
    try:
        written = new_op(args.name, root, force=args.force)
    except ScaffoldError as err:
        sys.stderr.write(f"kernelforge new-op: {err}\n")
        return 2
    sys.stdout.write(next_steps(args.name, written, root))
    return 0


def _tune(args) -> int:
    from kernelforge import tuning

    if args.show:
        sys.stdout.write(tuning.show())
        return 0
    if args.clear:
        existed = tuning.clear()
        sys.stdout.write(f"{'deleted' if existed else 'no cache at'} {tuning.cache_path()}\n")
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("kernelforge tune: no CUDA GPU is visible; backends are measured on a GPU only "
                         "(--show and --clear work anywhere)\n")
        return 2
    if not tuning.enabled():
        sys.stderr.write(f"kernelforge tune: measurement is off ({tuning.ENV_VAR}={os.environ.get(tuning.ENV_VAR)!r})\n")
        return 2
    from kernelforge.tuning_fill import fill_from_models, fill_from_suites

    try:
        if args.model:
            failures = fill_from_models(args.model, args.dtype.split(","), sys.stdout)
        else:
            failures = fill_from_suites(args.suite, args.dtype.split(","), sys.stdout)
    except ValueError as err:
        sys.stderr.write(f"kernelforge tune: {err}\n")
        return 2
    sys.stdout.write(tuning.show())
    return 1 if failures else 0


def _bench(args) -> int:
    import json

    from kernelforge.bench import report

    if args.compare:
        old, new = (json.loads(open(path).read()) for path in args.compare)
        text, regressions = report.compare(old, new)
        sys.stdout.write(text)
        return 1 if regressions else 0

    import torch

    from kernelforge.bench.runner import run_bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backends_only = args.backend.split(",") if args.backend else None
    try:
        result = run_bench(args.ops, args.dtype.split(","), device, quick=args.quick, backends_only=backends_only,
                           progress=sys.stderr, crosscheck=args.crosscheck)
    except ValueError as err:
        sys.stderr.write(f"kernelforge bench: {err}\n")
        return 2
    paths = report.write_results(result, args.out)
    sys.stdout.write(report.markdown(result))
    sys.stdout.write("wrote " + ", ".join(str(p) for p in paths) + "\n")
    failed = [r for r in result["rows"] if "error" in r]
    return 1 if failed and all(r["impl"].startswith("kernelforge") for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
