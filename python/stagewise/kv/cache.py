"""The paged K/V tensors of one stage's layer range ``[layer_start, layer_end)``.

The layers with the same attention window form a group (:mod:`stagewise.kv.window`): each group has
its own tensor, block pool and block table, so a sliding-window group can hold fewer blocks than a
full-attention one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from stagewise import ops
from stagewise.ops.reference import dequantise_kv, quantise_kv
from stagewise.kv.window import pool_blocks

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
"""A run's ``kv_cache_dtype``: ``auto`` stores K/V in the activations' dtype; ``int8`` and
``fp8_e4m3`` store one-byte codes with a float16 scale per token and KV head (the formula:
``include/stagewise/common.h``, :func:`stagewise.ops.reference.quantise_kv`), about a quarter of
float32's bytes. Per token rather than per block: a row is quantised by itself, so its bits are the
same whichever step, chunk, rank or prefix-cache hit wrote it, and a block's later tokens never
overflow a scale its first ones set."""
SCALE_BYTES = 2
"""A compact cache's float16 scale of one token's row of one KV head."""


def check_kv_cache_dtype(value: object) -> str:
    """``value`` if it names a :data:`KV_CACHE_DTYPES` entry; ValueError naming the choices otherwise."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
    return value


def kv_row_bytes(head_dim: int, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's K (or V) of one KV head in one layer: ``head_dim * dtype_bytes`` in the
    activations' dtype (``auto``), else ``head_dim`` one-byte codes plus the row's float16 scale.
    The one formula of a row's size: the cache allocates by it (:attr:`KVCacheSpec.bytes_per_token_row`)
    and the planner prices memory and cache reads by it, so a plan's KV is what a stage holds."""
    code = KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)]
    return head_dim * dtype_bytes if code is None else head_dim * code.itemsize + SCALE_BYTES


