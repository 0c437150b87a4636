"""The torch engine: our own Llama-family forward over a paged KV pool, on a CPU or a CUDA GPU.

A pass packs every feed's tokens one after another (cloud/engine/batch.py) and runs llama.forward
once over them: one matrix product per weight for all sessions, one attention launch per layer for
every group. On CUDA the pass is padded to the next of a few token counts (GRAPH_TOKENS) and
replayed from a CUDA graph captured for that count at start-up, so a step costs a handful of host
copies and one launch instead of hundreds; a pass larger than the largest graph (a long prompt
chunk) runs the same kernels eagerly. Every kernel computes a row from that row alone
(triton_ops.py, torch_ops.py), so a token's scores are the same bits in a decode step, in a verify block,
beside other sessions and as a node of a draft tree: cloud-only and speculative decoding of the same
session produce the same tokens (docs/gpu.md, "Exactness by construction").

Graph sizes: a verify pass of B sessions × (γ + 1) tokens must find a graph close above it, or it
pays for the padding rows (64 × 5 = 320 tokens once replayed the 512-token graph at the 512-token
price). `graph_sizes` is vLLM's grid (1, 2, 4, every 8 to 256, every 16 beyond) plus, where given,
every B × (γ + 1) of the served block sizes; `GraphBudget` bounds how many are captured, for how long
and with how much memory, and the engine reports what capture took (`graph_report`).
"""
from __future__ import annotations

import bisect
import enum
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# cuBLAS turns split-K off when its workspace is this small (vLLM's batch-invariant mode on Hopper does
# the same); read once, when the process first multiplies on the GPU, so set before any product runs.
# Only weights a start-up check proves row-invariant are then multiplied by cuBLAS (triton_ops.py).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from .base import Capabilities, Feed, Scores  # noqa: E402
from .batch import ROWS, GroupTensors, HostPass, lay_out, stage  # noqa: E402
from .kinds import Products  # noqa: E402
from .kvpool import PAGE_TOKENS, KVPool, PageTable  # noqa: E402
from .llama import LlamaWeights, PassInputs, forward, from_model  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class Kernels(enum.Enum):
    """Which kernels compute a pass."""

    TORCH = "torch"  # plain torch (cloud/engine/torch_ops.py): CPUs
    TRITON = "triton"  # batch-invariant Triton kernels (cloud/engine/triton_ops.py): CUDA


GRAPH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # the first engine's graphs: powers of two
GRAPH_GROUP_TOKENS = 64  # queries (and fed path) of one group in a graph pass at most; beyond: eager
FINE_STEP, COARSE_STEP, FINE_UNTIL = 8, 16, 256  # graph sizes every 8 tokens up to 256, every 16 beyond
MAX_GRAPH_TOKENS = 512  # the largest graph by default: 64 sessions × 8 tokens
GRAPH_SESSIONS = 64  # the most sessions B whose passes of B × (γ + 1) tokens get graphs of their own


def graph_sizes(largest: int = MAX_GRAPH_TOKENS, blocks: Sequence[int] = (),
                graph_sessions: int = GRAPH_SESSIONS) -> tuple[int, ...]:
    """Pass sizes to capture, increasing: 1, 2, 4, every FINE_STEP up to FINE_UNTIL, every COARSE_STEP
    up to `largest` (which is always among them), and B × block for every served block size (γ + 1)
    and B ≤ graph_sessions that fits: a verify pass of B sessions then replays a graph of its own size."""
    grid = {1, 2, 4, *range(FINE_STEP, min(FINE_UNTIL, largest) + 1, FINE_STEP),
            *range(FINE_UNTIL + COARSE_STEP, largest + 1, COARSE_STEP), largest}
    grid |= {b * block for block in blocks for b in range(1, graph_sessions + 1) if b * block <= largest}
    return tuple(sorted(t for t in grid if 1 <= t <= largest))


def padded_size(tokens: int, sizes: Sequence[int]) -> int | None:
    """The graph size a pass of `tokens` tokens replays (the smallest of `sizes`, increasing, that holds
    it), or None: it runs eagerly, unpadded."""
    i = bisect.bisect_left(sizes, tokens)
    return sizes[i] if i < len(sizes) else None


def padding_waste(tokens: int, sizes: Sequence[int]) -> float:
    """The fraction of a replayed graph's rows that are padding for a pass of `tokens` tokens (0 eagerly)."""
    size = padded_size(tokens, sizes)
    return 0.0 if size is None else (size - tokens) / size


