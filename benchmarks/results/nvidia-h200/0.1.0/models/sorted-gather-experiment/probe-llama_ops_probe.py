"""Probe: where the kf-patched Llama step's copies, casts and cats come from (torch.profiler, shapes and stacks)."""
import sys, torch
sys.path.insert(0, "benchmarks/tools")
from torch.profiler import profile, ProfilerActivity
import hf_train_step as h
import kernelforge as kf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
model, ids = h.build("llama", sys.argv[1] if len(sys.argv) > 1 else "1b", torch.device(DEV), torch.bfloat16 if DEV == "cuda" else torch.float32)
kf.patch(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3): step()
(torch.cuda.synchronize() if DEV == "cuda" else None)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as p:
    step(); (torch.cuda.synchronize() if DEV == "cuda" else None)
for key in ("aten::cat", "aten::copy_", "aten::add", "aten::mul", "aten::to", "aten::clone", "aten::contiguous", "aten::zero_", "aten::fill_"):
    rows = [e for e in p.key_averages(group_by_input_shape=True, group_by_stack_n=6) if e.key == key]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(f"== {key}: {total/1e3:.2f} ms device in one step, {sum(e.count for e in rows)} calls")
    for e in rows[:6]:
        stack = " < ".join(s.split("(")[0].rsplit("/", 1)[-1] + "(" + s.split("(")[-1] for s in e.stack[:6]) if e.stack else "-"
        print(f"   {e.device_time_total/1e3:7.3f} ms x{e.count:3d} {str(e.input_shapes)[:90]}\n        {stack[:300]}")
