"""Static-cache decoding for LanguageModel.generate: a KV cache whose shape is fixed for a call and
bucketed across calls, the prompt prefilled once, and a per-token step whose inputs are static
device buffers, replayed from a CUDA graph on a GPU.

    decoder = model.decoder(batch, total_length, ids.dtype, ids.device)  # kept on the model, reused
    logits = decoder.prefill(ids)       # (B, P) -> (B, vocab): the last prompt token's logits
    logits = decoder.step(tokens)       # (B, 1) -> (B, vocab): the logits after those tokens

The step reads no tensor value on the host: the position lives in a device buffer, the layers write
the cache with index_copy_ at it, and attention masks (torch levels) or bounds (kernelforge levels,
cache_seqlens) the cache by it on the device. Every tensor it touches keeps its shape and address
from one token to the next, so it is graphed:
- native, torchscript, triton, cuda and reference on a GPU: captured by hand in one
  torch.cuda.CUDAGraph after a warm-up, replayed per token;
- compile and fastest: torch.compile(mode="reduce-overhead", fullgraph=True) of the step (the
  compile level's WHOLE_GRAPH_METHODS); the cache and the buffers are marked static addresses, so
  their in-place writes do not make cudagraphs skip and the step compiles once per bucket;
- on a CPU the same step runs as it is.
Buckets: the cache has `cache_rows(total)` rows (a multiple of CACHE_BUCKET within max_seq_len),
so a call of another length reuses the decoder, its cache and its graphs. At the levels whose
graphs follow the prompt's shape (PADDED_LEVELS) the prompt is right-padded to `prompt_rows` (a
power of two) for the prefill: causal masking leaves the real tokens' logits unchanged, and the
padded tokens' cache rows lie past the position (masked) until the steps overwrite them.
Sampling (`sample`) runs on the logits outside the graph, on the device, without a host sync.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

CACHE_BUCKET = 256  # cache rows come in multiples of this: one graph serves every total length within
MIN_PROMPT_ROWS = 16  # the smallest padded prompt: tiny prompts share one prefill graph
# Warm-up steps before a hand capture: Triton compiles and autotunes, TorchScript's profiling
# executor profiles and optimizes, and nothing of that may happen inside the capture.
WARMUP_STEPS = 3
HAND_GRAPHED_LEVELS = ("native", "torchscript", "triton", "cuda", "reference")
COMPILED_LEVELS = ("compile", "fastest")  # graphed by torch.compile(mode="reduce-overhead")
PADDED_LEVELS = ("torchscript", "compile", "fastest")  # a trace or a compiled graph per prompt shape


def cache_rows(total: int, max_seq_len: int) -> int:
    """The cache's rows for `total` positions: rounded up to a multiple of CACHE_BUCKET, at most
    max_seq_len."""
    return min(max_seq_len, -(-total // CACHE_BUCKET) * CACHE_BUCKET)


def prompt_rows(prompt: int, rows: int) -> int:
    """A prompt's padded length: the next power of two (at least MIN_PROMPT_ROWS), within the cache."""
    return min(rows, max(MIN_PROMPT_ROWS, 1 << (prompt - 1).bit_length()))


def decoder_key(model, batch: int, rows: int, ids_dtype: torch.dtype, device: torch.device) -> tuple:
    """What a decoder's cache and graphs depend on. The parameters' addresses: a captured graph reads
    the parameters' memory, so after model.to(), load_state_dict(assign=True) or a replaced parameter
    it must be captured again (in-place updates of the parameters it follows)."""
    return (model.level, batch, rows, ids_dtype, torch.device(device), model.tok_emb.weight.dtype,
            tuple(p.data_ptr() for p in model.parameters()))


