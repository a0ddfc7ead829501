"""Paged KV cache of one stage: block pool, per-request bookkeeping, K/V tensors."""

from stagewise.kv.block_pool import BlockPool, OutOfKVBlocks
from stagewise.kv.cache import KVCache, KVCacheSpec
from stagewise.kv.manager import PAD_BLOCK_ID, KVCacheManager

__all__ = ["BlockPool", "OutOfKVBlocks", "KVCache", "KVCacheSpec", "KVCacheManager", "PAD_BLOCK_ID"]
