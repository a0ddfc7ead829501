"""The paged K/V tensors of one stage's layer range ``[layer_start, layer_end)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagewise import ops

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Default KV size when none is given: every row at full length, but at most this share of the
# memory left after the weights, and on CPU at most DEFAULT_CPU_KV_BYTES (a CPU run rarely fills
# more).
DEFAULT_KV_FRACTION = {"cpu": 0.25, "cuda": 0.5}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(kw_only=True, slots=True, frozen=True)
class KVCacheSpec:
    """Shape of a stage's cache, independent of how many blocks it gets."""

    layer_start: int
    """First layer (global model index) this stage runs."""
    layer_end: int
    """One past its last layer."""
    num_kv_heads: int
    """KV heads stored by this rank (after any TP split)."""
    head_dim: int
    block_size: int
    """Token slots per block."""
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name, low in (("layer_start", 0), ("num_kv_heads", 1), ("head_dim", 1), ("block_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"KVCacheSpec: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.layer_end, int) or self.layer_end <= self.layer_start:
            raise ValueError(
                f"KVCacheSpec: layer_end must be an int > layer_start={self.layer_start}, got {self.layer_end!r}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVCacheSpec: dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def bytes_per_block(self) -> int:
        """K and V of one block in every layer: 2 * layers * block_size * Hk * D * dtype size."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_bytes(self, kv_cache_bytes: int) -> int:
        """The most blocks that fit in ``kv_cache_bytes``; ValueError if not even one."""
        n = kv_cache_bytes // self.bytes_per_block()
        if n < 1:
            raise ValueError(
                f"KVCacheSpec: kv_cache_bytes={kv_cache_bytes} holds no block; one block of layers "
                f"[{self.layer_start}, {self.layer_end}) needs {self.bytes_per_block()} bytes"
            )
        return n

    def num_blocks_for_tokens(self, max_num_tokens: int) -> int:
        """Blocks for ``max_num_tokens`` stored token slots: ``ceil(n / block_size)``."""
        if max_num_tokens < 1:
            raise ValueError(f"KVCacheSpec: max_num_tokens must be >= 1, got {max_num_tokens}")
        return -(-max_num_tokens // self.block_size)


class KVCache:
    """K and V caches ``[num_blocks, block_size, Hk, D]`` for each layer of the range.

    Storage is one tensor ``[num_layers, 2, num_blocks, block_size, Hk, D]``: a
    single allocation is exactly :meth:`KVCacheSpec.bytes_per_block` x num_blocks
    (no per-layer rounding or fragmentation), and each layer's K and V are
    contiguous views of it, as the cache ops require. Give exactly one of
    ``num_blocks``, ``kv_cache_bytes`` or ``max_num_tokens``.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_tokens: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        sizes = {"num_blocks": num_blocks, "kv_cache_bytes": kv_cache_bytes, "max_num_tokens": max_num_tokens}
        given = [name for name, value in sizes.items() if value is not None]
        if len(given) != 1:
            raise ValueError(f"KVCache: give exactly one of num_blocks, kv_cache_bytes, max_num_tokens; got {given}")
        if kv_cache_bytes is not None:
            num_blocks = spec.num_blocks_for_bytes(kv_cache_bytes)
        elif max_num_tokens is not None:
            num_blocks = spec.num_blocks_for_tokens(max_num_tokens)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"KVCache: num_blocks must be an int >= 1, got {num_blocks!r}")
        self.spec = spec
        self.num_blocks = num_blocks
        # Not zeroed: no kernel reads a slot no request has written (decode attention stops at each
        # sequence's length on the CPU and skips masked slots on the GPU; prefills attend over their
        # own K/V), so the pool costs no start-up time and its pages are touched only as they fill.
        # tests/model/test_decode_stack.py runs steps and whole generations on a NaN-filled pool.
        self.storage = torch.empty(
            (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of global layer ``i``, each ``[num_blocks, block_size, Hk, D]``."""
        if not self.spec.layer_start <= i < self.spec.layer_end:
            raise ValueError(
                f"KVCache.layer: layer {i} is outside this stage's range "
                f"[{self.spec.layer_start}, {self.spec.layer_end})"
            )
        kv = self.storage[i - self.spec.layer_start]
        return kv[0], kv[1]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k, v [T, Hk, D]`` of layer ``i`` at ``slot_mapping [T]`` (-1 = skip)."""
        k_cache, v_cache = self.layer(i)
        ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def num_cache_blocks(spec: KVCacheSpec, device: torch.device | str, *, max_num_seqs: int, max_model_len: int,
                     kv_cache_bytes: int | None = None, max_num_tokens: int | None = None,
                     cp_world_size: int = 1) -> int:
    """Blocks of a stage's cache: from ``kv_cache_bytes`` or ``max_num_tokens`` when one is given
    (not both), else every row at full length, capped by :data:`DEFAULT_KV_FRACTION` of the free
    memory (and :data:`DEFAULT_CPU_KV_BYTES` on CPU), but room for one full row. Under context
    parallelism a rank stores ``ceil(max_model_len / cp_world_size)`` tokens of a full row (and
    ``1 / cp_world_size`` of ``max_num_tokens``)."""
    if kv_cache_bytes is not None and max_num_tokens is not None:
        raise ValueError("KV cache: give at most one of kv_cache_bytes and max_num_tokens, got both")
    if not isinstance(cp_world_size, int) or cp_world_size < 1:
        raise ValueError(f"KV cache: cp_world_size must be an int >= 1, got {cp_world_size!r}")
    if kv_cache_bytes is not None:
        return spec.num_blocks_for_bytes(kv_cache_bytes)
    if max_num_tokens is not None:
        return spec.num_blocks_for_tokens(-(-max_num_tokens // cp_world_size))
    device = torch.device(device)
    row = -(-max_model_len // cp_world_size)  # tokens of one full row on this rank
    want = max_num_seqs * row
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap_bytes = int(free * DEFAULT_KV_FRACTION["cuda"])
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cap_bytes = min(int(free * DEFAULT_KV_FRACTION["cpu"]), DEFAULT_CPU_KV_BYTES)
    cap = cap_bytes // (spec.bytes_per_block() // spec.block_size)
    return spec.num_blocks_for_tokens(max(min(want, cap), min(want, row), spec.block_size))
