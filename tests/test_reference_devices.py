"""The pure-PyTorch references (kernelforge/reference/) run on whatever device their inputs are on
(an Apple GPU through MPS included): nothing in them names a device or moves a tensor to one.

Two checks. A scan of their source: no "cpu" / "cuda" string outside docstrings, no .cpu(),
.cuda() or .numpy(), and every torch factory call (torch.zeros, torch.arange, ...) names its
device=, since without it the tensor lands on the default device, not the inputs'. And a run of
every public reference function on tensors of the "meta" device (shapes and dtypes, no data):
each result must be a meta tensor, which a tensor made on another device, or a host read of a
value, would break. Skipped there: accumulation_dtype, which takes and returns a dtype, no tensor,
and the varlen attention reference, which reads its sequence offsets on the host by design.
"""
import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from kernelforge.block_mask import sliding_window_block_mask
from kernelforge.reference import activations, attention, convrnn, cross_entropy, gather_scatter, gemm, norms, rope

# the module: kernelforge.reference's own `softmax` is the function, which shadows it there
softmax = importlib.import_module("kernelforge.reference.softmax")

REFERENCE = Path(__file__).resolve().parents[1] / "kernelforge" / "reference"
DEVICE_STRING = re.compile(r"(cpu|cuda)(:\d+)?", re.IGNORECASE)
HOST_METHODS = {"cpu", "cuda", "numpy"}  # each moves to, or needs, one device
FACTORIES = {"tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "empty", "empty_strided", "full", "arange",
             "range", "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "tril_indices",
             "triu_indices"}
# Where a reference must branch on the device (a `t.device.type == "cuda"` test), the line goes here
# with its reason, as {("file.py", line number): "why"}. None needs to today.
EXCEPTIONS: dict = {}


# ----------------------------------------------------------------------------- the source scan
def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the module's, classes' and functions' docstring constants."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def device_placements(source: str, filename: str = "<source>") -> list[str]:
    """"file:line: what" for each device named or implied in Python source."""
    tree = ast.parse(source)
    docstrings = docstring_nodes(tree)
    torch_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names if alias.name == "torch"}
    found = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                and DEVICE_STRING.fullmatch(node.value)):
            found.append(f"{where}: the device string {node.value!r}")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr in HOST_METHODS and not node.args:
            found.append(f"{where}: .{node.func.attr}()")
        if (node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id in torch_names):
            device = [keyword.value for keyword in node.keywords if keyword.arg == "device"]
            if not device or isinstance(device[0], ast.Constant):
                found.append(f"{where}: torch.{node.func.attr}(...) on the default device, not the inputs'")
    return [line for line in found if tuple(line.split(":")[:2]) not in EXCEPTIONS]


def test_scan_finds_each_kind_of_placement():
    source = '''
import torch as T
def f(x):
    """Docstrings may say "cpu"."""
    a = T.zeros(3)                       # no device
    b = T.arange(3, device=None)         # the default device again
    c = x.to("cuda:0")                   # a device string
    d = x.cpu() + x.cuda()               # two moves
    e = T.ones(3, device=x.device)       # fine: the input's device
    return x.new_zeros(3), T.zeros_like(x), x.numpy()
'''
    assert len(device_placements(source)) == 6, device_placements(source)


@pytest.mark.parametrize("path", sorted(REFERENCE.glob("*.py")), ids=lambda path: path.name)
def test_reference_places_tensors_on_the_inputs_device(path):
    assert device_placements(path.read_text(), path.name) == []


# ----------------------------------------------------------------------------- the run on "meta"
def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def index(*shape, dtype=torch.int64):
    return meta(*shape, dtype=dtype)


B, H, HKV, SQ, SK, D = 2, 4, 2, 8, 20, 16  # attention: grouped-query heads, several key chunks of 8
KINDS = activations.KINDS


def attention_visibilities():
    yield attention.Visibility.of(False, None)
    yield attention.Visibility.of(True, (4, -1))
    yield attention.Visibility.of(False, None, attn_mask=meta(B, 1, SQ, SK, dtype=torch.bool))
    yield attention.Visibility.of(False, None, attn_mask=meta(B, H, SQ, SK))
    yield attention.Visibility.of(True, None, seqlens=index(B, dtype=torch.int32))
    yield attention.Visibility.of(False, None, block_mask=sliding_window_block_mask(SQ, SK, 4).to("meta"))


def attention_cases(backward: bool):
    q, k, v = meta(B, H, SQ, D, dtype=torch.bfloat16), meta(B, HKV, SK, D, dtype=torch.bfloat16), \
        meta(B, HKV, SK, D, dtype=torch.bfloat16)
    for vis in attention_visibilities():
        out, lse = attention.attention_forward(q, k, v, 0.25, vis, chunk_size=8)
        yield attention.attention_backward(torch.empty_like(out), q, k, v, out, lse, 0.25, vis, 8) if backward \
            else (out, lse)


