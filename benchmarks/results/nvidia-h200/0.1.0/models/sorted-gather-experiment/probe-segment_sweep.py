"""Probe: the segment-sum kernel's block shapes at the demo GNN's graph, device time, against the atomic kernel."""
import torch, triton
import kernelforge as kf
from kernelforge.triton import gather_scatter as tgs
from kernelforge.demo import random_graphs
from kernelforge.reference.gather_scatter import gather_scatter as ref

torch.manual_seed(0)
for F in (128, 256):
    x, ei, _ = random_graphs(256, 400, 8, F, "cuda", torch.bfloat16)
    n = x.shape[0]
    src, dst, off = kf.sort_edges_by_destination(ei[0], ei[1], n)
    sort_ms = triton.testing.do_bench(lambda: kf.sort_edges_by_destination(ei[0], ei[1], n), warmup=25, rep=200)
    atomic = triton.testing.do_bench(lambda: tgs.gather_scatter_rows(x, ei[0], ei[1], n, False), warmup=25, rep=200)
    comp = torch.compile(ref, dynamic=False)
    inductor = triton.testing.do_bench(lambda: comp(x, ei[0], ei[1], n, "sum"), warmup=25, rep=200)
    want = ref(x.double(), ei[0], ei[1], n, "sum")
    print(f"F={F}: sort {sort_ms*1e3:.1f} us, atomic kernel {atomic*1e3:.1f} us, inductor {inductor*1e3:.1f} us", flush=True)
    for be in (8, 16, 32):
        for warps in (2, 4, 8):
            for bf in (64, 128, 256):
                if bf > F: continue
                tgs.SEGMENT_BLOCK_E, tgs.SEGMENT_NUM_WARPS, tgs.SEGMENT_MAX_BLOCK_F = be, warps, bf
                fn = lambda: tgs.gather_scatter_rows(x, src, dst, n, False, dst_offsets=off)
                err = (fn().double() - want).abs().max().item()
                t = triton.testing.do_bench(fn, warmup=25, rep=200)
                print(f"  block_e {be:2d} warps {warps} block_f {bf:3d}: {t*1e3:6.1f} us ({atomic/t:.2f}x atomic, {inductor/t:.2f}x inductor) err {err:.1e}", flush=True)
