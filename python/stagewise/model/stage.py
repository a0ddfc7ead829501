"""One pipeline stage of a model: the embedding (first stage), layers ``[start, end)``, and the
final norm and LM head (last stage); :func:`load_stage` reads one from a checkpoint.

Under tensor parallelism every rank of the stage's ``groups.tp`` holds a :class:`StageModel` of its
shard and runs the same steps: the embedding and the LM head are vocab parallel
(:mod:`stagewise.model.layers.vocab`), the layers column/row parallel with one all-reduce after
attention and one after the MLP (see docs/model.md, "Tensor parallelism")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from stagewise.int_tensors import int_tensor
from stagewise.kv import KVCache, KVCacheSpec
from stagewise.model import architectures
from stagewise.model.architectures.base import StageBuild
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.decode_stack import build_decode_stack
from stagewise.model.layers.context_parallel import restore_pcp_rows
from stagewise.model.layers.rotary import Rotary
from stagewise.model.layers.vocab import LMHead, VocabEmbedding
from stagewise.model.loader import Checkpoint, load_stage_weights, open_checkpoint, resolve_dtype
from stagewise.model.loader.sharding import check_tp
from stagewise.model.quant import QuantizedWeight
from stagewise.model.rows import kv_heads_per_rank
from stagewise.model.shapes import LM_HEAD, embedding_name, final_norm_name, layer_prefix
from stagewise.model.vision.tower import VisionTower
from stagewise.model.weights import Weights


class StageModel(nn.Module):
    """Runs a :class:`StepBatch` through this stage's layers against this stage's KV cache."""

    def __init__(self, config: ModelConfig, start_layer: int, end_layer: int, layers: list[nn.Module],
                 embedding: VocabEmbedding | None, final_norm: nn.Module | None, lm_head: LMHead | None,
                 groups: StageGroups = StageGroups(), vision: VisionTower | None = None,
                 tokenizer_source: Path | None = None) -> None:
        super().__init__()
        self.config, self.start_layer, self.end_layer = config, start_layer, end_layer
        self.groups = groups
        self.layers = nn.ModuleList(layers)
        self.embedding, self.final_norm, self.lm_head = embedding, final_norm, lm_head
        self.vision = vision
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        # Steps without images run the layer loop in C++ where it can: the same ops as the Python
        # layers, the same bits. Where it cannot, python_loop_reason says why.
        self.python_loop_reason = _python_loop_reason(config, device, groups, range(start_layer, end_layer))
        self.decode_stack = None
        if self.python_loop_reason is None:
            self.decode_stack = build_decode_stack(layers, config.activation)
        self.tokenizer_source = tokenizer_source
        """The checkpoint whose tokenizer the last stage's structured-output constraints read
        (None: the stage was built from tensors alone)."""

    @classmethod
    def from_weights(cls, config: ModelConfig, start_layer: int, end_layer: int,
                     weights: Mapping[str, torch.Tensor | QuantizedWeight],
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     groups: StageGroups = StageGroups(), tokenizer_source: Path | None = None) -> StageModel:
        """Build from this rank's HF-named tensors, as :func:`~stagewise.model.loader.load_stage_weights`
        returns them (only this stage's are read; others may be absent): the shard of TP rank
        ``groups.tp.rank`` of ``groups.tp.size``, whose collectives the layers call.
        ``tokenizer_source``: the checkpoint they came from (:attr:`tokenizer_source`)."""
        if not 0 <= start_layer < end_layer <= config.num_layers:
            raise ValueError(f"StageModel: layer range [{start_layer}, {end_layer}) must be non-empty and within "
                             f"[0, num_layers={config.num_layers})")
        check_tp(config, groups.tp.rank, groups.tp.size)
        arch = architectures.of(config)
        w = Weights(weights, dtype, device)
        build = StageBuild(groups, Rotary(config, dtype, device), dtype, torch.device(device))
        layers = [arch.build_layer(config, i, layer_prefix(config, i), w, build) for i in range(start_layer, end_layer)]
        embedding = None
        if start_layer == 0:
            scale = None if arch.embedding_scale is None else arch.embedding_scale(config)
            embedding = VocabEmbedding(w(embedding_name(config)), config.vocab_size, groups.tp, scale)
        vision = None
        if start_layer == 0 and config.vision_config is not None and "model.visual.pos_embed.weight" in w:
            vision = VisionTower(config.vision_config, w)  # TP rank 0 only: the others take its output
        final_norm = lm_head = None
        if end_layer == config.num_layers:
            final_norm = arch.build_final_norm(config, final_norm_name(config), w)
            # Tied on a stage that also embeds: one tensor (this rank's vocab rows) for both.
            tied_here = config.tie_word_embeddings and embedding is not None
            lm_head = LMHead(embedding.weight if tied_here else w(LM_HEAD), config.vocab_size, groups.tp)
        return cls(config, start_layer, end_layer, layers, embedding, final_norm, lm_head, groups, vision,
                   tokenizer_source)

    @property
    def is_first(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last(self) -> bool:
        return self.end_layer == self.config.num_layers

    @torch.inference_mode()
    def encode_images(self, batch: StepBatch) -> StepBatch:
        """Stage 0: a step bringing images (``pixel_values``) as the step to run and send on: their
        tokens' embeddings (``image_embeds``) and DeepStack features at the rows of the image
        placeholder tokens (``visual_rows``). A step without images is returned as it is."""
        if batch.pixel_values is None:
            return batch
        embeds, deepstack = self.image_features(batch.pixel_values, batch.image_grid_thw)
        rows = (batch.token_ids == self.config.vision_config.image_token_id).nonzero().flatten()
        if rows.numel() != embeds.size(0):
            raise ValueError(f"StageModel.encode_images: the step has {rows.numel()} image placeholder tokens "
                             f"but its images give {embeds.size(0)} image tokens")
        return dataclasses.replace(batch, pixel_values=None, image_grid_thw=None, image_embeds=embeds,
                                   visual_rows=rows, deepstack=deepstack if deepstack.size(0) else None)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor,
                       image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: the vision tower's output for some images: the embeddings of their image tokens
        ``[N, hidden]`` and their DeepStack features ``[levels, N, hidden]`` (``levels`` may be 0)."""
        if self.vision is None:
            raise ValueError("StageModel: this stage has no vision tower (a text-only model, or not the first stage)")
        return self.vision(pixel_values, image_grid_thw)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """The shape of the KV cache this stage's layers write (this TP rank's KV heads)."""
        return cache_spec(self.config, self.start_layer, self.end_layer, tp_size=self.groups.tp.size,
                          block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv_cache: KVCache,
                meta: KVMetadata | Sequence[KVMetadata]) -> torch.Tensor | None:
        """Hidden states ``[T, hidden]`` for the next stage, or on the last stage logits:
        ``[R, vocab]`` at each request's last token (all of a row's tokens where it verifies drafts:
        ``batch.logit_rows()``), ``[T, vocab]`` with ``batch.all_logits``.

        Every TP rank of the stage runs the same step; hidden states come out whole on each. The
        logits are gathered to TP rank 0 only (where sampling runs): the last stage's other TP
        ranks return None. A prefill-context-parallel rank (``meta.pcp``, its share of ``batch``)
        runs its rows through the layers, and the stage's output rows are gathered back into
        ``batch``'s order on every rank of the PCP group.

        ``meta``: one per layer group of ``kv_cache`` (:mod:`stagewise.kv.window`), or one for every
        group, when the blocks of a manager without a window index each group's pool alike."""
        spec = kv_cache.spec
        if spec.layer_start != self.start_layer or spec.layer_end != self.end_layer:
            raise ValueError(f"StageModel.forward: kv_cache holds layers [{spec.layer_start}, "
                             f"{spec.layer_end}), expected [{self.start_layer}, {self.end_layer})")
        metas = [meta] if isinstance(meta, KVMetadata) else list(meta)
        if len(metas) not in (1, len(spec.group_windows)):
            raise ValueError(f"StageModel.forward: {len(metas)} KV metadata for a cache of "
                             f"{len(spec.group_windows)} layer groups; give one per group, or one for all")
        meta = metas[0]
        full, split = batch, meta.pcp
        if split is not None:
            batch = split.batch
        if self.is_first:
            if batch.token_ids is None:
                raise ValueError("StageModel.forward: the first stage needs batch.token_ids, got None")
            x, residual = self.embedding(batch.token_ids), None
            if batch.image_embeds is not None:
                x.index_copy_(0, batch.visual_rows, batch.image_embeds.to(x.dtype))
        else:
            if batch.hidden_states is None:
                raise ValueError("StageModel.forward: a later stage needs batch.hidden_states, got None")
            # Layers update x and residual in place: work on copies, never on the caller's tensors.
            x = batch.hidden_states.clone()
            residual = None if batch.residual is None else batch.residual.clone()
        if batch.pixel_values is not None:
            raise ValueError("StageModel.forward: the step still holds pixel_values; run encode_images first")
        stack = self.decode_stack if batch.num_tokens > 0 and split is None else None
        if stack is not None and batch.mrope_positions is None and batch.visual_rows is None:
            has_residual = residual is not None
            residual = residual if has_residual else torch.empty_like(x)
            if batch.num_prefills == 0:
                stack.decode(x, residual, has_residual, batch.positions, meta.slot_mapping, meta.block_tables,
                             meta.seq_lens, kv_cache.storage, kv_cache.scales)
            else:  # prompt runs after each request's cache, then decode rows
                stack.extend(x, residual, has_residual, batch.positions, meta.slot_mapping, meta.block_tables,
                             meta.seq_lens, meta.query_start_loc, meta.run_lens, kv_cache.storage, kv_cache.scales)
        else:
            levels = 0 if batch.deepstack is None else batch.deepstack.size(0)
            for i, layer in enumerate(self.layers):
                layer_meta = metas[kv_cache.layer_group[i]] if len(metas) > 1 else meta
                x, residual = layer(x, residual, batch, layer_meta, kv_cache.layer(self.start_layer + i))
                if i < levels:  # DeepStack: this level's features join the image tokens' hidden states
                    x = x if residual is None else x + residual
                    x.index_add_(0, batch.visual_rows, batch.deepstack[i].to(x.dtype))
                    residual = None
        if split is not None:
            x = restore_pcp_rows(x if residual is None else x + residual, split, self.groups.pcp)
            residual, batch = None, full
        if not self.is_last:
            # Sending x + residual rather than both halves the bytes; the next layer's norm sees
            # the same sum, rounded the same way, as fused_add_rms_norm would form.
            return x if residual is None else x + residual
        rows = batch.logit_rows()
        if not batch.all_logits and len(rows) < x.size(0):  # else every row is sampled: x as it is
            rows = int_tensor(rows, device=x.device)
            x, residual = x[rows], None if residual is None else residual[rows]
        x, _ = self.final_norm(x, residual)
        return self.lm_head(x)


def cache_spec(config: ModelConfig, start_layer: int, end_layer: int, *, tp_size: int, block_size: int,
               dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """The KV cache of layers ``[start_layer, end_layer)`` on one of ``tp_size`` tensor-parallel ranks,
    its sliding-window layers in groups of their own, its values stored as ``kv_cache_dtype`` says."""
    windows = architectures.layer_windows(config, range(start_layer, end_layer))
    return KVCacheSpec(layer_start=start_layer, layer_end=end_layer, num_kv_heads=kv_heads_per_rank(config, tp_size),
                       head_dim=config.head_dim, block_size=block_size, dtype=dtype,
                       windows=tuple(windows) if any(w is not None for w in windows) else (),
                       kv_cache_dtype=kv_cache_dtype)


def load_stage(checkpoint: Checkpoint | str | Path, start_layer: int, end_layer: int, *,
               dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu", quantized: bool | None = None,
               linear_precision: str = "exact", groups: StageGroups = StageGroups(),
               progress: Callable[[int, int, int], None] | None = None) -> StageModel:
    """The stage of layers ``[start_layer, end_layer)`` of ``checkpoint`` (a :class:`Checkpoint`, an HF
    folder, a GGUF file or an embedded model name): the shard of tensor-parallel rank
    ``groups.tp.rank`` of ``groups.tp.size`` (only that is read), whose layers reduce over ``groups.tp``.

    ``dtype``: ``"auto"`` (the config's dtype when it is float32/bfloat16/float16, else float32) or
    one of those; the weights are read in it and the stage computes in it. ``quantized``,
    ``linear_precision`` and ``progress`` are :func:`~stagewise.model.loader.load_stage_weights`'s.
    The weights are read, the stage is built on ``device``, and the read tensors are dropped."""
    ckpt = open_checkpoint(checkpoint)
    cfg = ckpt.config
    torch_dtype = resolve_dtype(dtype, cfg.dtype)
    weights = load_stage_weights(ckpt, start_layer, end_layer, tp_rank=groups.tp.rank, tp_size=groups.tp.size,
                                 dtype=torch_dtype, quantized=quantized, linear_precision=linear_precision,
                                 progress=progress)
    return StageModel.from_weights(cfg, start_layer, end_layer, weights, dtype=torch_dtype, device=device,
                                   groups=groups, tokenizer_source=ckpt.path)


def _python_loop_reason(config: ModelConfig, device: torch.device, groups: StageGroups,
                        layers: range) -> str | None:
    """Why a stage's decode steps cannot run the C++ layer loop (None: they can)."""
    if device.type != "cpu":
        return f"the C++ layer loop runs on the CPU, this stage on {device}"
    if groups.tp.size > 1:
        return f"the C++ layer loop cannot all-reduce, and this stage runs on {groups.tp.size} tensor-parallel ranks"
    if groups.cp_size > 1:
        return "the C++ layer loop does not shard the KV cache, and this stage is context parallel"
    reason = architectures.of(config).decode_stack
    if reason is not None:
        return f"{config.architecture}: {reason}"
    windowed = architectures.windowed_layers(config, layers)
    if windowed:
        return f"the C++ layer loop attends over every cached token, and layers {windowed} have a sliding window"
    return None

