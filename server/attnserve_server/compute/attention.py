"""Multi-head attention on padded batches: torch.nn.MultiheadAttention's semantics.

Self attention with packed projections runs as one fused op, the one torch.nn.MultiheadAttention's
own inference fast path calls, so a batch crosses from Python into torch once: every op called
from Python gives up the GIL and must take it back, which costs a wait whenever the event loop
holds it (measured in BENCHMARKS.md). On the CPU that holds for small unmasked batches only (their scores, or
each small sequence's as `cpu_fused_bound` says, within FUSED_CPU_MAX_SCORE_BYTES): larger or masked ones take the
tiled path (`_tiled`: scaled_dot_product_attention between the two projections, which never holds a whole
batch's scores; on the CPU one call into torch, compute/scripted.py, elsewhere four). Cross attention, the
bare operation and odd head counts take the explicit path below, as torch's module does (but on the CPU the
fused op takes one X', key_value, as long as the query: `_fused_takes`); there one X' projects to keys and
values in one product, and on the CPU a batch computes in one call into torch as well, with its weights or
without. On the CPU the tiled and explicit paths' projections multiply on oneDNN or MKL, whichever was
measured faster on the CPU (compute/linear.py); the fused kernel multiplies with torch's own products inside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from attnserve_server.compute import scripted as scripted_path
from attnserve_server.compute.devices import cpu_family
from attnserve_server.compute.linear import Linear, resolve_cpu_matmul
from attnserve_server.compute.weights import Projections
from attnserve_server.domain import ModelKind, ModelSpec, compute_macs
from attnserve_server.settings import CPU_FUSED_BOUNDS


def visibility_mask(
    key_padding: torch.Tensor | None, causal: bool, query_len: int, key_len: int, device: torch.device
) -> torch.Tensor | None:
    """Bool mask, True where a query may attend a key: [N, 1, 1|L, S], or None if all may."""
    allowed = None if key_padding is None else ~key_padding[:, None, None, :]
    if causal:
        tril = torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril()
        allowed = tril if allowed is None else allowed & tril
    return allowed


log = logging.getLogger(__name__)

_T = TypeVar("_T")

# One batch's computation as compute/scripted.py's `_batches` takes it: its path (FUSED, TILED or EXPLICIT),
# tensors and flags.
Plan = tuple[int, list[torch.Tensor | None], list[int]]

_NATIVE_MHA = getattr(torch, "_native_multi_head_attention", None)

# On the CPU torch's fused kernel materialises every head's [L, S] scores for the whole batch and
# rescales, soft-maxes and multiplies them in separate passes; scaled_dot_product_attention's CPU
# kernel works through them in tiles, so its cost a sequence stays flat with the batch while the fused
# kernel's grows once the batch's scores outgrow the caches (W1 on one thread of an AMD EPYC Zen 2, µs a
# sequence: batch 4 586 against the tiled path's 561, 16 841 against 670, 64 904 against 698). The tiled
# path takes four calls into torch where the fused kernel takes one, and under load each call that gives up
# the GIL may wait to take it back. An unmasked CPU batch takes the fused kernel while its scores stay under
# this many bytes, and the tiled path beyond; what the bound applies to (the model's `cpu_fused_bound`)
# was measured on three CPUs, in pairs under perf_analyzer with inference mode on (BENCHMARKS.md):
# - "batch", the whole batch's scores (W1, 128 KiB a sequence: batches of up to 7; L=128 one; L=256 and WL
#   never): on the AVX2-only Zen 2 (fifty-fifth pass) W1 c=32 1.04x what "sequence" served (eleven runs),
#   c=64 1.08x, L=128 c=32 1.07x; half the bound served c=8 0.97x and c=32 0.98x, twice it tied.
# - "sequence", each sequence's scores alone, at any batch size (W1 and L=128 always fused): on an AVX-512
#   Zen 4 (sixty-second pass) W1 c=32 1.12x and 1.17x what "batch" served (6 of 6 pairs each), though
#   in-process the tiled path computed W1 there at 0.53-0.75x the fused kernel's cost a sequence on one
#   thread from batch 8. Under load the two cost the same on one thread there (795 against 810 µs a
#   sequence): what the fused kernel gains is that it computes a quarter of its batches on both threads
#   (compute/threads.py measures it faster there), where the tiled path's several calls never are.
#   That holds only while the requests are cheap, though, and the edge, not the compute, bounds what is
#   served: on the same Zen 4 (sixty-third pass, 4 pairs each) "batch" served E=256 L=160 (4 heads, 400 KiB
#   and 55 M multiply-adds a sequence) 1.06x what "sequence" served, E=320 L=128 (63 M) 1.09x, E=256 L=192
#   (4 heads, 69 M) 1.04x, E=512 L=64 (71 M) 1.06x and E=512 L=128 (151 M) 1.10x, where E=384 L=64 (41 M)
#   tied (0.98x) and E=256 L=128 (42 M) took 0.93x.
# - On an AVX2-only AMD EPYC Zen 3 (sixty-fourth pass) the fused kernel computed W1 on one thread at 0.95-0.96x
#   the tiled path's cost a sequence from batch 4 (0.84-0.88x on two), and "sequence" served W1 c=32 1.22x what
#   "batch" served (6 of 6 pairs), E=256 L=128 1.04x, E=512 L=64 (71 M) 1.08x, E=1024 L=64 (16 heads, 276 M)
#   1.08x, and tied at E=512 L=128 (151 M, 1.00x): no cut by a sequence's cost there.
# So "auto" is "batch" on AMD's family 23 (Zen to Zen 2), the one CPU measured to favour it; "sequence" on other
# CPUs whose torch kernels compute with AVX2 and not AVX-512 (the Zen 3); elsewhere (AVX-512, as on the Zen 4,
# and CPUs not measured) "sequence" for sequences of under FUSED_SEQUENCE_MAX_MACS multiply-adds, "batch" for
# larger ones.
FUSED_CPU_MAX_SCORE_BYTES = 1 << 20
FUSED_SEQUENCE_MAX_MACS = 48_000_000


def resolve_fused_bound(choice: str) -> tuple[str, int | None]:
    """The CPU's fused-kernel bound for a model's `cpu_fused_bound` setting: "batch" or "sequence", and
    with "sequence" the multiply-adds a sequence from which the batch bound applies instead (None: none)."""
    if choice != "auto":
        return choice, None
    if cpu_family() == ("AuthenticAMD", 23):
        return "batch", None
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        return "sequence", None
    return "sequence", FUSED_SEQUENCE_MAX_MACS


class AttentionCompute:
    """Y = concat_h(softmax(Q K^T / sqrt(d)) V) W_O for one model on one device."""

    def __init__(
        self,
        spec: ModelSpec,
        params: Projections | None,
        fused: bool = True,
        tiled: bool = True,
        cpu_matmul: str = "auto",
        fused_bound: str = "auto",
        scripted: bool = True,
    ) -> None:
        """`fused`: self attention may take torch's fused kernel; `tiled`: on the CPU, only while that
        pays (FUSED_CPU_MAX_SCORE_BYTES, applied as `fused_bound` says), the tiled path otherwise. Tests turn
        either off. `cpu_matmul`: how the CPU multiplies the projections (compute/linear.py; `auto` as measured
        on each CPU). `scripted`: on the CPU a batch of several sequences off the fused kernel, and a batch's
        length groups, compute in one call into torch where this torch can script the paths
        (compute/scripted.py), else op by op."""
        if (spec.kind is ModelKind.MHA) != (params is not None):
            raise ValueError("MHA models need projections; the bare operation has none")
        self.spec = spec
        self.params = params
        self.heads = spec.num_heads
        # torch's fused kernel takes the packed [W_Q; W_K; W_V], biases (zeros stand in for none) and
        # an even number of heads: the conditions of torch.nn.MultiheadAttention's own fast path.
        self.fused = fused and _NATIVE_MHA is not None and params is not None and params.packed is not None
        self.fused = self.fused and spec.num_heads % 2 == 0
        self.tiled = tiled  # consulted only where the fused kernel may run (packed projections)
        self.scripted = scripted and scripted_path.SCRIPTED is not None
        self.cpu_matmul = resolve_cpu_matmul(cpu_matmul)  # "onednn" or "aten"
        if fused_bound not in CPU_FUSED_BOUNDS:
            raise ValueError(f"fused_bound: expected one of {', '.join(CPU_FUSED_BOUNDS)}, got {fused_bound!r}")
        self.fused_bound, self.sequence_max_macs = resolve_fused_bound(fused_bound)
        if self.fused:
            p = params
            e = spec.embed_dim
            zeros = p.packed.new_zeros  # type: ignore[union-attr]
            self._qkv_bias = p.packed_bias if p.packed_bias is not None else zeros(3 * e)
            self._out_bias = p.out_bias if p.out_bias is not None else zeros(e)
        self._causal: dict[tuple[int, torch.dtype, torch.device, int], torch.Tensor] = {}
        self._smallest_tiled: dict[tuple[int, int], int | None] = {}  # smallest_tiled_batch's, per length
        self._in = self._kv = self._q = self._k = self._v = self._out = None
        if params is not None:
            p = params
            if p.packed is not None:
                e = spec.embed_dim
                self._in = Linear(p.packed, p.packed_bias, self.cpu_matmul)
                # [W_K; W_V]: one X' (key_value) projects to both keys and values in one product
                self._kv = Linear(p.packed[e:], None if p.packed_bias is None else p.packed_bias[e:], self.cpu_matmul)
            self._q = Linear(p.q_weight, p.q_bias, self.cpu_matmul)
            self._k = Linear(p.k_weight, p.k_bias, self.cpu_matmul)
            self._v = Linear(p.v_weight, p.v_bias, self.cpu_matmul)
            self._out = Linear(p.out_weight, p.out_bias, self.cpu_matmul)

    def _fused_mask(
        self, key_padding: torch.Tensor | None, causal: bool, query: torch.Tensor
    ) -> tuple[torch.Tensor | None, int | None]:
        """The mask and mask type the fused op takes, built as torch.nn.MultiheadAttention.merge_masks
        builds them: additive float masks, key padding [N, S] (type 1) or merged [N, h, L, L] (type 2)."""
        if key_padding is None and not causal:
            return None, None
        n, length, _ = query.shape
        padding = None
        if key_padding is not None:
            padding = torch.zeros(key_padding.shape, dtype=query.dtype, device=query.device)
            padding.masked_fill_(key_padding, float("-inf"))
        if not causal:
            return padding, None if padding is None else 1
        # Per stream too: a CUDA worker's lanes run on streams of their own, and a mask made on one
        # stream is not ready on another.
        stream = torch.cuda.current_stream(query.device).cuda_stream if query.is_cuda else 0
        key = (length, query.dtype, query.device, stream)
        future = self._causal.get(key)
        if future is None:
            # Cached per length; cleared if lengths keep changing.
            if len(self._causal) >= 64:
                self._causal.clear()
            blocked = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
            future = torch.zeros(length, length, dtype=query.dtype, device=query.device)
            future = self._causal[key] = future.masked_fill(blocked, float("-inf"))
        merged = future.view(1, 1, length, length).expand(n, self.heads, -1, -1)
        if padding is not None:
            merged = merged + padding.view(n, 1, 1, length).expand(-1, self.heads, -1, -1)
        return merged, 2

    def _fused_takes(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> bool:
        """Whether torch's fused kernel computes these inputs: self attention, or on the CPU one X' (key_value)
        as long as the query, which it projects by W_Q and by [W_K; W_V] apart. Under load it serves that
        cross attention 1.27x what the explicit path's dozen calls into torch do (BENCHMARKS.md, sixty-sixth
        pass); other lengths it refuses, and CUDA keeps the explicit path's SDPA kernels."""
        if key is None:
            return True
        return key is value and query.is_cpu and key.shape[1] == query.shape[1]

    def _fused_pays(
        self, query: torch.Tensor, key_padding: torch.Tensor | None, causal: bool, need_weights: bool
    ) -> bool:
        """Whether a batch runs faster on the fused kernel than on the tiled path (self attention) or the
        explicit one (cross attention)."""
        if need_weights or not self.tiled or not query.is_cpu:
            return True  # weights are materialised either way; CUDA's fused kernel calls SDPA's (head width 8k)
        if key_padding is not None or causal:
            return False
        n, length, _ = query.shape
        key = (length, query.element_size())
        tiled = self._smallest_tiled.get(key, 0)
        if tiled == 0:  # not yet known for this length (a batch a request's path asks about, so cached)
            if len(self._smallest_tiled) >= 4096:
                self._smallest_tiled.clear()
            tiled = self._smallest_tiled[key] = self.smallest_tiled_batch(*key)
        return tiled is None or n < tiled

    def smallest_tiled_batch(self, length: int, element_size: int) -> int | None:
        """How many unmasked CPU sequences of this length make a batch that takes the tiled path; None where
        none does (each sequence's scores under the bound, applied to each sequence)."""
        scores = self.heads * length * length * element_size
        if self.fused_bound == "sequence" and (
            self.sequence_max_macs is None or compute_macs(self.spec, 1, length, length) < self.sequence_max_macs
        ):
            return None if scores < FUSED_CPU_MAX_SCORE_BYTES else 1
        return max(1, -(-FUSED_CPU_MAX_SCORE_BYTES // scores))

    def _tiled(self, query: torch.Tensor, key_padding: torch.Tensor | None, causal: bool) -> Plan:
        """Packed self attention on scaled_dot_product_attention (compute/scripted.py's `_tiled`)."""
        n, length, _ = query.shape
        mask = None if key_padding is None else visibility_mask(key_padding, causal, length, length, query.device)
        w_in, onednn_in = self._in.operand(n * length)  # type: ignore[union-attr]
        w_out, onednn_out = self._out.operand(n * length)  # type: ignore[union-attr]
        tensors = [query, w_in, self._in.bias, w_out, self._out.bias, mask]  # type: ignore[union-attr]
        return scripted_path.TILED, tensors, [self.heads, int(causal), int(onednn_in), int(onednn_out)]

    def _scripted_else(self, scripted: Callable[[], _T], op_by_op: Callable[[], _T]) -> _T:
        """`scripted()`, or where it fails and `op_by_op()` computes the same batch, that: the scripted paths
        are then off for this model (a torch that scripts them but cannot run them), said once. Where both
        fail, op by op's error is the batch's own (a bad input, memory), and the scripted paths stay on."""
        try:
            return scripted()
        except RuntimeError as exc:
            out = op_by_op()
            if self.scripted:
                self.scripted = False
                log.warning(
                    "model %r: a scripted attention path failed where op by op computed the batch (%s: %s); "
                    "op by op from now on",
                    self.spec.name,
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                )
            return out

    def _products(
        self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None
    ) -> tuple[int, list[tuple[Linear, torch.Tensor]], torch.Tensor | None, torch.Tensor | None]:
        """How the explicit path projects its inputs (compute/scripted.py: BARE, PACKED, KEY_VALUE or APART),
        each product's Linear and input in turn, and the key and value the products leave as they are (BARE's)
        or take (KEY_VALUE's key, APART's key and value)."""
        if self.params is None:
            return scripted_path.BARE, [], key, value
        if key is None and self._in is not None:
            return scripted_path.PACKED, [(self._in, query)], None, None
        if key is not None and key is value and self._kv is not None:
            return scripted_path.KEY_VALUE, [(self._q, query), (self._kv, key)], key, None  # type: ignore[list-item]
        key = query if key is None else key
        value = query if value is None else value
        return scripted_path.APART, [(self._q, query), (self._k, key), (self._v, value)], key, value  # type: ignore[list-item]

    def _explicit(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        padding: torch.Tensor | None,
        causal: bool,
        weights: int,
    ) -> Plan:
        """The explicit path (compute/scripted.py's `_explicit`), with the weights `weights` asks for.
        `padding`: the key_padding mask [N, S] or None."""
        length, s = query.shape[1], query.shape[1] if key is None else key.shape[1]
        # Without weights SDPA cuts the causal future itself (is_causal); with them the mask carries it.
        masked = padding is not None or (causal and weights != scripted_path.NO_WEIGHTS)
        mask = visibility_mask(padding, causal, length, s, query.device) if masked else None
        projections, products, key, value = self._products(query, key, value)
        tensors: list[torch.Tensor | None] = [query, key, value]
        onednn = []
        for product, x in products:
            weight, on = product.operand(x.shape[0] * x.shape[1])
            tensors += [weight, product.bias]
            onednn.append(int(on))
        tensors += [None, None] * (3 - len(products))
        onednn += [0] * (3 - len(products))
        if self._out is not None:
            weight, on = self._out.operand(query.shape[0] * query.shape[1])
            tensors += [weight, self._out.bias]
            onednn.append(int(on))
        else:
            tensors += [None, None]
            onednn.append(0)
        tensors.append(mask)
        return scripted_path.EXPLICIT, tensors, [projections, self.heads, int(causal), weights, *onednn]

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        key_padding: torch.Tensor | None,
        causal: bool,
        need_weights: bool,
        average_weights: bool,
    ) -> Plan:
        """How one batch computes (its path, tensors and flags: compute/scripted.py's `_batches`). query
        [N, L, E]; key/value [N, S, *] or None (self attention); key_padding [N, S], True = ignore."""
        if self.fused and self._fused_takes(query, key, value):
            if self._fused_pays(query, key_padding, causal, need_weights):
                p = self.params
                mask, mask_type = self._fused_mask(key_padding, causal, query)
                tensors = [query, key, p.packed, self._qkv_bias, p.out_weight, self._out_bias, mask]  # type: ignore[union-attr]
                flags = [self.spec.embed_dim, self.heads, int(need_weights), int(average_weights)]
                return scripted_path.FUSED, tensors, [*flags, -1 if mask_type is None else mask_type]
            if key is None:
                return self._tiled(query, key_padding, causal)
        if not need_weights:
            weights = scripted_path.NO_WEIGHTS
        else:
            weights = scripted_path.AVERAGED if average_weights else scripted_path.PER_HEAD
        return self._explicit(query, key, value, key_padding, causal, weights)

    def compute(self, plans: list[Plan]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Computes batches as planned (`plan`), each its output and weights (or None): on the CPU in one call
        into torch (compute/scripted.py) where that pays, else op by op. Each call into torch gives up the
        GIL and must take it back (module docstring), so one call computes several batches (a batch's length
        groups, worker.py) or a batch of several sequences on the tiled or explicit path; one batch on the
        fused kernel is one call either way, and one sequence alone on another path (a lone request, mostly
        while the loop is quiet) computes op by op: the scripted call's own cost, ~15 µs more for causal W1
        on the Zen 3, outweighs its waits."""
        if self.scripted and self._one_call_pays(plans):
            return self._scripted_else(lambda: scripted_path.run(plans, True), lambda: scripted_path.run(plans, False))
        return scripted_path.run(plans, False)

    @staticmethod
    def _one_call_pays(plans: list[Plan]) -> bool:
        """Whether one scripted call computes these plans faster than op by op (`compute` says when)."""
        query = plans[0][1][0]
        assert query is not None
        if not query.is_cpu:
            return False
        return len(plans) > 1 or (plans[0][0] != scripted_path.FUSED and query.shape[0] > 1)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        key_padding: torch.Tensor | None,
        causal: bool,
        need_weights: bool,
        average_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One batch (`plan`, `compute`). query [N, L, E]; key/value [N, S, *] or None (self attention);
        key_padding [N, S], True = ignore."""
        return self.compute([self.plan(query, key, value, key_padding, causal, need_weights, average_weights)])[0]