def gemm_cases():
    a, b, bias, residual = meta(2, 4, 8), meta(2, 8, 6), meta(6), meta(2, 4, 6)
    for compute in gemm.COMPUTE_MODES:
        scales = {}
        if compute == "fp8":
            a, b, scales = a.to(gemm.FP8), b.to(gemm.FP8), {"scale_a": meta(2, 4), "scale_b": meta(2, 6)}
        yield gemm.gemm(a, b, bias, residual, "gelu", compute, torch.bfloat16, True, **scales, out_shape=(8, 6))


ROWS, N = 6, 10
x2d, g2d, w, bias = meta(ROWS, N, dtype=torch.float16), meta(ROWS, N, dtype=torch.float16), meta(N), meta(N)
z = meta(ROWS, N)
logits, target = meta(ROWS, N, dtype=torch.bfloat16), index(ROWS, dtype=torch.int32)
mean, rstd = meta(ROWS), meta(ROWS)
src, dst, nodes = index(15), index(15), meta(7, 3, 2)
seq = meta(2, 5, 7)  # convrnn: (batch, time, features)
q_rope, k_rope, table, positions = meta(2, 5, 4, 8), meta(2, 5, 2, 8), meta(12, 6), index(2, 5)
angles = meta(1, 5, 6)

CASES = {
    "softmax.softmax": lambda: softmax.softmax(x2d, 0),
    "softmax.log_softmax": lambda: softmax.log_softmax(x2d),
    "softmax.softmax_backward": lambda: [softmax.softmax_backward(g2d, x2d, -1, log) for log in (False, True)],
    "softmax.softmax_forward_rows": lambda: softmax.softmax_forward_rows(x2d, True),
    "softmax.softmax_backward_rows": lambda: softmax.softmax_backward_rows(g2d, x2d, False),
    "activations.activation_value": lambda: [activations.activation_value(z, kind) for kind in KINDS],
    "activations.activation_derivative": lambda: [activations.activation_derivative(z, kind) for kind in KINDS],
    "activations.activation_second_derivative":
        lambda: [activations.activation_second_derivative(z, kind) for kind in KINDS],
    "activations.activation": lambda: [activations.activation(x2d, kind, bias) for kind in KINDS],
    "activations.gelu": lambda: [activations.gelu(x2d), activations.gelu(x2d, "tanh")],
    "activations.silu": lambda: activations.silu(x2d),
    "activations.relu": lambda: activations.relu(x2d),
    "activations.activation_backward": lambda: activations.activation_backward(g2d, x2d, "gelu", bias, True),
    "activations.glu": lambda: activations.glu(x2d, x2d, "silu"),
    "activations.glu_backward": lambda: activations.glu_backward(g2d, x2d, x2d, "gelu_tanh"),
    "activations.swiglu": lambda: activations.swiglu(x2d, x2d),
    "activations.geglu": lambda: activations.geglu(x2d, x2d, "tanh"),
    "activations.act_forward_rows": lambda: activations.act_forward_rows(x2d, bias, "relu"),
    "activations.act_backward_rows": lambda: activations.act_backward_rows(g2d, x2d, bias, "silu", True),
    "activations.glu_forward_rows": lambda: activations.glu_forward_rows(x2d, x2d, "gelu"),
    "activations.glu_backward_rows": lambda: [
        activations.glu_backward_rows(g2d, x2d, x2d, "silu", with_product=True),
        activations.glu_backward_rows(g2d, x2d, x2d, "silu", out=(torch.empty_like(x2d), torch.empty_like(x2d)))],
    "attention.attention_forward": lambda: list(attention_cases(backward=False)),
    "attention.attention_backward": lambda: list(attention_cases(backward=True)),
    "attention.cpu_fused_attention": lambda: attention.cpu_fused_attention(
        meta(B, H, SQ, D), meta(B, HKV, SK, D), meta(B, HKV, SK, D), causal=True),
    "attention.optimized_cpu_attention": lambda: attention.optimized_cpu_attention(
        meta(B, H, SQ, D), meta(B, HKV, SK, D), meta(B, HKV, SK, D), 8, scale=0.5),
    "attention.gather_pages": lambda: attention.gather_pages(meta(5, HKV, 4, D), index(B, 3, dtype=torch.int32)),
    "attention.unpage": lambda: attention.unpage(
        meta(5, HKV, 4, D), meta(5, HKV, 4, D),
        attention.Visibility(None, 0, seqlens=index(B, dtype=torch.int32), block_table=index(B, 3)))[:2],
    "convrnn.convrnn_forward": lambda: convrnn.convrnn_forward(seq, meta(1, 1, 3), meta(2, 7)),
    "convrnn.convrnn_backward": lambda: convrnn.convrnn_backward(seq, meta(2, 7), meta(1, 1, 3), meta(2, 7), seq),
    "cross_entropy.target_masks": lambda: cross_entropy.target_masks(target, N, -100),
    "cross_entropy.cross_entropy_forward_rows":
        lambda: cross_entropy.cross_entropy_forward_rows(logits, target, -100, 0.1, softcap=30.0, z_loss=1e-4),
    "cross_entropy.cross_entropy_backward_rows":
        lambda: cross_entropy.cross_entropy_backward_rows(meta(ROWS), logits, target, meta(ROWS), -100, 0.1),
    "cross_entropy.cross_entropy_slice_backward_": lambda: cross_entropy.cross_entropy_slice_backward_(
        meta(ROWS), meta(ROWS, 4, dtype=torch.bfloat16), target, meta(ROWS), 4, N, -100, 0.1, 30.0, 1e-4),
    "gather_scatter.in_degree": lambda: gather_scatter.in_degree(dst, 9, torch.float32),
    "gather_scatter.gather_scatter": lambda: [gather_scatter.gather_scatter(nodes, src, dst, 9, reduce)
                                              for reduce in gather_scatter.REDUCTIONS],
    "gather_scatter.gather_scatter_backward": lambda: [gather_scatter.gather_scatter_backward(
        meta(9, 3, 2), src, dst, 7, reduce) for reduce in gather_scatter.REDUCTIONS],
    "gather_scatter.gather_scatter_rows": lambda: gather_scatter.gather_scatter_rows(x2d, src, dst, 9, True),
    "gather_scatter.gather_scatter_backward_rows":
        lambda: gather_scatter.gather_scatter_backward_rows(meta(9, N), src, dst, ROWS, False),
    "gemm.fp8_scale": lambda: [gemm.fp8_scale(t, scaling, -1) for t in (x2d, meta(0, N))
                               for scaling in gemm.FP8_SCALINGS],
    "gemm.quantize_fp8": lambda: gemm.quantize_fp8(x2d, meta(ROWS, 1)),
    "gemm.round_to_tf32": lambda: gemm.round_to_tf32(z),
    "gemm.operands": lambda: [gemm.operands(x2d, x2d.t(), compute) for compute in ("tf32", "bf16")],
    "gemm.epilogue": lambda: gemm.epilogue(z, bias, "gelu_tanh", x2d),
    "gemm.gemm": lambda: list(gemm_cases()),
    "norms.norm_statistics": lambda: [norms.norm_statistics(x2d, 1e-5, rms) for rms in (False, True)],
    "norms.norm_forward_rows": lambda: [norms.norm_forward_rows(x2d, x2d, w, bias, 1e-5, rms, 0.0)
                                        for rms in (False, True)],
    "norms.norm_backward_rows": lambda: [norms.norm_backward_rows(
        g2d, g2d, x2d, w, torch.float32, None if rms else mean, rstd, rms, 1.0, True) for rms in (False, True)],
    "norms.differentiable_backward": lambda: norms.differentiable_backward(
        g2d, None, x2d, w, (N,), torch.float32, 1e-5, False, 0.0, True),
    "norms.layer_norm": lambda: norms.layer_norm(meta(3, 2, 5), meta(2, 5), meta(2, 5), normalized_ndim=2),
    "norms.rms_norm": lambda: norms.rms_norm(x2d, w, offset=1.0),
    "norms.add_layer_norm": lambda: norms.add_layer_norm(x2d, x2d, w, bias),
    "norms.add_rms_norm": lambda: norms.add_rms_norm(x2d, x2d, w),
    "rope.token_angles": lambda: [rope.token_angles(table, table, positions, 2, torch.float32),
                                  rope.token_angles(angles, angles, None, 2, torch.float64)],
    "rope.rotate": lambda: rope.rotate(q_rope, angles, angles, True),
    "rope.rope_tokens": lambda: [rope.rope_tokens(q_rope, k_rope, table, table, positions, False),
                                 rope.rope_tokens(q_rope, k_rope, angles, angles, None, True)],
    "rope.angle_gradients": lambda: [
        rope.angle_gradients(q_rope, k_rope, q_rope, k_rope, meta(2, 5, 6), positions, table.shape, False),
        rope.angle_gradients(q_rope, k_rope, q_rope, k_rope, angles, None, angles.shape, True)],
}
SKIPPED = {"_accumulation.accumulation_dtype": "a dtype in, a dtype out: no tensor",
           # the reference's loop over packed sequences reads cu_seqlens on the host (documented
           # there), which meta tensors cannot give; the source scan above still checks it
           "attention_varlen.varlen_forward": "reads the sequence offsets on the host",
           "attention_varlen.varlen_backward": "reads the sequence offsets on the host"}


def tensors(result):
    if isinstance(result, torch.Tensor):
        yield result
    elif isinstance(result, (list, tuple)):
        for item in result:
            yield from tensors(item)


def test_every_public_reference_function_is_run_on_meta():
    public = {f"{path.stem}.{node.name}" for path in REFERENCE.glob("*.py")
              for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    assert public == CASES.keys() | SKIPPED.keys()


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_results_stay_on_the_inputs_device(name):
    results = list(tensors(CASES[name]()))
    assert results and all(t.device.type == "meta" for t in results), [t.device for t in results]