def as_stored(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows ``x [..., D]`` as a compact cache of ``code_dtype`` codes gives them back (quantised
    and dequantised, in x's dtype): what a query that reads the cache sees, for the attention that
    runs over a step's own K/V (a prompt's first chunk) rather than over the cache."""
    return dequantise_kv(*quantise_kv(x, code_dtype)).to(x.dtype)


class LayerKV(NamedTuple):
    """One layer's paged K/V, each ``[num_blocks, block_size, Hk, D]``, and a compact cache's float16
    scales ``[num_blocks, block_size, Hk]`` (None for a cache in the activations' dtype)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

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
    windows: tuple[int | None, ...] = ()
    """The attention window of each layer of the range (None: full attention); empty: all None."""
    kv_cache_dtype: str = "auto"
    """What a K/V value is stored as (:data:`KV_CACHE_DTYPES`)."""

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
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
        if self.windows and (len(self.windows) != self.num_layers or any(
                w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in self.windows)):
            raise ValueError(f"KVCacheSpec: windows must be empty or one int >= 1 or None per layer "
                             f"({self.num_layers}), got {self.windows!r}")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def compact(self) -> bool:
        """Whether K/V are one-byte codes with float16 scales."""
        return self.kv_cache_dtype != "auto"

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the K/V tensors: the activations' own, or a compact cache's codes."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def bytes_per_token_row(self) -> int:
        """Bytes of one token's K (or V) of one KV head in one layer, a compact cache's scale included."""
        return kv_row_bytes(self.head_dim, self.dtype.itemsize, self.kv_cache_dtype)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The window of each layer group, in the order of the groups' first layers."""
        return tuple(dict.fromkeys(self.windows or (None,)))

    def group_of(self, layer: int) -> tuple[int, int]:
        """``(group, index within the group)`` of global layer ``layer``."""
        if not self.layer_start <= layer < self.layer_end:
            raise ValueError(f"KVCacheSpec: layer {layer} is outside this stage's range "
                             f"[{self.layer_start}, {self.layer_end})")
        if not self.windows:
            return 0, layer - self.layer_start
        w = self.windows[layer - self.layer_start]
        return self.group_windows.index(w), self.windows[: layer - self.layer_start].count(w)

    def group_num_layers(self, group: int) -> int:
        return self.num_layers if not self.windows else self.windows.count(self.group_windows[group])

    def bytes_per_block(self, group: int | None = None) -> int:
        """K and V of one block in every layer of ``group`` (None: of every layer):
        2 * layers * block_size * Hk * (D * element size, plus a compact cache's scale)."""
        layers = self.num_layers if group is None else self.group_num_layers(group)
        return 2 * layers * self.block_size * self.num_kv_heads * self.bytes_per_token_row

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

    Storage is one tensor per layer group ``[group layers, 2, num_blocks, block_size, Hk, D]`` (and,
    for a compact cache, its scales ``[group layers, 2, num_blocks, block_size, Hk]`` float16): an
    allocation is exactly :meth:`KVCacheSpec.bytes_per_block` x num_blocks
    (no per-layer rounding or fragmentation), and each layer's K and V are
    contiguous views of it, as the cache ops require. Give exactly one of
    ``num_blocks`` (one for every group, or one per group), ``kv_cache_bytes`` or
    ``max_num_tokens`` (every group alike).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        num_blocks: int | Sequence[int] | None = None,
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
        groups = len(spec.group_windows)
        sizes = [num_blocks] * groups if isinstance(num_blocks, int) else list(num_blocks)
        if len(sizes) != groups or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"KVCache: num_blocks must be an int >= 1 or one per layer group ({groups}), "
                             f"got {num_blocks!r}")
        self.spec = spec
        self.group_blocks = tuple(sizes)
        """Blocks of each layer group's pool."""
        # Not zeroed: no kernel reads a slot no request has written (decode attention stops at each
        # sequence's length on the CPU and skips masked slots on the GPU; prefills attend over their
        # own K/V), so the pool costs no start-up time and its pages are touched only as they fill.
        # tests/model/test_decode_stack.py runs steps and whole generations on a NaN-filled pool.
        shapes = [(spec.group_num_layers(g), 2, n, spec.block_size, spec.num_kv_heads) for g, n in enumerate(sizes)]
        self.storages = [torch.empty((*shape, spec.head_dim), dtype=spec.code_dtype, device=device)
                         for shape in shapes]
        self.scale_storages = [torch.empty(shape, dtype=torch.float16, device=device)
                               for shape in shapes] if spec.compact else None
        """A compact cache's scales, one tensor per group beside :attr:`storages`; None otherwise."""
        where = [spec.group_of(i) for i in range(spec.layer_start, spec.layer_end)]
        self.layer_group = tuple(g for g, _ in where)
        """The group of each layer of the range (stage-local index)."""
        # Each layer's views, made once rather than on every step's every layer.
        self._views = [LayerKV(self.storages[g][j][0], self.storages[g][j][1],
                               *((self.scale_storages[g][j][0], self.scale_storages[g][j][1]) if spec.compact else ()))
                       for g, j in where]

    @property
    def num_blocks(self) -> int:
        """Blocks of the first group's pool (of the only one without sliding-window layers)."""
        return self.group_blocks[0]

    @property
    def storage(self) -> torch.Tensor:
        """The one tensor of a cache whose layers form one group."""
        return self._only_group("storage")[0]

    @property
    def scales(self) -> torch.Tensor | None:
        """A compact cache's scales beside :attr:`storage` (one group); None for a cache in the
        activations' dtype."""
        return self._only_group("scales")[1]

    def _only_group(self, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(self.storages) != 1:
            raise ValueError(f"KVCache.{what}: the layers form {len(self.storages)} groups (windows "
                             f"{list(self.spec.group_windows)}), each with its own tensor; see storages")
        return self.storages[0], None if self.scale_storages is None else self.scale_storages[0]

    def group_tensors(self, group: int) -> list[torch.Tensor]:
        """Layer group ``group``'s storage and, for a compact cache, its scales beside it."""
        return [self.storages[group]] + ([] if self.scale_storages is None else [self.scale_storages[group]])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storages + (self.scale_storages or []))

    def layer(self, i: int) -> LayerKV:
        """Global layer ``i``'s K/V, each ``[num_blocks, block_size, Hk, D]``, and a compact cache's scales."""
        if not self.spec.layer_start <= i < self.spec.layer_end:
            raise ValueError(f"KVCache.layer: layer {i} is outside this stage's range "
                             f"[{self.spec.layer_start}, {self.spec.layer_end})")
        return self._views[i - self.spec.layer_start]

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k, v [T, Hk, D]`` of layer ``i`` at ``slot_mapping [T]`` (-1 = skip)."""
        kv = self.layer(i)
        ops.reshape_and_cache(k, v, kv.k, kv.v, slot_mapping, kv.k_scale, kv.v_scale)


def group_blocks(spec: KVCacheSpec, full_blocks: int, *, max_num_seqs: int | None,
                 max_model_len: int) -> list[int]:
    """Blocks of each layer group's pool beside ``full_blocks`` blocks of full attention
    (:func:`stagewise.kv.window.pool_blocks`)."""
    return [pool_blocks(w, full_blocks=full_blocks, block_size=spec.block_size, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len) for w in spec.group_windows]


def cache_bytes(spec: KVCacheSpec, full_blocks: int, *, max_num_seqs: int | None, max_model_len: int) -> int:
    """Bytes of the cache of ``full_blocks`` blocks of full attention, every group included."""
    sizes = group_blocks(spec, full_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    return sum(n * spec.bytes_per_block(g) for g, n in enumerate(sizes))


def _blocks_in(spec: KVCacheSpec, nbytes: int, *, max_num_seqs: int, max_model_len: int) -> int:
    """The most full-attention blocks whose cache, every group included, fits ``nbytes`` (0: none).
    Without a full-attention group the cache stops growing once every window pool holds every row."""
    def size(f: int) -> int:
        return cache_bytes(spec, f, max_num_seqs=max_num_seqs, max_model_len=max_model_len)

    hi = nbytes // min(spec.bytes_per_block(g) for g in range(len(spec.group_windows))) + 1
    if None not in spec.group_windows:
        hi = min(hi, max_num_seqs * -(-max_model_len // spec.block_size))
    lo = 0
    while lo < hi:  # the largest f in [0, hi] with size(f) <= nbytes (size grows with f)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= nbytes else (lo, mid - 1)
    return lo


def num_cache_blocks(spec: KVCacheSpec, device: torch.device | str, *, max_num_seqs: int, max_model_len: int,
                     kv_cache_bytes: int | None = None, max_num_tokens: int | None = None,
                     cp_world_size: int = 1) -> int:
    """Blocks of a stage's full-attention pool (the other groups' follow, :func:`group_blocks`): from
    ``kv_cache_bytes`` (every group's blocks within it) or ``max_num_tokens`` when one is given (not
    both), else every row at full length, capped by :data:`DEFAULT_KV_FRACTION` of the free memory
    (and :data:`DEFAULT_CPU_KV_BYTES` on CPU), but room for one full row. Under context parallelism
    a rank stores ``ceil(max_model_len / cp_world_size)`` tokens of a full row (and
    ``1 / cp_world_size`` of ``max_num_tokens``)."""
    if kv_cache_bytes is not None and max_num_tokens is not None:
        raise ValueError("KV cache: give at most one of kv_cache_bytes and max_num_tokens, got both")
    if not isinstance(cp_world_size, int) or cp_world_size < 1:
        raise ValueError(f"KV cache: cp_world_size must be an int >= 1, got {cp_world_size!r}")
    rows = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    if kv_cache_bytes is not None:
        blocks = _blocks_in(spec, kv_cache_bytes, **rows)
        if blocks < 1:
            need = cache_bytes(spec, 1, **rows)
            raise ValueError(f"KVCacheSpec: kv_cache_bytes={kv_cache_bytes} holds no block; one block of layers "
                             f"[{spec.layer_start}, {spec.layer_end}) needs {need} bytes")
        return blocks
    if max_num_tokens is not None:
        return spec.num_blocks_for_tokens(-(-max_num_tokens // cp_world_size))
    device = torch.device(device)
    row = -(-max_model_len // cp_world_size)  # tokens of one full row on this rank
    want = spec.num_blocks_for_tokens(max_num_seqs * row)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap_bytes = int(free * DEFAULT_KV_FRACTION["cuda"])
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cap_bytes = min(int(free * DEFAULT_KV_FRACTION["cpu"]), DEFAULT_CPU_KV_BYTES)
    cap = _blocks_in(spec, cap_bytes, **rows)
    return max(min(want, cap), spec.num_blocks_for_tokens(row), 1)
