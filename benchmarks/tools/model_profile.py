"""Where the example models spend GPU time at each level: the demo's realistic workloads
(kernelforge/demo.py) under torch.profiler, device time summed per kernel family and the top
kernels per level. Explains the demo's rows (which kernels a level is slower or faster in).
"LM decode" is profiled one decode step at a time (after a prefill of the demo's prompt, on the
step's CUDA graph where the level graphs it): the kernels a token costs, against the bandwidth
limit the demo's decode row reports.

    python benchmarks/tools/model_profile.py [--workloads "LM train step,ViT forward"] [--levels native,triton]
    python benchmarks/tools/model_profile.py --workloads "LM decode" --levels native,compile,fastest

--device cpu profiles the small workloads' CPU ops instead (what the CPU test runs). --tiny: the
small GNN forward at the native level on the CPU, one profiled call: checks the script runs.
"""
from __future__ import annotations

import argparse
import copy
import re
from collections import defaultdict
from typing import Callable

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


WARMUP = 3  # calls before the profiled ones: compiles, traces, autotunes, captures


def _decode_step(work, model) -> Callable[[], None]:
    """One greedy decode step a call, after a prefill of the workload's prompt."""
    (prompt,) = work.inputs
    decoder = model.decoder(prompt.shape[0], prompt.shape[1] + work.decode_tokens, prompt.dtype, prompt.device)
    token = decoder.prefill(prompt).argmax(-1, keepdim=True)

    def step():
        nonlocal token
        token = decoder.step(token).argmax(-1, keepdim=True)
    return step


def profile_level(work, level: str, steps: int, top: int) -> tuple[dict, list]:
    model = copy.deepcopy(work.model).set_level(level)
    if work.decode_tokens and steps + WARMUP > work.decode_tokens:
        raise ValueError(f"{work.name}: {steps} profiled steps and {WARMUP} warm-up ones exceed its "
                         f"{work.decode_tokens} decode tokens")
    call = _decode_step(work, model) if work.decode_tokens else _runner(work, model)
    on_gpu = next(model.parameters()).is_cuda
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(WARMUP):
        call()
    sync()
    device_type = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
        sync()
    per_kernel = defaultdict(float)
    for event in prof.events():
        if event.device_type == device_type:
            per_kernel[event.name] += event.time_range.elapsed_us() / steps / 1e3  # ms per call
    per_family = defaultdict(float)
    for name, ms in per_kernel.items():
        per_family[family(name)] += ms
    return per_family, sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="LM train step,ViT forward,GNN forward")
    parser.add_argument("--levels", default="native,compile,triton,cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="kernels listed per level")
    parser.add_argument("--device", default="cuda", help="cuda (realistic sizes, bf16) or cpu (small, float32)")
    parser.add_argument("--tiny", action="store_true", help="one small workload on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device, args.workloads, args.levels, args.steps, args.top = "cpu", "GNN forward", "native", 1, 3
    torch.manual_seed(0)
    wanted = args.workloads.split(",")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    for work in workloads(device, dtype, realistic=on_gpu):
        if work.name not in wanted:
            continue
        unit = "decode step" if work.decode_tokens else "call"
        print(f"\n## {work.name}: {'GPU' if on_gpu else 'CPU'} ms per {unit} by kernel family")
        results = {level: profile_level(work, level, args.steps, args.top) for level in args.levels.split(",")}
        families = sorted({f for fams, _ in results.values() for f in fams})
        print("| family | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
        for fam in families + ["total"]:
            cells = [sum(fams.values()) if fam == "total" else fams.get(fam, 0.0) for fams, _ in results.values()]
            print(f"| {fam} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        for level, (_, top) in results.items():
            print(f"\n{work.name} / {level}: top kernels, ms per {unit}")
            for name, ms in top:
                print(f"  {ms:8.3f}  {name[:110]}")
        del results


if __name__ == "__main__":
    main()