def capture_order(sizes: Sequence[int]) -> list[int]:
    """The largest first (the others reuse its memory pool), then powers of two (the first engine's
    graphs, so a tight budget still covers every size within 2×), then the rest, largest first."""
    largest = max(sizes)
    powers = sorted((t for t in sizes if t & (t - 1) == 0 and t != largest), reverse=True)
    rest = sorted((t for t in sizes if t not in powers and t != largest), reverse=True)
    return [largest, *powers, *rest]


@dataclass(frozen=True)
class GraphBudget:
    """What capturing graphs at start-up may take: sizes beyond it are not captured (their passes pad
    to the next captured size)."""

    max_graphs: int = 96
    max_seconds: float = 120.0
    max_mib: float = 4096.0  # device memory the graphs (and their memory pool) may hold

    def allows(self, graphs: int, seconds: float, mib: float) -> bool:
        """Whether another graph may be captured after `graphs` took `seconds` and `mib` (the first
        always may: without it every pass runs eagerly)."""
        return graphs == 0 or (graphs < self.max_graphs and seconds <= self.max_seconds and mib <= self.max_mib)


@dataclass
class GraphReport:
    """What capture took: reported at start-up (logged, and read by the GPU suite)."""

    graphs: int = 0
    seconds: float = 0.0
    mib: float = 0.0
    sizes: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()  # sizes the budget left out

    def describe(self) -> str:
        return (f"{self.graphs} CUDA graphs ({min(self.sizes, default=0)}..{max(self.sizes, default=0)} tokens) "
                f"captured in {self.seconds:.1f} s, {self.mib:.0f} MiB"
                + (f"; {len(self.skipped)} sizes left out by the budget" if self.skipped else ""))


@dataclass(frozen=True)
class EngineOptions:
    """How the torch engine runs on CUDA (ignored on a CPU, where plain torch runs eagerly)."""

    products: Products = Products.FUSED
    tune: bool = True  # time each weight's candidate tiles (and cuBLAS) at start-up; False: the reference tile
    cublas: bool = True  # let a weight that cuBLAS provably keeps row-invariant be multiplied by it
    graph_tokens: int = MAX_GRAPH_TOKENS  # the largest pass replayed from a graph
    blocks: tuple[int, ...] = ()  # served block sizes (γ + 1) whose B × (γ + 1) get graphs of their own
    graph_sessions: int = GRAPH_SESSIONS  # the most sessions B for `blocks`
    budget: GraphBudget = field(default_factory=GraphBudget)


@dataclass
class _Staged:
    """Host arrays of one pass in the layout `stage` writes, and the device tensors they become."""

    ints: np.ndarray
    path: np.ndarray
    tables: np.ndarray


