"""Greedy decoding with LanguageModel.generate at each level: the demo's decode workload alone
(kernelforge/demo.py, run_decode_workload), with its sizes as options. Per level: the check of the
first decode step's logits, time per decode step (prefill excluded; the prefill's own column), the
rate, and the fraction of the memory-bandwidth limit; then where each level's step runs.

    PYTHONPATH=. python benchmarks/decode_bench.py [--levels native,compile,triton,fastest] [--prompt 512]
"""
from __future__ import annotations

import argparse

import torch

from kernelforge.demo import DEMO_LEVELS, Workload, format_table, run_decode_workload
from kernelforge.models import LanguageModel
from kernelforge.models.decoding import COMPILED_LEVELS, HAND_GRAPHED_LEVELS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(DEMO_LEVELS))
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
