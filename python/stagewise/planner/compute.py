"""The analytic per-operator model of one stage's forward pass on one rank.

Each operator of our model code (norms, fused QKV, q/k norm + rope, KV write, attention, output
projection, gate/up, activation, down, router and experts, TP all-reduces, embedding, final norm,
LM head, sampling) becomes an :class:`Op` with the FLOPs it computes and the bytes it moves, for a
microbatch of ``rows`` sequences that each add ``new_tokens`` tokens after ``context`` cached ones
(prefill: ``new_tokens = I, context = 0``; decode: ``new_tokens = 1, context = c``). A device
profile turns an op into time by the roofline ``max(flops / achievable FLOP/s, bytes / achievable
bytes/s) + op_overhead``; an all-reduce costs ``2 (n - 1) / n * bytes / bandwidth + 2 (n - 1) * latency``
(ring all-reduce over the profile's TP link), an all-gather or reduce-scatter
``(n - 1) / n * bytes / bandwidth + (n - 1) * latency`` (``bytes``: the gathered buffer, or the one
reduced before it is scattered).

What grows with what: attention FLOPs with the (causal, windowed) query-key pairs, its bytes with
the cached context, each token's K/V row as the cache stores it (:meth:`Precision.kv_row`: an
int8 or fp8 cache reads ``head_dim + 2`` bytes a row, the float16 scale included; its dequantise
FLOPs are not priced); MoE layers compute ``num_experts_per_tok`` experts per token and read the
experts the microbatch touches (``E * (1 - (1 - k/E)^T)`` expected under uniform routing).
Per-rank work under TP: heads, MLP width and vocab divided by ``tp`` (KV heads replicated beyond);
expert FLOPs are shared by the stage's ``tp`` ranks, expert bytes by ``ep * moe_tp`` (the MoE
groups span all ranks, not one stage's). Text only: the vision tower is stored on stage 0 but not timed.

Context parallel (``cp = pcp * dcp`` ranks share each KV head's sequence, ``ceil(tokens / cp)`` of it each;
every collective over the TP link, the same node):

- decode (``cp > 1``): a rank reads ``ceil(keys / cp)`` of each row's cached keys and writes the new
  token's K/V on one rank of the group (``1 / cp`` of the writes each, on average); it computes the
  query heads of its whole DCP group (``hq * dcp``) over its keys. Per layer, as
  ``layers/context_parallel.py`` runs it: with ``dcp > 1`` an all-gather of q over the DCP group
  (``dcp * T * hq * d * act`` gathered); then each rank's partial outputs of those heads and their
  fp32 LSEs all-gathered in one buffer over the DCP group (``dcp * T * hq * dcp * (d * act + 4)``)
  and, with ``pcp > 1``, again over the PCP group (``cp`` times one rank's part); each rank merges
  its own heads' parts.
- prefill (``pcp > 1``, from an empty cache): each PCP rank runs ``ceil(I / pcp)`` of each prompt's
  ``I`` tokens through every op and ``1 / pcp`` of the causal query-key pairs (the head-tail split
  balances them); per layer an all-gather of K and V over the PCP group (``2 * T * hk * d * act``),
  at the end of the stage one of the hidden states (``T * hidden * act``). DCP alone leaves the
  prefill as it is (every DCP rank holds its KV head's prompt), but a rank writes only its share of
  the KV, ``1 / cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagewise.kv.cache import kv_row_bytes
from stagewise.model import architectures, shapes
from stagewise.model.config import ModelConfig
from stagewise.model.rows import kv_heads_per_rank
from stagewise.parallel.plan import PipelineStageInfo
from stagewise.planner.profiles import QUANT_BITS, DeviceProfile

KINDS = ("matmul", "attention", "vec", "comm")
BOUNDS = ("mem", "comm", "cube", "vec")


@dataclass(frozen=True, slots=True)
class Op:
    name: str
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    layer: int | None = None
    link: str = ""
    """comm ops: tp or ep."""
    group: int = 1
    """comm ops: ranks in the collective."""
    collective: str = ""
    """comm ops: all_reduce, all_gather, reduce_scatter or all_to_all (empty: all-reduce on the tp link,
    all-to-all on ep)."""
    weights: float = 0.0
    """matmul ops: weights multiplied (for block-quantised weights, which are decoded once a call)."""
    qtype: str = ""
    """matmul ops: the weights' GGUF block type (``q4_1`` ...), empty for dense weights."""
    decode: bool = False
    """attention ops: one new token per row over the cache (the runtime's decode kernel)."""
    outputs: int = 0
    """matmul ops: output features of the linear."""
    cache_bytes: float = 0.0
    """attention ops: bytes of cached K/V read."""