class _Graph:
    """One CUDA graph of a pass of `tokens` tokens over static input buffers."""

    def __init__(self, engine: TorchEngine, tokens: int, pool: object) -> None:
        device, width = engine.device, engine.pages_per_sequence
        self.tokens = tokens
        self.ints = torch.zeros(len(ROWS), tokens, dtype=torch.int64, device=device)
        self.path = torch.zeros(tokens, GRAPH_GROUP_TOKENS, dtype=torch.int64, device=device)
        self.tables = torch.zeros(tokens, width, dtype=torch.int32, device=device)
        self.host = _Staged(torch.zeros(len(ROWS), tokens, dtype=torch.int64).pin_memory().numpy(),
                            torch.zeros(tokens, GRAPH_GROUP_TOKENS, dtype=torch.int64).pin_memory().numpy(),
                            torch.zeros(tokens, width, dtype=torch.int32).pin_memory().numpy())
        self._host_tensors = [torch.from_numpy(a) for a in (self.host.ints, self.host.path, self.host.tables)]
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.ints[2] = engine.pool.scratch_row  # an empty pass writes nowhere that matters
        inputs = engine.inputs(self.ints, self.path, self.tables, GRAPH_GROUP_TOKENS, max_len=0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and tune every kernel before capturing
            for _ in range(2):
                engine.run(inputs, graph=True)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            logits, self.hidden = engine.run(inputs, graph=True)
            # Into the logits buffer every graph shares: a graph's own output stays allocated for good,
            # and a hundred graphs' logits (tokens × vocabulary floats each) would take gigabytes.
            engine.graph_logits[:tokens].copy_(logits)
        self.logits = engine.graph_logits[:tokens]

    def replay(self, host: HostPass, scratch_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the pass's inputs in, replay; the outputs are this graph's own buffers."""
        self._copied.synchronize()  # the last pass's copies have read the host buffers we now overwrite
        stage(host, self.host.ints, self.host.path, self.host.tables, scratch_row)
        g = host.groups
        self.ints.copy_(self._host_tensors[0], non_blocking=True)
        self.path[:g].copy_(self._host_tensors[1][:g], non_blocking=True)
        self.tables[:g].copy_(self._host_tensors[2][:g], non_blocking=True)
        self._copied.record()
        self.graph.replay()
        return self.logits, self.hidden


class TorchEngine:
    """A Llama-family model's weights bound to a KV pool of `kv_tokens` tokens (implements
    engine.base.Engine; its KV handles are PageTables). `max_sequence_tokens`: the most one session
    may cache (sizes page tables and rotary tables; default: the whole pool). `graphs`: capture CUDA
    graphs (default: on CUDA). `kernels`: Triton's on CUDA, torch's elsewhere (torch's on CUDA run
    eagerly and promise no exactness: a fallback for GPUs Triton does not serve)."""

    def __init__(self, weights: LlamaWeights, kv_tokens: int, max_sequence_tokens: int = 0,
                 graphs: bool | None = None, kernels: Kernels | None = None,
                 options: EngineOptions | None = None) -> None:
        s = weights.shape
        self.options = options or EngineOptions()
        self.weights = weights
        self.device = weights.device
        # A session is bounded by the rotary tables' positions; its page table by the pool as well.
        self.max_sequence_tokens = min(max_sequence_tokens or weights.positions, weights.positions)
        self.pages_per_sequence = -(-min(self.max_sequence_tokens, kv_tokens) // PAGE_TOKENS)
        self.pool = KVPool(s.layers, s.kv_heads, s.head_dim, kv_tokens, weights.dtype, self.device)
        self.capabilities = Capabilities(name="torch", device=str(self.device),
                                         dtype=str(weights.dtype).removeprefix("torch."), feature_dim=s.hidden,
                                         tree_masks=True, max_sequence_tokens=self.max_sequence_tokens)
        self.kernels = kernels or (Kernels.TRITON if self.device.type == "cuda" else Kernels.TORCH)
        self.wide_tiles = False
        self.products: dict[str, str] = {}  # per weight, how it is multiplied (the start-up choice)
        self.graph_report = GraphReport()
        if self.kernels is Kernels.TRITON:
            from .triton_ops import TritonOps, check_tiles

            plan, fuse_rope = self._plan_products() if self.options.products is Products.FUSED else ({}, False)
            if self.options.products is Products.SPLIT:  # wide tiles only where they keep the narrow ones' bits
                layer = weights.layers[0]
                self.wide_tiles = check_tiles([layer.qkv, layer.o, layer.gate_up, layer.down, weights.lm_head])
            self._eager_ops = TritonOps(wide=self.wide_tiles, products=self.options.products, plan=plan,
                                        fuse_rope=fuse_rope)
            self._graph_ops = TritonOps(query_cap=GRAPH_GROUP_TOKENS, wide=self.wide_tiles,
                                        products=self.options.products, plan=plan, fuse_rope=fuse_rope)
            self.min_rows = 1
        else:
            from .torch_ops import TorchOps, row_floor

            hidden, q, kv, inter = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
            # The products TorchOps runs: the fused matrices' parts, one by one.
            shapes = sorted({(q, hidden), (kv, hidden), (hidden, q), (inter, hidden), (hidden, inter),
                             tuple(weights.lm_head.shape)})
            # The probe is of the CPU's matrix library; elsewhere torch's kernels promise nothing per row.
            self.min_rows = row_floor(shapes, s.head_dim, weights.dtype) if self.device.type == "cpu" else 1
            self._eager_ops = self._graph_ops = TorchOps(self.min_rows)
            graphs = False  # its attention loops on the host over a pass's key positions
        self._graphs: dict[int, _Graph] = {}
        self._sizes: list[int] = []  # captured sizes, increasing
        if graphs if graphs is not None else self.device.type == "cuda":
            self.capture()

    # ---- the KV cache (engine.base.Engine) -----------------------------------------------------

    @property
    def pass_settings(self) -> dict | None:
        """What besides the model and the capabilities makes a pass cost what it does (a curve kept on
        disk holds for these: cloud/core/cost_cache.py). None on CUDA, where kernels and graphs are
        chosen per card at start-up: its curve is measured at every start."""
        if self.device.type == "cuda":
            return None
        return {"library": f"torch {torch.__version__}", "threads": torch.get_num_threads(),
                "kernels": self.kernels.value, "min_rows": self.min_rows}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def fill(self) -> float:
        return 1.0 - self.pool.free_pages / self.pool.pages

    def new_sequence(self) -> PageTable:
        return PageTable(self.pool)

    def fits(self, kv: PageTable, extra: int) -> bool:
        return kv.pages_needed(extra) <= self.pool.free_pages

    def reserve(self, kv: PageTable, extra: int) -> None:
        kv.grow(extra)

    def copy_prefix(self, src: PageTable, dst: PageTable, length: int) -> None:
        """Copy `src`'s first `length` tokens' rows into pages of the empty `dst` (see Engine)."""
        dst.copy_prefix(src, length)

    def truncate(self, kv: PageTable, length: int) -> None:
        kv.truncate(length)

    def release(self, kv: PageTable) -> None:
        kv.release()

    def keep_rows(self, kv: PageTable, start: int, rows: Sequence[int]) -> None:
        """Move the accepted path's keys and values to consecutive rows, then cut the rest (see Engine)."""
        moved = [(start + i, start + r) for i, r in enumerate(rows) if r != i]
        if moved:
            table = kv.rows(kv.length, self.device)
            dst = table[torch.tensor([d for d, _ in moved], device=self.device)]
            src = table[torch.tensor([s for _, s in moved], device=self.device)]
            self.pool.move_rows(dst, src)
        kv.truncate(start + len(rows))

    # ---- passes --------------------------------------------------------------------------------

    def _plan_products(self) -> tuple[dict, bool]:
        """Each weight's product choice (triton_ops.tune_product), measured on layer 0's weights (every
        layer's weight of a shape shares it), and whether the rotary joins the q|k|v product's epilogue
        (only where check_rope_fusion finds the very bits of the two kernels)."""
        from .triton_ops import NARROW, ROW_BANDS, ProductChoice, check_rope_fusion, tune_product, weight_key

        w, layer = self.weights, self.weights.layers[0]
        # (name, weight, bias, out dtype, SiLU prologue): the products llama.forward asks for.
        products = [("qkv", layer.qkv, layer.qkv_bias, None, False), ("o", layer.o, layer.o_bias, None, False),
                    ("gate_up", layer.gate_up, None, None, False), ("down", layer.down, None, None, True),
                    ("head", w.lm_head, None, torch.float32, False)]
        plan = {}
        for name, weight, bias, out_dtype, silu in products:
            if self.options.tune and weight.is_cuda:  # timings mean something on a GPU only
                choice = tune_product(weight, bias, out_dtype, silu, self.options.graph_tokens if self.options.cublas
                                      else 0)
            else:
                choice = ProductChoice((NARROW,) * len(ROW_BANDS))
            plan[weight_key(weight, bias, out_dtype, silu)] = choice
            self.products[name] = choice.describe()
        qkv = plan[weight_key(layer.qkv, layer.qkv_bias, None)]
        s = w.shape
        fuse_rope = not qkv.cublas_rows and (not layer.qkv.is_cuda or check_rope_fusion(
            layer.qkv, layer.qkv_bias, w.cos, w.sin, s.heads, s.kv_heads, qkv))
        self.products["rotary"] = "in the q|k|v product's epilogue" if fuse_rope else "a kernel of its own"
        log.info("products: %s", "; ".join(f"{k}: {v}" for k, v in self.products.items()))
        return plan, fuse_rope

    def capture(self) -> None:
        """Capture a CUDA graph per size of `graph_sizes` within the budget (capture_order: the largest
        first, its memory pool reused by the smaller ones), and report what it took."""
        o, b = self.options, self.options.budget
        sizes = GRAPH_TOKENS if o.products is Products.SPLIT else graph_sizes(o.graph_tokens, o.blocks, o.graph_sessions)
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        self.graph_logits = torch.empty(max(sizes), self.weights.lm_head.shape[0], dtype=torch.float32,
                                        device=self.device)
        began = time.perf_counter()
        skipped = []
        with torch.inference_mode():
            for tokens in capture_order(sizes):
                used_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2 ** 20
                if not b.allows(len(self._graphs), time.perf_counter() - began, used_mib):
                    skipped.append(tokens)
                    continue
                self._graphs[tokens] = _Graph(self, tokens, pool)
        torch.cuda.synchronize()
        self._sizes = sorted(self._graphs)
        self.graph_report = GraphReport(len(self._graphs), round(time.perf_counter() - began, 2),
                                        round((free_before - torch.cuda.mem_get_info()[0]) / 2 ** 20, 1),
                                        tuple(self._sizes), tuple(sorted(skipped)))
        log.info("%s", self.graph_report.describe())

    def inputs(self, ints: torch.Tensor, path: torch.Tensor, tables: torch.Tensor, max_queries: int,
               max_len: int) -> PassInputs:
        """The forward's inputs over staged tensors (views: a graph's static buffers stay its inputs)."""
        meta = GroupTensors(positions=ints[1], q_start=ints[3], q_count=ints[4], past=ints[5], kv_len=ints[6],
                            path=path, tables=tables, page_tokens=PAGE_TOKENS, max_queries=max_queries,
                            max_len=max_len)
        return PassInputs(ids=ints[0], positions=ints[1], write_rows=ints[2], meta=meta)

    def run(self, inputs: PassInputs, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """llama.forward over staged inputs with the matching kernels."""
        return forward(self.weights, self.pool.keys, self.pool.values, inputs,
                       self._graph_ops if graph else self._eager_ops)

    @torch.inference_mode()
    def forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        """Append every feed's tokens to its session in one pass (see engine.base.Engine.forward)."""
        # 1. Lay the pass out on the host.
        host = lay_out(feeds, PAGE_TOKENS)
        # 2. Run it: a captured graph when one is large enough (logits of every row), else the same
        #    kernels eagerly (logits of the scored rows only: on a CPU the output head is costly).
        graph = self._graph_for(host)
        if graph is not None:
            logits, hidden = graph.replay(host, self.pool.scratch_row)
            logits, logit_rows = logits[:host.tokens], host.feed_rows
        else:
            logits, hidden, logit_rows = self._eager(host, [feed.scored for feed in feeds])
        # 3. The pass wrote every feed's keys: the tokens are now cached.
        for feed in feeds:
            feed.kv.length += len(feed.tokens)
        if logits is not None:
            logits = logits.clone()  # a graph's output buffers are overwritten by its next replay
        hidden = hidden[:host.tokens].clone() if any(feed.features for feed in feeds) else None
        return [Scores(logits[scored] if feed.scored else None, hidden[rows] if feed.features else None,
                       logits if feed.scored else None, scored)
                for feed, rows, scored in zip(feeds, host.feed_rows, logit_rows)]

    def _eager(self, host: HostPass, scored: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor, list[slice]]:
        """The pass without a graph: logits for the scored feeds' rows (at least `min_rows` of them),
        hidden states, and where each feed's logits lie among them."""
        tokens = max(host.tokens, self.min_rows)
        staged = _Staged(np.empty((len(ROWS), tokens), dtype=np.int64),
                         np.zeros((host.groups, host.max_path), np.int64),
                         np.zeros((host.groups, host.max_pages), np.int32))
        stage(host, staged.ints, staged.path, staged.tables, self.pool.scratch_row)
        ints, path, tables = (torch.from_numpy(a).to(self.device, non_blocking=True)
                              for a in (staged.ints, staged.path, staged.tables))
        rows, where, start = [], [], 0
        for rows_of_feed, is_scored in zip(host.feed_rows, scored):
            count = rows_of_feed.stop - rows_of_feed.start if is_scored else 0
            rows += range(rows_of_feed.start, rows_of_feed.stop) if is_scored else []
            where.append(slice(start, start + count))
            start += count
        if rows:
            rows += [rows[-1]] * (self.min_rows - len(rows))  # a product of at least min_rows rows
        inputs = self.inputs(ints, path, tables, host.max_queries, int(host.kv_len.max()))
        inputs.logit_rows = torch.tensor(rows, dtype=torch.int64).to(self.device)
        logits, hidden = self.run(inputs)
        return logits, hidden, where

    def _graph_for(self, host: HostPass) -> _Graph | None:
        """The smallest captured graph that holds the pass, if any does."""
        if not self._graphs or host.max_queries > GRAPH_GROUP_TOKENS or host.max_path > GRAPH_GROUP_TOKENS \
                or host.max_pages > self.pages_per_sequence:
            return None
        size = padded_size(host.tokens, self._sizes)
        return self._graphs[size] if size is not None else None


def engine_for(model: PreTrainedModel, kv_tokens: int, max_sequence_tokens: int = 0,
               graphs: bool | None = None) -> TorchEngine:
    """A torch engine over a loaded Hugging Face model's weights (the model itself is left as it was)."""
    positions = max_sequence_tokens or kv_tokens
    return TorchEngine(from_model(model, positions), kv_tokens, max_sequence_tokens, graphs)
