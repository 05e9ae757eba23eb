"""Where the example models spend GPU time at each level: the demo's realistic workloads
(kernelforge/demo.py) under torch.profiler, device time summed per kernel family and the top
kernels per level. Explains the demo's rows (which kernels a level is slower or faster in).

    python benchmarks/model_profile.py [--workloads "LM train step,ViT forward"] [--levels native,triton]
"""
from __future__ import annotations

import argparse
import copy
import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kernelforge.demo import _runner, workloads

FAMILIES = [  # first match wins; names of cuBLAS, cuDNN, FlashAttention, Triton and our CUDA kernels
    ("attention", re.compile(r"flash|fmha|attn|attention|decode|dkdv|dq_kernel|backward_delta", re.I)),
    ("gemm", re.compile(r"gemm|matmul|nvjet|xmma|cutlass|sm90_|_mm_|wgmma", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("softmax / loss", re.compile(r"softmax|nll|cross_entropy|log_softmax|loss", re.I)),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor", re.I)),
    ("gather / scatter", re.compile(r"index|scatter|gather", re.I)),
]


def family(name: str) -> str:
    return next((fam for fam, pattern in FAMILIES if pattern.search(name)), "other elementwise / copies")


def profile_level(work, level: str, steps: int, top: int) -> tuple[dict, list]:
    model = copy.deepcopy(work.model).set_level(level)
    call = _runner(work, model)
    for _ in range(3):  # warm-up: compiles, traces, autotunes
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.time_range.elapsed_us() / steps / 1e3  # ms per call
    per_family = defaultdict(float)
    for name, ms in per_kernel.items():
        per_family[family(name)] += ms
    return per_family, sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="LM train step,ViT forward,GNN forward")
    parser.add_argument("--levels", default="native,compile,triton,cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="kernels listed per level")
    args = parser.parse_args()
    torch.manual_seed(0)
    wanted = args.workloads.split(",")
    for work in workloads(torch.device("cuda"), torch.bfloat16, realistic=True):
        if work.name not in wanted:
            continue
        print(f"\n## {work.name}: GPU ms per call by kernel family")
        results = {level: profile_level(work, level, args.steps, args.top) for level in args.levels.split(",")}
        families = sorted({f for fams, _ in results.values() for f in fams})
        print("| family | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
        for fam in families + ["total"]:
            cells = [sum(fams.values()) if fam == "total" else fams.get(fam, 0.0) for fams, _ in results.values()]
            print(f"| {fam} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        for level, (_, top) in results.items():
            print(f"\n{work.name} / {level}: top kernels, ms per call")
            for name, ms in top:
                print(f"  {ms:8.3f}  {name[:110]}")
        del results


if __name__ == "__main__":
    main()
