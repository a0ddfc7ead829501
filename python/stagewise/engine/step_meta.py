"""A rank's KV metadata of recent decode steps, advanced in place instead of built afresh.

In steady decode a group's next step holds the same requests, each one position further. Unless
a request crosses into a new block, its block table stays the same and its slot is the next one
of the same block, so the step's :class:`~stagewise.model.kv_metadata.KVMetadata` is the previous one
with ``slot_mapping`` and ``seq_lens`` one higher: adding one in place instead of building the
block tables, slot mapping and lengths from the manager, which every stage of a pipeline pays
once per token (at batch 1 on a CPU ~250 us, most of it torch's dispatch running with the caches
cold after the step's weights went through them).

Only plain layouts take this path: no sliding window (its blocks leave the table), no context
parallelism (a position's slot depends on the rank), no PCP split. Everything else, and every step
that crosses a block boundary, builds afresh; the result is the same tensors either way
(``tests/engine/test_step_meta.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

from stagewise.kv import KVCacheManager
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata, PcpSplit

MAX_ENTRIES = 8
"""Decode batches remembered per manager: one per microbatch group in flight is what steady
decode needs; the oldest goes first."""
BUFFER_ROWS = 64
"""Up to this many rows, CPU tensors are advanced element by element through a memoryview (a
fraction of a microsecond each, where an in-place tensor op costs tens of microseconds with the
interpreter's caches cold after a step); larger batches by ``add_``."""


class StepMetadata:
    """The KV metadata of one manager's steps (see the module docstring)."""

    def __init__(self, manager: KVCacheManager, device: torch.device) -> None:
        self.manager, self.device = manager, device
        self.plain = manager.window is None and manager.cp_world_size == 1
        self._entries: dict[tuple[Hashable, ...], tuple[tuple[int, ...], KVMetadata, tuple | None]] = {}
        """Request ids of a decode step -> (their context lengths then, its metadata, memoryviews of
its ``slot_mapping`` and ``seq_lens`` on the CPU)."""

    def build(self, batch: StepBatch, pcp: PcpSplit | None = None) -> KVMetadata:
        """``batch``'s metadata; the manager already holds its tokens (as for
        :meth:`KVMetadata.build`)."""
        if not self.plain or pcp is not None or batch.num_prefills:
            return KVMetadata.build(batch, self.manager, self.device, pcp=pcp)
        key, lens = batch.request_ids, batch.context_lens
        entry = self._entries.pop(key, None)
        size = self.manager.block_size
        if entry is not None and all(n == p + 1 and n % size for n, p in zip(lens, entry[0])):
            _, meta, views = entry
            if views is None:
                meta.slot_mapping.add_(1)
                meta.seq_lens.add_(1)
            else:  # element by element through the buffer: a tensor op costs more at these sizes
                for view in views:
                    for i in range(len(view)):
                        view[i] += 1
        else:
            meta = KVMetadata.build(batch, self.manager, self.device)
            views = None
            if meta.slot_mapping.device.type == "cpu" and len(lens) <= BUFFER_ROWS:
                views = (memoryview(meta.slot_mapping.numpy()), memoryview(meta.seq_lens.numpy()))
            if len(self._entries) >= MAX_ENTRIES:
                del self._entries[next(iter(self._entries))]
        self._entries[key] = (lens, meta, views)
        return meta

    def forget(self, request_ids: Iterable[Hashable]) -> None:
        """Drop the steps that held any of these requests (they ended here)."""
        gone = set(request_ids)
        for key in [k for k in self._entries if not gone.isdisjoint(k)]:
            del self._entries[key]
