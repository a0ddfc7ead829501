"""FlashInfer baselines, when FlashInfer is importable and the case is on CUDA.

Each function returns the keyword arguments for :class:`~stagewise.bench.kernels.cases.Case`: either
``flashinfer=<callable>`` or ``flashinfer_note=<why not>``. Nothing here is
needed for the benchmark to run; any failure becomes a note.
"""

from __future__ import annotations

import torch


def _module(device: torch.device):
    """(flashinfer module, None) or (None, reason)."""
    if device.type != "cuda":
        return None, "CUDA only"
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a broken install (missing CUDA libraries, ABI mismatch)
        return None, f"not importable ({type(e).__name__})"
    return flashinfer, None


def _guarded(build):
    try:
        return {"flashinfer": build()}
    except Exception as e:
        return {"flashinfer_note": f"n/a: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> dict:
    """``flashinfer.norm.rmsnorm`` of ``x [T, H]`` into ``out``."""
    fi, why = _module(x.device)
    if fi is None:
        return {"flashinfer_note": why}
    return _guarded(lambda: (lambda: fi.norm.rmsnorm(x, weight, eps, out=out)))


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> dict:
    """``flashinfer.norm.fused_add_rmsnorm`` in place on ``x, residual [T, H]``."""
    fi, why = _module(x.device)
    if fi is None:
        return {"flashinfer_note": why}
    return _guarded(lambda: (lambda: fi.norm.fused_add_rmsnorm(x, residual, weight, eps)))


def decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float, block_size: int) -> dict:
    """FlashInfer's paged decode wrapper over the same cache (NHD layout, the same block ids).

    q ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hk, D]``; block_tables
    ``[B, max_blocks]`` int32; seq_lens ``[B]``. FlashInfer attends over the
    cached tokens only (it has no separate new-token part): one token fewer
    than ours per sequence, negligible at the benchmarked context lengths.
    The plan is made once here, outside the timing, as a serving step would.
    """
    fi, why = _module(q.device)
    if fi is None:
        return {"flashinfer_note": why}

    def build():
        b, hq, d = q.shape
        hk = k_cache.size(2)
        lens = seq_lens.long()
        pages = (lens + block_size - 1) // block_size  # [B]
        indptr = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = pages.cumsum(0)
        used = torch.arange(block_tables.size(1), device=q.device)[None, :] < pages[:, None]
        indices = block_tables[used].int()  # row-major: sequence by sequence
        last_page_len = ((lens - 1) % block_size + 1).int()
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
        # Tensor cores pay off for large GQA groups (the rule vLLM uses).
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=hq // hk > 4)
        wrapper.plan(indptr, indices, last_page_len, hq, hk, d, block_size, pos_encoding_mode="NONE",
                     q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)  # fmt: skip
        return lambda: wrapper.run(q, (k_cache, v_cache), return_lse=True)

    return _guarded(build)
