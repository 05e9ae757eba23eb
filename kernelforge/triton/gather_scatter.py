"""Triton gather-scatter (message passing's sum / mean aggregation) and its launchers.

    out[i, :] = sum over the edges e with dst[e] == i of x[src[e], :]   (mean: / max(1, deg(i)))

on (rows, features) views with unit feature stride. Unfused, torch writes the (E, F) messages
(index_select) and reads them back (index_add_); here every message goes straight from x's row
into the accumulator, the pattern of Inductor's fused scatter (measured ~6x index_select +
index_add_ on our GPU; this kernel's timings: kernelforge.bench.message_passing_suites).

Three kernels, in launch order:
  _in_degree_kernel   (backward of the mean only) deg[dst[e]] += 1 with float32 atomics.
  _gather_scatter_kernel  a 2-D grid over (edge blocks, feature blocks): each program loads
      BLOCK_E source and destination ids, gathers those BLOCK_E x BLOCK_F tiles of x (masked),
      and tl.atomic_add's them in float32 into acc[dst] (a zero-initialised (num_nodes, F)
      float32 buffer). For the mean forward the feature-block-0 programs also add 1.0 per edge
      into deg[dst]; for the mean backward each gathered row is divided by its node's in-degree.
  _finish_kernel      acc -> out in x's dtype, divided by max(1, deg) for the mean. For float32
      x the accumulator is the output: the sum skips this launch, the mean divides in place.
The backward of either reduction is the same kernel with the roles swapped (gather grad_out at
dst, scatter into src): grad_x[src[e]] += grad_out[dst[e]] (/ deg(dst[e])).

Not deterministic: float32 atomics add in whatever order the programs reach them, so the sums'
roundings (not their values' meaning) differ from run to run. kernelforge.ops.gather_scatter
refuses this backend while torch.use_deterministic_algorithms is on (the reference runs then).
Indices are not checked: an out-of-range id reads or writes out of bounds, undefined behaviour,
as in torch's CUDA index_add_ (the reference raises; the GNN model checks ranges on the host).
int32 ids are widened to int64 before they scale a row stride (N * F may exceed 2^31).

Launchers run on the current CUDA stream of the input's device (Triton's launcher asks torch for
it), and on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernelforge.triton._launch import cdiv, launch, next_power_of_2, on_device
from kernelforge.triton.masks import block_and_scalar

# CUDA caps a grid's second dimension at 65535: wider feature ranges loop over feature blocks.
MAX_GRID_Y = 65535
# Elements one program of _gather_scatter_kernel moves (BLOCK_E x BLOCK_F): 16 edges x 128
# features for wide rows, more edges a program for narrow ones, 8 elements a thread at 8 warps.
# Each element holds two 64-bit addresses (its gather and its atomic) besides its value: ptxas
# (sm_90a, Triton 3.6) gives 64-80 registers a thread at 8 elements, 215-238 at 32 (4096 at 4
# warps), which would leave two programs an SM to hide the gathers' latency. A sweep of block
# shapes on the H200 found these within 4% of the best (kernelforge.bench.message_passing_suites).
TILE_ELEMS = 2048
MAX_BLOCK_F = 128
MIN_BLOCK_E, MAX_BLOCK_E = 16, 2048
NUM_WARPS = 8
# _finish_kernel and _in_degree_kernel: elements (ids) a program, at 4 warps.
FINISH_BLOCK = 1024
DEGREE_BLOCK = 1024
SMALL_NUM_WARPS = 4


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _in_degree_kernel(idx_ptr, deg_ptr, n_edges, BLOCK: tl.constexpr):
    """deg[idx[e]] += 1 for every edge. Bytes: E ids read, E float32 atomics (in L2) on a
    (num_nodes,) buffer; FLOPs: E adds."""
    edges = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = edges < n_edges
    idx = tl.load(idx_ptr + edges, mask=mask, other=0).to(tl.int64)
    tl.atomic_add(deg_ptr + idx, tl.full([BLOCK], 1.0, tl.float32), mask=mask, sem="relaxed")


@triton.jit
def _gather_scatter_kernel(
    inp_ptr, gather_ptr, scatter_ptr, acc_ptr, deg_ptr,
    n_edges, n_cols, inp_row_stride, acc_row_stride,
    COUNT: tl.constexpr, SCALE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """acc[scatter[e], f] += inp[gather[e], f] (/ max(1, deg[gather[e]]) when SCALE) for the
    program's BLOCK_E edges and its feature blocks; COUNT: deg[scatter[e]] += 1 as well.

    Bytes per call: E * F * element gathered from inp (whole row segments, coalesced along f),
    E * F float32 atomics into acc (resolved in L2; acc's num_nodes * F * 4 bytes reach DRAM
    once where it fits L2, more where it does not), 2 ids an edge per feature block (re-reads hit
    L2), E * 4 bytes of degrees read (SCALE) or E atomics (COUNT). FLOPs: E * F adds, plus E * F
    multiplies and E divisions for SCALE."""
    edges = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = edges < n_edges
    # ids widened to int64 before they scale a row stride: N * F may exceed 2^31
    g = tl.load(gather_ptr + edges, mask=e_mask, other=0).to(tl.int64)
    s = tl.load(scatter_ptr + edges, mask=e_mask, other=0).to(tl.int64)
    if COUNT:  # once per edge: by the programs of feature block 0 only
        tl.atomic_add(deg_ptr + s, tl.full([BLOCK_E], 1.0, tl.float32),
                      mask=block_and_scalar(e_mask, tl.program_id(1) == 0),
                      sem="relaxed")
    if SCALE:
        inv_deg = 1.0 / tl.maximum(tl.load(deg_ptr + g, mask=e_mask, other=1.0), 1.0)
    src_rows = inp_ptr + g[:, None] * inp_row_stride
    dst_rows = acc_ptr + s[:, None] * acc_row_stride
    cols = tl.arange(0, BLOCK_F)
    # One pass for grids that cover the features; a feature-block stride where they cannot
    # (more than MAX_GRID_Y blocks).
    for start in range(tl.program_id(1) * BLOCK_F, n_cols, tl.num_programs(1) * BLOCK_F):
        f = start + cols
        mask = e_mask[:, None] & (f < n_cols)[None, :]
        rows = tl.load(src_rows + f[None, :], mask=mask, other=0.0).to(tl.float32)
        if SCALE:
            rows = rows * inv_deg[:, None]
        # relaxed: nothing else is ordered against these adds (acq_rel, the default, adds fences)
        tl.atomic_add(dst_rows + f[None, :], rows, mask=mask, sem="relaxed")


@triton.jit
def _finish_kernel(acc_ptr, out_ptr, deg_ptr, numel, n_cols, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """out = acc (/ max(1, deg[row]) for the mean), rounded to out's dtype; acc and out dense
    (num_nodes, F), possibly the same buffer. Bytes: num_nodes * F * (4 read + element written),
    plus num_nodes * 4 of degrees (read F times, from L1/L2); FLOPs: num_nodes * F divisions."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    if MEAN:
        acc = acc / tl.maximum(tl.load(deg_ptr + offs // n_cols, mask=mask, other=1.0), 1.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch configs
@dataclass(frozen=True)
class Config:
    """One launch of _gather_scatter_kernel: BLOCK_E edges x BLOCK_F features a program."""

    block_e: int
    block_f: int
    num_warps: int = NUM_WARPS


def default_config(n_cols: int) -> Config:
    # Under torch.compile's dynamic shapes n_cols is a SymInt: a count of at least MAX_BLOCK_F only
    # adds a guard; a smaller one is specialized, as its tile must be.
    block_f = MAX_BLOCK_F if n_cols >= MAX_BLOCK_F else next_power_of_2(int(n_cols))
    return Config(max(MIN_BLOCK_E, min(MAX_BLOCK_E, TILE_ELEMS // block_f)), block_f)


# ----------------------------------------------------------------------------- launchers
def _aggregate(inp: torch.Tensor, gather: torch.Tensor, scatter: torch.Tensor, rows: int, mean: bool,
               backward: bool, config: Optional[Config]) -> torch.Tensor:
    """(rows, F) in inp's dtype: acc[scatter[e]] += inp[gather[e]], the forward (gather = src,
    scatter = dst, the mean counting the in-degree on the way) and the backward (gather = dst,
    scatter = src, the mean dividing each gathered row by its node's in-degree)."""
    n_edges, n_cols = gather.shape[0], inp.shape[1]
    if rows == 0 or n_cols == 0:
        return torch.empty((rows, n_cols), dtype=inp.dtype, device=inp.device)
    if n_edges == 0:
        return torch.zeros((rows, n_cols), dtype=inp.dtype, device=inp.device)
    cfg = config or default_config(n_cols)
    gather, scatter = gather.contiguous(), scatter.contiguous()  # the kernels step through ids with stride 1
    acc = torch.zeros((rows, n_cols), dtype=torch.float32, device=inp.device)
    # the kernels touch deg for the mean only; elsewhere an input stands in, never a written tensor
    # (traced by torch.compile, a written tensor passed twice could be taken for two outputs)
    deg = inp
    if mean:
        # the in-degree of the forward's destination nodes (the forward's output rows, the
        # backward's input rows): counted by the forward kernel on its way, by a launch of its
        # own before the backward's, whose gathered rows need it from the start
        deg = torch.zeros(inp.shape[0] if backward else rows, dtype=torch.float32, device=inp.device)
    with on_device(inp):
        if mean and backward:
            launch(_in_degree_kernel, (cdiv(n_edges, DEGREE_BLOCK),), gather, deg, n_edges, BLOCK=DEGREE_BLOCK,
                   num_warps=SMALL_NUM_WARPS)
        grid = (cdiv(n_edges, cfg.block_e), min(MAX_GRID_Y, cdiv(n_cols, cfg.block_f)))
        launch(
            _gather_scatter_kernel, grid,
            inp, gather, scatter, acc, deg, n_edges, n_cols, inp.stride(0), acc.stride(0),
            COUNT=mean and not backward, SCALE=mean and backward, BLOCK_E=cfg.block_e, BLOCK_F=cfg.block_f,
            num_warps=cfg.num_warps,
        )
        finish_mean = mean and not backward  # the backward's rows came divided already
        if inp.dtype == torch.float32 and not finish_mean:
            return acc
        out = acc if inp.dtype == torch.float32 else torch.empty_like(acc, dtype=inp.dtype)
        launch(_finish_kernel, (cdiv(acc.numel(), FINISH_BLOCK),), acc, out, deg, acc.numel(), n_cols,
               MEAN=finish_mean, BLOCK=FINISH_BLOCK, num_warps=SMALL_NUM_WARPS)
    return out


def gather_scatter_rows(x2d: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int, mean: bool,
                        config: Optional[Config] = None) -> torch.Tensor:
    """(num_nodes, F) in x2d's dtype: the sum (mean) of x2d[src[e]] over the edges e with dst[e] == i.
    x2d (N, F) with unit feature stride; src, dst (E,) int32 / int64 on x2d's device, unchecked."""
    return _aggregate(x2d, src, dst, num_nodes, mean, False, config)


def gather_scatter_backward_rows(grad2d: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_rows: int,
                                 mean: bool, config: Optional[Config] = None) -> torch.Tensor:
    """(num_rows, F): grad_x[src[e]] += grad2d[dst[e]] (/ max(1, in-degree of dst[e]) for the mean)."""
    return _aggregate(grad2d, dst, src, num_rows, mean, True, config)


# ----------------------------------------------------------------------------- build check
_TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
               torch.int64: "i64"}


def _sm90_usage(kernel, signature: dict, constexprs: dict, num_warps: int) -> dict:
    """Compile a kernel for sm_90a without a GPU (Triton's own ptxas): registers a thread and
    spilled bytes."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(kernel, {**signature, **{k: "constexpr" for k in constexprs}},
                                        constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/kernel.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{tmp}/kernel.ptx", "-o",
                                 f"{tmp}/kernel.cubin"], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spills": int(spills.group(1)) if spills else 0}


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, index_dtype: torch.dtype = torch.int64,
                     n_cols: int = 128) -> dict:
    """Build every kernel a forward and a backward launch for sm_90a at the default config for
    n_cols features: {variant: {"registers", "spills"}}. The test suite's check, on machines
    without a GPU, that this Triton compiles them (the interpreter runs them uncompiled) within
    the register budget the tile was chosen for. Call it in a Python without TRITON_INTERPRET."""
    cfg = default_config(n_cols)
    value, index = _TYPE_NAMES[dtype], _TYPE_NAMES[index_dtype]
    signature = {"inp_ptr": f"*{value}", "gather_ptr": f"*{index}", "scatter_ptr": f"*{index}", "acc_ptr": "*fp32",
                 "deg_ptr": "*fp32", "n_edges": "i32", "n_cols": "i32", "inp_row_stride": "i32",
                 "acc_row_stride": "i32"}
    usage = {}
    for name, count, scale in (("sum", False, False), ("mean forward", True, False), ("mean backward", False, True)):
        usage[f"gather_scatter {name}"] = _sm90_usage(
            _gather_scatter_kernel, signature,
            {"COUNT": count, "SCALE": scale, "BLOCK_E": cfg.block_e, "BLOCK_F": cfg.block_f}, cfg.num_warps)
    usage["finish mean"] = _sm90_usage(
        _finish_kernel, {"acc_ptr": "*fp32", "out_ptr": f"*{value}", "deg_ptr": "*fp32", "numel": "i64",
                         "n_cols": "i32"}, {"MEAN": True, "BLOCK": FINISH_BLOCK}, SMALL_NUM_WARPS)
    usage["in-degree"] = _sm90_usage(_in_degree_kernel, {"idx_ptr": f"*{index}", "deg_ptr": "*fp32", "n_edges": "i32"},
                                     {"BLOCK": DEGREE_BLOCK}, SMALL_NUM_WARPS)
    return usage
