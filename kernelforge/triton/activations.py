"""Triton activation kernels (gelu, gelu_tanh, silu, relu; + bias; gated) and their launchers.

All four kernels are elementwise over (rows, n) views with unit column stride and any row
stride. A program takes one BLOCK_M x BLOCK_N tile (the grid is 1-D, tile index =
row_tile * col_blocks + col_block, so neither grid axis limit of 65535 applies). When no
bias is given and every operand is dense, the launcher views the whole tensor as a single
row (rows * n columns): a plain 1-D elementwise kernel with no masked lanes at the end of
short rows. Math is float32 whatever the storage dtype; each result is rounded once on store.

Per element, with s the storage size (4 fp32, 2 fp16/bf16) and fp32 math:
  _act_fwd_kernel   y = act(x + b)                   reads s, writes s        -> 2s bytes
                    (+ b: one BLOCK_N slice of bias per tile, shared by BLOCK_M rows)
  _act_bwd_kernel   dx = dy * act'(x + b)            reads 2s, writes s       -> 3s bytes
                    bias grad: + 4 bytes per column per program (fp32 partials), then
                    partial_sums.sum_partials over them: no atomics, deterministic.
  _glu_fwd_kernel   y = act(gate) * up               reads 2s, writes s       -> 3s bytes
  _glu_bwd_kernel   dgate = dy * up * act'(gate), dup = dy * act(gate)
                                                     reads 3s, writes 2s      -> 5s bytes
                    (+ y = act(gate) * up for a backward that needs the product
                     again, e.g. gated_mlp's weight gradient: + s, against the 3s
                     of a second _glu_fwd_kernel pass)
FLOPs per element (a transcendental counts 1; they run on the SFU or as short polynomials):
  act:  relu 1; silu ~5 (exp, add, div, mul, select); gelu ~5 (erf + 4); gelu_tanh ~10
        (cubic, exp, div, mul); act' adds ~4-8 more (gelu's needs one more exp).
  bias adds 1; glu adds 1 (the product with up); backward adds 1-3 multiplies.
At most ~20 FLOPs per element against 4-10 bytes: far under an H100's ~60 FLOP/byte
ridge, so every kernel is bound by memory bandwidth.

Backward recomputes act'(x + b) (and act(gate)) from the inputs: nothing is saved from the
forward but its inputs, which autograd keeps anyway.

Accuracy notes:
- sigmoid (silu, gelu_tanh) is 1 / (1 + exp(-|z|)) and its mirror exp(-|z|) / (1 + ...),
  picked by the sign of z: exp never overflows, and 1 - sigmoid(z) is never computed by a
  subtraction (silu' = s (1 + z (1 - s)) would lose the small 1 - s at large z).
- gelu_tanh uses 0.5 (1 + tanh(u)) = sigmoid(2u), exactly, so there is no 1 + tanh(u)
  cancellation at large negative x and no tanh (which the interpreter lacks in libdevice).
- gelu needs erf. On the GPU, libdevice's erff (accurate to ~2 ulp). Triton's interpreter
  does not implement libdevice (a libdevice call there evaluates to None and the kernel
  fails), so under TRITON_INTERPRET=1 PRECISE is off and tl.erf runs instead (the
  interpreter evaluates it with Python's math.erf). tl.erf would lower to the same erff
  on NVIDIA today; the explicit libdevice call keeps the GPU path from depending on how a
  Triton version lowers math.erf.

torch.compile: every launch goes through kernelforge.triton._launch.launch with a plain
@triton.jit kernel, and the launchers write only tensors they allocate (or the `out` buffers
their caller allocated), so on traced tensors the launches enter the graph and Inductor runs
the kernels itself.

Launchers run on the current CUDA stream of the input's device (Triton's launcher asks
torch for it), and on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernelforge.triton import interpreter_enabled
from kernelforge.triton._launch import cdiv, launch, next_power_of_2, on_device, sm_count
from kernelforge.triton.partial_sums import sum_partials

# Written to the right of a tensor in the kernels (z * C, not C * z): Triton's interpreter from
# 3.7 on wraps C * z in a constexpr that its math functions refuse; compiled, both are the same.
SQRT1_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
TANH_SCALE = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
TANH_CUBIC = tl.constexpr(0.044715)

# Tiles, from an H100 sweep of gelu at 16384x4096 and 4096x65536 bf16 (issue 4's note):
# - one-row (flattened, dense) launches: 2048 elements with 4 warps, 16 values a thread; the
#   backward ran 8% faster than with 4096 x 8 warps, the forward the same (wider tiles or
#   more warps were slower);
# - 2-D launches (a bias along the rows): 8 x 1024 with 8 warps; the bias backward (column
#   partials) ran 161 / 641 us against 4 x 1024's 167 / 811 us, the forward the same.
FLAT_TILE_ELEMS = 2048
FLAT_WARPS = 4
ROW_TILE_ELEMS = 8192
# Widest tile of a 2-D launch; wider rows take several column blocks. Narrow, so that rows
# just past a power of two (e.g. 4097) waste a small share of programs on a nearly empty
# last column block.
MAX_BLOCK_N = 1024
NUM_WARPS = 8
# Programs per SM for the bias-gradient launch: each program walks a grid-stride run of
# row tiles, so the fp32 partials buffer has (programs, n) entries however many rows.
# (On the CPU sm_count is a small stand-in, so the CPU tests reduce several partials.)
BIAS_GRAD_PROGRAMS_PER_SM = 4


# ----------------------------------------------------------------------------- device math
@triton.jit
def _erf(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.erf(x)
    else:
        return tl.erf(x)


@triton.jit
def _cubic(z):
    """z + 0.044715 z^3: tanh-GELU's argument before its sqrt(2 / pi)."""
    return z + z * TANH_CUBIC * z * z