@dataclass(frozen=True, slots=True)
class Precision:
    weight: int = 2
    act: int = 2
    kv: int = 2
    """Bytes of a K/V value in the activations' dtype (what ``kv_cache_dtype`` ``auto`` stores)."""
    compute_dtype: str = "bfloat16"
    weight_quant: str = ""
    """GGUF block type of the decoder layers' linears (empty: dense ``weight``-byte weights)."""
    embed_quant: str = ""
    """GGUF block type of the embedding / LM head."""

    kv_cache_dtype: str = "auto"
    """What the cache stores a K/V value as (:data:`stagewise.kv.cache.KV_CACHE_DTYPES`)."""

    def weight_bytes(self, n: float, quant: str = "") -> float:
        return n * QUANT_BITS[quant] / 8 if quant else n * self.weight

    def kv_row(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) of one KV head in the cache, a compact cache's scale included:
        what a KV write stores and an attention reads (:func:`~stagewise.kv.cache.kv_row_bytes`)."""
        return kv_row_bytes(head_dim, self.kv, self.kv_cache_dtype)


def linear_op(name: str, prec: Precision, *, tokens: int, n_in: int, n_out: int, layer: int | None,
            quant: str | None = None) -> Op:
    """``tokens`` rows through a ``[n_out, n_in]`` linear: its weights once, activations in and out."""
    q = prec.weight_quant if quant is None else quant
    n = n_in * n_out
    return Op(name, "matmul", 2 * tokens * n, prec.weight_bytes(n, q) + tokens * (n_in + n_out) * prec.act, layer,
              weights=n, qtype=q, outputs=n_out)


def _causal_pairs(context: int, new: int, window: int | None) -> int:
    """Query-key pairs of ``new`` queries at positions ``context..context+new-1`` (each sees itself
    and everything before, at most ``window`` keys)."""
    def upto(n: int) -> int:  # sum over p < n of min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return upto(context + new) - upto(context)


def _tokens_per_rank(new_tokens: int, sharding: shapes.Sharding) -> int:
    """Tokens of each sequence one rank runs: a prefill under PCP splits the prompt over the PCP ranks."""
    return -(-new_tokens // sharding.pcp) if new_tokens > 1 and sharding.pcp > 1 else new_tokens


def layer_ops(config: ModelConfig, layer: int, *, rows: int, new_tokens: int, context: int, prec: Precision,
              sharding: shapes.Sharding) -> list[Op]:
    tp, pcp, dcp = sharding.tp, sharding.pcp, sharding.dcp
    cp = pcp * dcp
    h, d = config.hidden_size, config.head_dim
    hq, hk = config.num_heads // tp, kv_heads_per_rank(config, tp)
    work = architectures.of(config).layer_work(config, layer)
    w, a, row = prec.weight, prec.act, prec.kv_row(d)
    decode = new_tokens == 1
    T_all = rows * new_tokens
    T = rows * _tokens_per_rank(new_tokens, sharding)  # this rank's tokens through the linears
    ops = [Op("input_norm", "vec", 4 * T * h, 2 * T * h * a + h * w, layer)]
    n_qkv = (hq + 2 * hk) * d
    ops.append(linear_op("qkv_proj", prec, tokens=T, n_in=h, n_out=n_qkv, layer=layer))
    ops.append(Op("qk_norm_rope", "vec", 8 * T * (hq + hk) * d, 2 * T * (hq + hk) * d * a, layer))
    if not decode and pcp > 1:
        ops.append(Op("kv_all_gather", "comm", 0, 2 * T_all * hk * d * a, layer, "tp", pcp,
                      collective="all_gather"))
    ops.append(Op("kv_write", "vec", 0, T_all * 2 * hk * (d * a + row) / cp, layer))
    keys = min(context + new_tokens, work.window or context + new_tokens)
    if decode and cp > 1:
        if dcp > 1:
            ops.append(Op("q_all_gather", "comm", 0, dcp * T * hq * d * a, layer, "tp", dcp, collective="all_gather"))
        heads, keys = hq * dcp, -(-keys // cp)
        pairs = rows * keys
    else:
        heads = hq
        pairs = rows * _causal_pairs(context, new_tokens, work.window)
        pairs = -(-pairs // pcp) if not decode else pairs
    cache = rows * keys * 2 * hk * row
    ops.append(Op("attention", "attention", 4 * heads * d * pairs, cache + 2 * T * heads * d * a, layer,
                  decode=decode, cache_bytes=cache))
    if decode and cp > 1:  # the combine, as layers/context_parallel.py runs it
        part = T * hq * dcp * (d * a + 4)  # one rank's partial outputs and fp32 LSEs, every head of the group
        if dcp > 1:
            ops.append(Op("partials_all_gather", "comm", 0, dcp * part, layer, "tp", dcp, collective="all_gather"))
        if pcp > 1:
            ops.append(Op("partials_pcp_all_gather", "comm", 0, cp * part, layer, "tp", pcp,
                          collective="all_gather"))
    ops.append(linear_op("o_proj", prec, tokens=T, n_in=hq * d, n_out=h, layer=layer))
    if work.post_norms:
        ops.append(Op("attn_out_norm", "vec", 4 * T * h, 2 * T * h * a + h * w, layer))
    if tp > 1:
        ops.append(Op("attn_all_reduce", "comm", 0, T * h * a, layer, "tp", tp, collective="all_reduce"))
    ops.append(Op("post_attn_norm", "vec", 5 * T * h, 3 * T * h * a + h * w, layer))
    if work.mlp == "experts":
        e, k, mi = config.moe.num_experts, config.moe.num_experts_per_tok, config.moe.intermediate_size
        ops.append(Op("router", "matmul", 2 * T * h * e, h * e * w + T * (h + e) * a, layer))
        touched = 1.0 - (1.0 - k / e) ** T
        expert_bytes = touched * (e // sharding.ep) * 3 * h * (mi // sharding.moe_tp) * w
        if sharding.ep > 1:
            a2a = T * k * h * a / tp * (sharding.ep - 1) / sharding.ep
            ops.append(Op("moe_dispatch", "comm", 0, a2a, layer, "ep", sharding.ep, collective="all_to_all"))
        ops.append(Op("experts", "matmul", 2 * T * k * 3 * h * mi / tp, expert_bytes + T * k * (2 * h + 3 * mi) * a / tp,
                      layer))
        if sharding.ep > 1:
            ops.append(Op("moe_combine", "comm", 0, a2a, layer, "ep", sharding.ep, collective="all_to_all"))
    else:
        inter = config.intermediate_size // tp
        n_up = (2 if work.mlp == "gated" else 1) * inter
        ops.append(linear_op("gate_up_proj", prec, tokens=T, n_in=h, n_out=n_up, layer=layer))
        ops.append(Op("act", "vec", 8 * T * inter, (n_up + inter) * T * a, layer))
        ops.append(linear_op("down_proj", prec, tokens=T, n_in=inter, n_out=h, layer=layer))
    if tp > 1:
        ops.append(Op("mlp_all_reduce", "comm", 0, T * h * a, layer, "tp", tp, collective="all_reduce"))
    if work.post_norms:
        ops.append(Op("mlp_out_norm", "vec", 4 * T * h, 2 * T * h * a + h * w, layer))
    return ops


def vision_ops(config: ModelConfig, *, images: int, image_tokens: int, prec: Precision) -> list[Op]:
    """The vision tower over ``images`` images of ``image_tokens`` merged tokens each (Qwen3-VL):
    ``image_tokens * merge ** 2`` patches per image through the patch embedding and the ViT blocks
    (attention within each image), then the merger and the DeepStack mergers on the merged tokens.
    The tower's weights are whole on every rank (replicated), read once per step."""
    v = config.vision_config
    if v is None or images == 0 or image_tokens == 0:
        return []
    per_image = image_tokens * v.spatial_merge_size**2
    p, n, vh, vi = images * per_image, images * image_tokens, v.hidden_size, v.intermediate_size
    ops = [linear_op("vit_patch_embed", prec, tokens=p, n_in=v.patch_features, n_out=vh, layer=None, quant="")]
    for _ in range(v.depth):
        ops.append(Op("vit_norms", "vec", 9 * p * vh, 4 * p * vh * prec.act))
        for name, n_in, n_out in (("vit_qkv", vh, 3 * vh), ("vit_proj", vh, vh), ("vit_fc1", vh, vi), ("vit_fc2", vi, vh)):
            ops.append(linear_op(name, prec, tokens=p, n_in=n_in, n_out=n_out, layer=None, quant=""))
        ops.append(Op("vit_attention", "attention", 4 * vh * images * per_image**2, 4 * p * vh * prec.act))
    for _ in range(1 + len(v.deepstack_visual_indexes)):
        ops.append(linear_op("vit_merger_fc1", prec, tokens=n, n_in=v.merged_width, n_out=v.merged_width, layer=None,
                             quant=""))
        ops.append(linear_op("vit_merger_fc2", prec, tokens=n, n_in=v.merged_width, n_out=v.out_hidden_size,
                             layer=None, quant=""))
    return ops