class Decoder:
    """A LanguageModel's decoding state for one (level, batch, cache rows, dtype, device): the KV cache,
    the step's token and position buffers and, once captured, the step's CUDA graph.

    The logits prefill and step return are the step's static output on a graphed path (the next step
    overwrites them): sample or clone them before the next step. A prefill and its steps fill at most
    `rows` positions (the caller's total; generate checks it)."""

    def __init__(self, model, batch: int, rows: int, ids_dtype: torch.dtype, device, key: tuple):
        device = torch.device(device)
        # weak: the model holds its decoder, and a cycle would keep the cache and graph memory alive
        # after the model is dropped, until the next garbage collection
        self._model = weakref.ref(model)
        self.key, self.rows, self.level = key, rows, model.level
        self.cache = model.new_cache(batch, rows, model.tok_emb.weight.dtype, device)
        self.ids = torch.zeros(batch, 1, dtype=ids_dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the position of the token in self.ids
        # the cache and the buffers live as long as the decoder: torch.compile takes them as fixed
        # addresses, written in place inside its CUDA graphs (a plain input is copied in per replay, and
        # an input written in place makes cudagraphs skip)
        for t in (self.ids, self.position, *itertools.chain.from_iterable(self.cache)):
            torch._dynamo.mark_static_address(t)
        on_gpu = device.type == "cuda"
        self.hand_graphed = on_gpu and self.level in HAND_GRAPHED_LEVELS
        self.compiled_graphs = on_gpu and self.level in COMPILED_LEVELS
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None  # the graph's output
        self.replays = 0

    @property
    def model(self):
        return self._model()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Writes the prompt ids (B, P) into the cache from position 0 on; returns the logits of its last
        token (B, vocab). The next step's token goes to position P."""
        batch, prompt = ids.shape
        if batch != self.ids.shape[0] or not 1 <= prompt <= self.rows:
            raise ValueError(f"Decoder.prefill: ids must be (batch, seq) = ({self.ids.shape[0]}, 1..{self.rows}), got "
                             f"shape {tuple(ids.shape)}")
        padded = prompt_rows(prompt, self.rows) if self.level in PADDED_LEVELS else prompt
        if padded > prompt:
            ids = torch.cat([ids, ids.new_zeros(batch, padded - prompt)], dim=1)
        positions = torch.arange(padded, device=ids.device)
        last = torch.full((1,), prompt - 1, dtype=torch.long, device=ids.device)  # a device index: no retrace per P
        if self.compiled_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.model.run("compute_cached", ids, positions, self.cache, last)
        self.position.fill_(prompt)
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, 1) at the current position -> their logits (B, vocab); the position moves on."""
        self.ids.copy_(tokens)
        if self.hand_graphed:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            self.replays += 1
            logits = self.logits
        else:
            if self.compiled_graphs:  # the previous step's outputs are consumed: its graph may run again
                torch.compiler.cudagraph_mark_step_begin()
            logits = self._run_step()
        self.position.add_(1)
        return logits

    def _run_step(self) -> torch.Tensor:
        return self.model.run("compute_step", self.ids, self.position, self.cache)

    def _capture(self) -> None:
        """Warm-up on a side stream (as torch.cuda.graphs recommends), then capture one step. The
        warm-up runs the step at the current position: it writes the same cache row the replay will
        write, from the same token, so running it more than once changes nothing."""
        device = self.ids.device
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._run_step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._run_step()
        self.graph = graph


def sample(logits: torch.Tensor, temperature: float, top_k: Optional[int],
           generator: Optional[torch.Generator]) -> torch.Tensor:
    """(B, vocab) -> (B, 1) token ids from softmax(logits / temperature) restricted to the top_k;
    temperature 0 takes the most likely token. On the device with no host sync: torch.multinomial
    checks its probabilities on the host, so this draws by an exponential race instead, the argmax
    of p / E with E ~ Exp(1) (taken as logits - log E), which picks token i with probability p_i."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # clamped: a zero draw would give +inf - inf = nan on a masked token
    noise = torch.empty_like(logits).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    return (logits - noise.log()).argmax(dim=-1, keepdim=True)


__all__ = ["CACHE_BUCKET", "Decoder", "cache_rows", "prompt_rows", "sample"]
