"""Greedy decoding with LanguageModel.generate at each level: the demo's decode workload alone
(kernelforge/demo.py, run_decode_workload), with its sizes as options. Per level: the check of the
first decode step's logits, time per decode step (prefill excluded; the prefill's own column), the
rate, and the fraction of the memory-bandwidth limit; then where each level's step runs.

    PYTHONPATH=. python benchmarks/tools/decode_bench.py [--levels native,compile,triton,fastest] [--prompt 512]

--tiny: a two-layer float32 model on the CPU, an 8-token prompt and 4 new tokens, the native level
unless --levels says otherwise (triton adds Triton's interpreter, ~2 s a token): checks the script runs.
"""
from __future__ import annotations

import argparse

import torch

from kernelforge.demo import DEMO_LEVELS, Workload, format_table, run_decode_workload
from kernelforge.models import LanguageModel
from kernelforge.models.decoding import COMPILED_LEVELS, HAND_GRAPHED_LEVELS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", help=f"default {','.join(DEMO_LEVELS)} (--tiny: native)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    args.levels = args.levels or ("native" if args.tiny else ",".join(DEMO_LEVELS))
    if args.tiny:
        args.dtype, args.repeat = "fp32", 1
        args.vocab, args.dim, args.layers, args.heads, args.batch, args.prompt, args.new = 100, 32, 2, 2, 1, 8, 4
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = LanguageModel(args.vocab, args.dim, args.layers, args.heads,
                          max_seq_len=max(2048, args.prompt + args.new)).to(device, dtype).eval()
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), device=device)
    work = Workload("LM decode", model, (prompt,), args.batch, "tok/s", decode_tokens=args.new)
    levels = tuple(args.levels.split(","))
    print(format_table(run_decode_workload(work, levels, device, dtype, args.repeat)))
    for level in levels:
        where = ("a CUDA graph captured by hand" if level in HAND_GRAPHED_LEVELS else
                 "torch.compile(mode='reduce-overhead')'s CUDA graphs" if level in COMPILED_LEVELS else "eager")
        print(f"{level}: the step runs in {where if device.type == 'cuda' else 'eager (no GPU)'}")


if __name__ == "__main__":
    main()