def stage_ops(config: ModelConfig, stage: PipelineStageInfo, *, rows: int, new_tokens: int, context: int,
              prec: Precision = Precision(), sharding: shapes.Sharding = shapes.Sharding(),
              image_tokens: int = 0) -> list[Op]:
    """Every op of ``stage`` for one microbatch on one rank (logits only for each row's last token);
    a prefill on the first stage also runs the vision tower over one image of ``image_tokens`` merged
    tokens per row."""
    for name, value in (("rows", rows), ("new_tokens", new_tokens), ("context", context),
                        ("image_tokens", image_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"stage_ops: {name} must be an int >= 0, got {value!r}")
    h, T, a, w = config.hidden_size, rows * new_tokens, prec.act, prec.weight
    ops: list[Op] = []
    if stage.is_first_stage and new_tokens > 1:
        ops += vision_ops(config, images=rows, image_tokens=image_tokens, prec=prec)
    if stage.is_first_stage:
        tr = rows * _tokens_per_rank(new_tokens, sharding)
        ops.append(Op("embedding", "vec", 0, tr * (prec.weight_bytes(h, prec.embed_quant) + h * a)))
        if sharding.tp > 1:  # vocab parallel: each rank looks up its rows, then one all-reduce
            ops.append(Op("embedding_all_reduce", "comm", 0, tr * h * a, None, "tp", sharding.tp,
                          collective="all_reduce"))
    for layer in stage.active_layer_indices:
        ops += layer_ops(config, layer, rows=rows, new_tokens=new_tokens, context=context, prec=prec, sharding=sharding)
    if new_tokens > 1 and sharding.pcp > 1:  # every PCP rank's share of the prompts, for the next stage / LM head
        ops.append(Op("hidden_all_gather", "comm", 0, T * h * a, None, "tp", sharding.pcp, collective="all_gather"))
    if stage.is_last_stage:
        tp, v = sharding.tp, config.vocab_size
        vr = -(-v // tp)
        ops.append(Op("final_norm", "vec", 4 * rows * h, 2 * rows * h * a + h * w))
        ops.append(linear_op("lm_head", prec, tokens=rows, n_in=h, n_out=vr, layer=None, quant=prec.embed_quant))
        if tp > 1:  # each rank's logits gathered to the leader (timed as an all-gather of them)
            ops.append(Op("logits_gather", "comm", 0, rows * vr * tp * 4, None, "tp", tp, collective="all_gather"))
        ops.append(Op("sampling", "vec", 4 * rows * v, rows * v * 4))
    return ops


def quant_linear_s(q: dict, weights: float, flops: float, outputs: float = 0.0) -> float:
    """A block-quantised linear of ``weights`` weights in ``outputs`` output rows computing
    ``flops`` (``rows = flops / (2 * weights)``) with the profile's ``quant[type]`` figures:
    ``weights * s_per_weight + flops / flops_rate``; or, where the kernel was timed at several row
    counts, ``weights * rows_s_per_weight[r] + outputs * rows_s_per_output[r]`` at each measured
    ``r``, linear in rows between them (the smallest count's figure below it), and beyond the
    largest that figure plus the extra rows' FMAs at the FMA rate."""
    table = q.get("rows_s_per_weight")
    if not table or weights <= 0:
        return weights * q["s_per_weight"] + flops / q["flops"]
    per_out = q.get("rows_s_per_output") or {}
    rows = flops / (2 * weights)
    pts = sorted((int(r), weights * v + outputs * per_out.get(r, 0.0)) for r, v in table.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    if rows >= pts[-1][0]:
        return pts[-1][1] + 2 * (rows - pts[-1][0]) * weights / q["flops"]
    for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
        if r0 <= rows <= r1:
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
    raise AssertionError("unreachable")


def op_time(op: Op, profile: DeviceProfile, dtype: str) -> tuple[float, str]:
    """Seconds and the bound (mem, comm, cube or vec) of ``op`` on one rank of ``profile``."""
    if op.kind == "comm":
        link = profile.links[op.link]
        n = op.group
        # Measured on this host for this group size (the call as the runtime makes it): that time.
        if op.collective == "all_gather":
            measured = link.measured_s("all_gather", n, op.bytes / n)
        elif op.collective in ("all_reduce", "reduce_scatter") or op.collective == "" and op.link == "tp":
            measured = link.measured_s("all_reduce", n, op.bytes)  # a reduce-scatter moves what an all-reduce does
        else:
            measured = None
        if measured is not None:
            return measured, "comm"
        if op.collective in ("all_gather", "reduce_scatter"):  # ring: bytes the gathered / reduced buffer
            t = (n - 1) / n * op.bytes / link.bandwidth + (n - 1) * link.latency_s
        elif op.collective == "all_reduce" or op.collective == "" and op.link == "tp":  # ring all-reduce
            t = 2 * (n - 1) / n * op.bytes / link.bandwidth + 2 * (n - 1) * link.latency_s
        else:  # all-to-all: bytes already the off-rank share
            t = op.bytes / link.bandwidth + (n - 1) * link.latency_s
        return t + profile.op_overhead_s, "comm"
    mem_t = op.bytes / profile.bandwidth
    overhead = 0.0 if profile.framework else profile.op_overhead_s
    if op.kind == "matmul" and op.qtype and op.qtype in profile.quant:
        # Block-quantised kernel: every weight decoded once per call, then the FMAs of every row.
        flop_t, bound = quant_linear_s(profile.quant[op.qtype], op.weights, op.flops, op.outputs), "cube"
    elif op.kind == "matmul":
        flop_t, bound = op.flops / profile.flops(dtype), "cube"
    elif op.kind == "attention" and op.decode and profile.attention_decode:
        # The runtime's decode kernel, measured with its cache coming from memory (one call a layer).
        q = profile.attention_decode
        flop_t, bound = q["call_s"] + op.flops / q["flops"] + op.cache_bytes / q.get("bandwidth", float("inf")), "cube"
    elif op.kind == "attention":
        flop_t, bound = op.flops / profile.attention_flops(dtype), "cube"
    else:  # vector work: a fraction of the matmul rate (no tensor cores / FMA chains)
        flop_t, bound = op.flops / (profile.flops(dtype) * 0.1), "vec"
    if mem_t >= flop_t:
        return mem_t + overhead, "mem"
    return flop_t + overhead, bound


@dataclass(frozen=True, slots=True)
class StageCompute:
    time_s: float
    by_bound: dict[str, float]
    flops: float
    bytes: float
    num_ops: int


def stage_role(stage: PipelineStageInfo) -> str:
    """``engine`` (one stage), ``head`` (stage 0), ``last`` or ``middle``: whose fixed step cost applies."""
    if stage.is_first_stage and stage.is_last_stage:
        return "engine"
    return "head" if stage.is_first_stage else "last" if stage.is_last_stage else "middle"


def framework_time(profile: DeviceProfile, role: str, num_layers: int, python_loop: bool = False,
                   cp: bool = False) -> float:
    """The runtime's fixed cost of one step of a stage (profile ``framework``; 0 without it):
    ``num_layers * layer_s + <role>_s``; ``python_loop``: the ranks of a TP/CP stage, which run their
    layers in Python (``python_layer_s``) where one process runs its decode layer loop in C++;
    ``cp``: a context-parallel stage's decode, each layer's attention combine (``cp_layer_s``)."""
    fw = profile.framework
    if not fw:
        return 0.0
    layer = fw.get("python_layer_s", fw.get("layer_s", 0.0)) if python_loop else fw.get("layer_s", 0.0)
    if cp:
        layer += fw.get("cp_layer_s", 0.0)
    return num_layers * layer + fw.get(f"{role}_s", 0.0)


def stage_compute(ops: list[Op], profile: DeviceProfile, dtype: str, *, role: str | None = None,
                  num_layers: int = 0, python_loop: bool = False, cp: bool = False) -> StageCompute:
    """Sum of the ops' times, plus (with ``role``) the framework's per-step cost, counted as vec."""
    by_bound = dict.fromkeys(BOUNDS, 0.0)
    for op in ops:
        t, bound = op_time(op, profile, dtype)
        by_bound[bound] += t
    if role is not None:
        by_bound["vec"] += framework_time(profile, role, num_layers, python_loop, cp)
    return StageCompute(sum(by_bound.values()), by_bound, sum(o.flops for o in ops), sum(o.bytes for o in ops), len(ops))
