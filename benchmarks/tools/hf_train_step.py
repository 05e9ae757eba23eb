"""A transformers model's training step with kernelforge, Liger-Kernel or neither, with and without
torch.compile: wall clock per step (forward, loss, backward, AdamW), peak memory, first loss.

    PYTHONPATH=. python benchmarks/tools/hf_train_step.py [--model llama] [--size 1b] [--variants eager,kf,liger]

--model: the architecture, at a real checkpoint's shape with --size 1b (random init, batch 4 x 2048
tokens, bf16, tied embeddings):
    llama    Llama-3.2-1B: hidden 2048, 16 layers, 32 heads over 8 kv heads, SwiGLU 8192, 128256 classes
    qwen3    Qwen3-1.7B: hidden 2048, 28 layers, 16 heads over 8 kv heads (q / k norms), SwiGLU 6144,
             151936 classes
    gemma3   Gemma-3-1B: hidden 1152, 26 layers, 4 heads of 256 over 1 kv head (q / k norms, a 512-token
             sliding window in five layers of six), GeGLU (tanh) 6912, 262144 classes, (1 + w) norms
--size tiny: a few-layer model of the same family on the CPU. --dtype amp: float32 weights, the
forward and loss under torch.autocast(bfloat16) (mixed-precision training as most scripts run it).
--profile-dir DIR: a table of device time per kernel over two more steps of each variant into DIR,
and where the device sat idle in them (benchmarks/tools/timeline_gaps.py). --memory-dir DIR (a GPU):
what is alive at the timed steps' peak, from the allocator's history recorded over them
(benchmarks/tools/memory_peak.py; the recording costs host time: those step times compare with
nothing). Each timed step's peak memory is in the JSON (peak_mib_per_step). --tiny: --size tiny on
the CPU in float32, one timed step of kf
(unless --variants says otherwise). Variants (each in a process of its own: Liger's patch
changes transformers' classes for the whole process, kf.patch changes nothing global):
    eager            the model as transformers builds it
    kf               kf.patch(model)
    liger            Liger-Kernel's apply_liger_kernel_to_<family>(model=model)
    <any>+compile    then torch.compile(model)
Each variant's first loss is printed: the same initialization and batch give the same loss.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# Run as a file (as each variant's child process is), the repository root is not on the path:
# added so that `benchmarks.tools.timeline_gaps` imports.
REPO_ROOT = str(Path(__file__).resolve().parents[2])
if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)

# (transformers config class, model class, Liger's patch, the config at --size 1b, tiny's changes)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama",
              dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1000)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3",
              dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0),
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=1000)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "apply_liger_kernel_to_gemma3_text",
               dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                    rope_theta=1000000.0),
               dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16, vocab_size=1000, sliding_window=16)),
}
SIZES = {"1b": dict(batch=4, seq=2048), "tiny": dict(batch=2, seq=32)}
VARIANTS = ("eager", "compile", "kf", "kf+compile", "liger", "liger+compile")


def build(model_name: str, size: str, device: torch.device, dtype: torch.dtype):
    """The model (seed 0) and one batch of input_ids (the labels too)."""
    import transformers

    config_class, model_class, _, shape, tiny = MODELS[model_name]
    shape = dict(shape, **(tiny if size == "tiny" else {}))
    batch, seq = SIZES[size]["batch"], SIZES[size]["seq"]
    config = getattr(transformers, config_class)(**shape, max_position_embeddings=max(seq, 128),
                                                 tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:  # initialized where it runs: a 1B model's random init takes ~20 s on the host
        model = getattr(transformers, model_class)(config).to(dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, ids


def run_variant(variant: str, model_name: str, size: str, steps: int, device: torch.device, dtype: torch.dtype,
                profile_dir: str | None = None, amp: bool = False, memory_dir: str | None = None) -> dict:
    """One variant's step time (median of `steps` after two warm-up steps), peak memory, first loss.
    amp: float32 weights, the forward and loss under torch.autocast(bfloat16)."""
    model, ids = build(model_name, size, device, dtype)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)
    base, _, compiled = variant.partition("+")
    if base == "compile":  # torch.compile alone
        base, compiled = "eager", "compile"
    note = ""
    if base == "kf":
        import kernelforge as kf

        replaced = kf.patch(model)
        note = f"{len(replaced)} modules replaced, {len(replaced.skipped)} skipped"
    elif base == "liger":
        liger = importlib.import_module("liger_kernel.transformers")
        getattr(liger, MODELS[model_name][2])(model=model)
    elif base != "eager":
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        with autocast:
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = float(step())
    step()
    times, peaks = [], []  # each timed step's time and its peak memory (MiB)
    memory = contextlib.nullcontext([])
    if memory_dir and device.type == "cuda":
        from benchmarks.tools.memory_peak import recording

        memory = recording(device)
    with memory as memory_report:
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            peaks.append(torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else float("nan"))
    if profile_dir:
        _profile(step, f"{model_name}-{variant}", profile_dir)
    if memory_report:
        path = Path(memory_dir) / f"{model_name}-{variant}-memory.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{model_name} {variant}: the {steps} timed steps (under the allocator's recording)\n"
                        f"{memory_report[0]}")
    return dict(variant=variant, step_ms=sorted(times)[len(times) // 2] * 1e3, peak_mib=max(peaks),
                peak_mib_per_step=peaks, first_loss=first, note=note)


def _profile(step, variant: str, directory: str) -> None:
    """Device time per kernel over two steps (torch.profiler), the largest first, into
    <directory>/<variant>-profile.txt."""
    import os

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.tools.timeline_gaps import idle_report

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{variant}-profile.txt"), "w") as f:
        f.write(f"{variant}: two train steps\n{table}\n")
    with open(os.path.join(directory, f"{variant}-idle.txt"), "w") as f:
        f.write(f"{variant}: two train steps, where the device waits\n{idle_report(prof)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=tuple(MODELS), default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="1b")
    parser.add_argument("--variants", help=f"default {','.join(VARIANTS)} (--tiny: kf)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "amp"), default="bf16",
                        help="amp: float32 weights, forward and loss under torch.autocast(bfloat16)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one variant, run in this process
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--profile-dir", help="also profile two steps of each variant: a kernel table a variant here")
    parser.add_argument("--memory-dir",
                        help="a GPU: what is alive at the timed steps' peak, a variant here (slows the steps)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    args.variants = args.variants or ("kf" if args.tiny else ",".join(VARIANTS))
    if args.tiny:
        args.size, args.device, args.steps = "tiny", "cpu", 1
        args.dtype = "amp" if args.dtype == "amp" else "fp32"
    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.child:
        print(json.dumps(run_variant(args.child, args.model, args.size, args.steps, device, dtype, args.profile_dir,
                                     amp=args.dtype == "amp", memory_dir=args.memory_dir)))
        return 0
    # each variant's row as soon as it is measured (a run cut off by a time limit keeps what it has)
    print(f"transformers {args.model}, size {args.size}, {args.dtype}, {device}: train step (forward, loss, backward, "
          "AdamW)")
    print(f"{'variant':16} {'step ms':>9} {'vs eager':>9} {'peak MiB':>9} {'first loss':>11}  note", flush=True)
    results, eager = [], None
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--child", variant, "--model", args.model, "--size", args.size,
                   "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype]
        command += ["--profile-dir", args.profile_dir] if args.profile_dir else []
        command += ["--memory-dir", args.memory_dir] if args.memory_dir else []
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            results.append(dict(variant=variant, error=tail[0]))
            print(f"{variant:16} failed: {tail[0]}", flush=True)
        else:
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            eager = r["step_ms"] if variant == "eager" else eager
            ratio = f"{eager / r['step_ms']:.2f}x" if eager else "-"
            print(f"{variant:16} {r['step_ms']:9.2f} {ratio:>9} {r['peak_mib']:9.0f} {r['first_loss']:11.5f}  "
                  f"{r['note']}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