@triton.jit
def _sigmoid_and_mirror(z):
    """(sigmoid(z), sigmoid(-z) = 1 - sigmoid(z)), both without overflow or cancellation."""
    t = tl.exp(-tl.abs(z))  # in (0, 1]
    r = 1.0 / (1.0 + t)
    positive = z >= 0
    return tl.where(positive, r, t * r), tl.where(positive, t * r, r)


@triton.jit
def activation(z, KIND: tl.constexpr, PRECISE: tl.constexpr):
    """act(z) for float32 z."""
    if KIND == "gelu":
        y = 0.5 * z * (1.0 + _erf(z * SQRT1_2, PRECISE))
    elif KIND == "gelu_tanh":
        s, _ = _sigmoid_and_mirror(_cubic(z) * (2.0 * TANH_SCALE))
        y = z * s
    elif KIND == "silu":
        s, _ = _sigmoid_and_mirror(z)
        y = z * s
    else:  # relu; NaN stays NaN, as in torch
        y = tl.where(z < 0.0, 0.0, z)
    return y


@triton.jit
def _tanh_approx(x):
    """The SFU's tanh (tanh.approx.f32: one instruction, relative error about 2^-11)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def activation_for_bf16(z, KIND: tl.constexpr, PRECISE: tl.constexpr):
    """act(z) for float32 z whose result is stored as bfloat16 (8 mantissa bits): silu and
    gelu_tanh take sigmoid(x) = 0.5 + 0.5 tanh(x / 2) from the SFU's tanh, whose 2^-11
    error is a quarter of the store's rounding, instead of an exp and a division (~5x the
    instructions: in a GEMM epilogue, which nothing overlaps, that was ~8% of a 4096^3
    product). GPU only (inline PTX); other kinds as activation."""
    if KIND == "gelu_tanh":
        half_z = 0.5 * z
        y = half_z + half_z * _tanh_approx(_cubic(z) * TANH_SCALE)
    elif KIND == "silu":
        half_z = 0.5 * z
        y = half_z + half_z * _tanh_approx(half_z)
    else:
        y = activation(z, KIND, PRECISE)
    return y


@triton.jit
def _activation_and_derivative(z, KIND: tl.constexpr, PRECISE: tl.constexpr):
    """(act(z), act'(z)) for float32 z, sharing the transcendental; formulas as in
    kernelforge.reference.activations.activation_derivative."""
    if KIND == "gelu":
        cdf = 0.5 * (1.0 + _erf(z * SQRT1_2, PRECISE))
        y = z * cdf
        dy = cdf + z * INV_SQRT_2PI * tl.exp(-0.5 * z * z)
    elif KIND == "gelu_tanh":
        # y = z s(w), w = 2u: y' = s + z s (1 - s) w', w' = 2c (1 + 3a z^2)
        s, s_mirror = _sigmoid_and_mirror(_cubic(z) * (2.0 * TANH_SCALE))
        y = z * s
        dy = s + z * s * s_mirror * ((1.0 + z * (3.0 * TANH_CUBIC) * z) * (2.0 * TANH_SCALE))
    elif KIND == "silu":
        s, s_mirror = _sigmoid_and_mirror(z)
        y = z * s
        dy = s * (1.0 + z * s_mirror)
    else:  # relu
        y = tl.where(z < 0.0, 0.0, z)
        dy = tl.where(z <= 0.0, 0.0, 1.0)  # 1 at NaN: the gradient passes, as torch's
    return y, dy


@triton.jit
def _tile(tile_m, tile_n, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column indices (int64, for the address arithmetic) and mask of tile
    (tile_m, tile_n). Columns are computed in int64 (a tensor viewed as one row may pass
    2^31 elements); tile_m may be a loop variable, which the interpreter makes a Python
    int, so rows go through int32 first (fine below 2^31 rows)."""
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows, cols, mask


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _act_fwd_kernel(
    x_ptr, bias_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride, n_col_blocks,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid // n_col_blocks, pid % n_col_blocks, n_rows, n_cols, BLOCK_M, BLOCK_N)
    z = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y = activation(z, KIND, PRECISE)
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    g_ptr, x_ptr, bias_ptr, dx_ptr, partial_ptr, n_rows, n_cols,
    g_row_stride, x_row_stride, dx_row_stride, n_col_blocks, n_row_programs,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
):
    """dx = dy * act'(x + b). Program (p, c) walks row tiles p, p + n_row_programs, ...
    of column block c (one tile each when there is no bias gradient to reduce); with
    BIAS_GRAD it sums its unrounded fp32 dx over those rows and writes partial[p, cols]."""
    pid = tl.program_id(0)
    row_program = pid // n_col_blocks
    col_block = pid % n_col_blocks
    n_row_tiles = tl.cdiv(n_rows, BLOCK_M)
    col_sums = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for tile_m in range(row_program, n_row_tiles, n_row_programs):
        rows, cols, mask = _tile(tile_m, col_block, n_rows, n_cols, BLOCK_M, BLOCK_N)
        z = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        g = tl.load(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, dact = _activation_and_derivative(z, KIND, PRECISE)
        dx = g * dact
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if BIAS_GRAD:
            col_sums += tl.where(mask, dx, 0.0)
    if BIAS_GRAD:
        cols = col_block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(partial_ptr + row_program.to(tl.int64) * n_cols + cols, tl.sum(col_sums, axis=0), mask=cols < n_cols)


@triton.jit
def _glu_fwd_kernel(
    gate_ptr, up_ptr, y_ptr, n_rows, n_cols, gate_row_stride, up_row_stride, y_row_stride, n_col_blocks,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid // n_col_blocks, pid % n_col_blocks, n_rows, n_cols, BLOCK_M, BLOCK_N)
    a = tl.load(gate_ptr + rows[:, None] * gate_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + rows[:, None] * up_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = activation(a, KIND, PRECISE) * b
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    g_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, y_ptr, n_rows, n_cols,
    g_row_stride, gate_row_stride, up_row_stride, dgate_row_stride, dup_row_stride, y_row_stride, n_col_blocks,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
    WRITE_PRODUCT: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid // n_col_blocks, pid % n_col_blocks, n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_ptr + rows[:, None] * gate_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + rows[:, None] * up_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, dact = _activation_and_derivative(a, KIND, PRECISE)
    dgate = (g * b * dact).to(dgate_ptr.dtype.element_ty)
    tl.store(dgate_ptr + rows[:, None] * dgate_row_stride + cols[None, :], dgate, mask=mask)
    tl.store(dup_ptr + rows[:, None] * dup_row_stride + cols[None, :], (g * act).to(dup_ptr.dtype.element_ty), mask=mask)
    if WRITE_PRODUCT:  # act(gate) * up, rounded once: silu's and gelu_tanh's bit for bit _glu_fwd_kernel's
        # (gelu's act is z * cdf here, 0.5 z (1 + erf) there: the float32 product may differ in its last bit)
        y = (act * b).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y, mask=mask)


# ----------------------------------------------------------------------------- launch configs
@dataclass(frozen=True)
class TileConfig:
    """One launch's tile: BLOCK_M rows x BLOCK_N columns per program, and its warps."""

    block_m: int
    block_n: int
    num_warps: int

    def grid_shape(self, n_rows: int, n_cols: int) -> tuple[int, int]:
        """(row tiles, column blocks)."""
        return cdiv(n_rows, self.block_m), cdiv(n_cols, self.block_n)


def _capped_power_of_2(n, cap: int) -> int:
    """min(next_power_of_2(n), cap), cap a power of two. Under torch.compile's dynamic shapes
    n is a SymInt: a size of at least `cap` only adds a guard (n >= cap); a smaller one is
    specialized, as its tile must be."""
    return cap if n >= cap else next_power_of_2(int(n))


def _config(n_rows, n_cols) -> TileConfig:
    if n_rows == 1:
        return TileConfig(1, _capped_power_of_2(n_cols, FLAT_TILE_ELEMS), FLAT_WARPS)
    block_n = _capped_power_of_2(n_cols, MAX_BLOCK_N)
    block_m = max(1, _capped_power_of_2(n_rows, ROW_TILE_ELEMS // block_n))
    return TileConfig(block_m, block_n, NUM_WARPS if block_m * block_n >= 2048 else 4)


_cached_config = functools.lru_cache(maxsize=4096)(_config)  # on every eager launch: a pure function of two ints


def default_config(n_rows: int, n_cols: int) -> TileConfig:
    """The tile for a (n_rows, n_cols) launch (sizes may be SymInts while torch.compile traces)."""
    if type(n_rows) is int and type(n_cols) is int:
        return _cached_config(n_rows, n_cols)
    return _config(n_rows, n_cols)


def _dense(t: torch.Tensor) -> bool:
    """A (rows, n) view whose rows follow each other in memory: it is one flat row."""
    return t.shape[0] <= 1 or t.stride(0) == t.shape[1]


def _as_one_row(t: torch.Tensor) -> torch.Tensor:
    return t.view(1, t.numel())


# ----------------------------------------------------------------------------- launchers
def act_forward_rows(
    x2d: torch.Tensor, bias: Optional[torch.Tensor], kind: str, config: Optional[TileConfig] = None
) -> torch.Tensor:
    """y = act(x + bias) for each row of x2d (bias None or (n,) contiguous), new dense tensor."""
    y = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device)
    if y.numel() == 0:
        return y
    x_view, y_view = x2d, y
    if bias is None and _dense(x2d):
        x_view, y_view = _as_one_row(x2d), _as_one_row(y)
    n_rows, n_cols = x_view.shape
    cfg = config or default_config(n_rows, n_cols)
    row_tiles, col_blocks = cfg.grid_shape(n_rows, n_cols)
    with on_device(x2d):
        launch(
            _act_fwd_kernel, (row_tiles * col_blocks,),
            x_view, bias if bias is not None else x_view, y_view, n_rows, n_cols,
            x_view.stride(0), y_view.stride(0), col_blocks,
            KIND=kind, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PRECISE=not interpreter_enabled(), num_warps=cfg.num_warps,
        )
    return y


def act_backward_rows(
    grad2d: torch.Tensor, x2d: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_bias_grad: bool,
    config: Optional[TileConfig] = None, bias_grad_row_programs: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad_x, grad_bias): grad_x = grad * act'(x + bias), new dense tensor; grad_bias the
    column sums of grad_x in bias's dtype when bias is given and need_bias_grad, else None.
    bias_grad_row_programs overrides how many programs share the rows of a column block."""
    bias_grad = bias is not None and need_bias_grad
    dx = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device)
    if dx.numel() == 0:
        return dx, (torch.zeros_like(bias) if bias_grad else None)
    g_view, x_view, dx_view = grad2d, x2d, dx
    if bias is None and _dense(grad2d) and _dense(x2d):
        g_view, x_view, dx_view = _as_one_row(grad2d), _as_one_row(x2d), _as_one_row(dx)
    n_rows, n_cols = x_view.shape
    cfg = config or default_config(n_rows, n_cols)
    row_tiles, col_blocks = cfg.grid_shape(n_rows, n_cols)
    row_programs = row_tiles
    if bias_grad:
        wanted = bias_grad_row_programs or cdiv(BIAS_GRAD_PROGRAMS_PER_SM * sm_count(x2d.device), col_blocks)
        row_programs = max(1, min(row_tiles, wanted))
    partial = torch.empty((row_programs, n_cols), dtype=torch.float32, device=x2d.device) if bias_grad else None
    with on_device(x2d):
        launch(
            _act_bwd_kernel, (row_programs * col_blocks,),
            # unused pointers get an input (never an output: traced, a tensor passed twice where
            # one is written could be taken for two outputs)
            g_view, x_view, bias if bias is not None else x_view, dx_view,
            partial if bias_grad else g_view, n_rows, n_cols,
            g_view.stride(0), x_view.stride(0), dx_view.stride(0), col_blocks, row_programs,
            KIND=kind, HAS_BIAS=bias is not None, BIAS_GRAD=bias_grad, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, PRECISE=not interpreter_enabled(), num_warps=cfg.num_warps,
        )
    if not bias_grad:
        return dx, None
    # Second stage: the reduction over the program axis (deterministic: fixed order).
    grad_bias = torch.empty(n_cols, dtype=bias.dtype, device=x2d.device)
    with on_device(x2d):
        sum_partials(partial, grad_bias)
    return dx, grad_bias


def glu_forward_rows(
    gate2d: torch.Tensor, up2d: torch.Tensor, kind: str, config: Optional[TileConfig] = None
) -> torch.Tensor:
    """y = act(gate) * up per element of the (rows, n) views, new dense tensor."""
    y = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
    if y.numel() == 0:
        return y
    views = (gate2d, up2d, y)
    if all(_dense(t) for t in views):
        views = tuple(_as_one_row(t) for t in views)
    gate_view, up_view, y_view = views
    n_rows, n_cols = y_view.shape
    cfg = config or default_config(n_rows, n_cols)
    row_tiles, col_blocks = cfg.grid_shape(n_rows, n_cols)
    with on_device(gate2d):
        launch(
            _glu_fwd_kernel, (row_tiles * col_blocks,),
            gate_view, up_view, y_view, n_rows, n_cols,
            gate_view.stride(0), up_view.stride(0), y_view.stride(0), col_blocks,
            KIND=kind, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISE=not interpreter_enabled(),
            num_warps=cfg.num_warps,
        )
    return y


def glu_backward_rows(
    grad2d: torch.Tensor, gate2d: torch.Tensor, up2d: torch.Tensor, kind: str,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None, config: Optional[TileConfig] = None,
    with_product: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(grad_gate, grad_up) = (grad * up * act'(gate), grad * act(gate)), as new dense
    tensors, or written into `out`, a pair of (rows, n) views with unit column stride (the
    packed form passes the two halves of one gradient buffer). with_product: also act(gate) * up
    (as glu_forward_rows gives it), a third new dense tensor, from the same pass."""
    if out is None:
        out = (torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device),
               torch.empty(up2d.shape, dtype=up2d.dtype, device=up2d.device))
    product = (torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device),) if with_product else ()
    if gate2d.numel() == 0:
        return (*out, *product)
    views = (grad2d, gate2d, up2d) + tuple(out) + product
    if all(_dense(t) for t in views):
        views = tuple(_as_one_row(t) for t in views)
    g_view, gate_view, up_view, dgate_view, dup_view = views[:5]
    y_view = views[5] if with_product else dgate_view  # not written without the product
    n_rows, n_cols = g_view.shape
    cfg = config or default_config(n_rows, n_cols)
    row_tiles, col_blocks = cfg.grid_shape(n_rows, n_cols)
    with on_device(gate2d):
        launch(
            _glu_bwd_kernel, (row_tiles * col_blocks,),
            g_view, gate_view, up_view, dgate_view, dup_view, y_view, n_rows, n_cols,
            g_view.stride(0), gate_view.stride(0), up_view.stride(0), dgate_view.stride(0),
            dup_view.stride(0), y_view.stride(0), col_blocks,
            KIND=kind, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISE=not interpreter_enabled(),
            WRITE_PRODUCT=with_product, num_warps=cfg.num_warps,
        )
    return (*out, *product)
