"""Qwen3-VL's 3-D rope positions of a prompt (transformers' ``get_rope_index`` for images).

Text tokens take the same position on all three axes (temporal, height, width), one more than the
token before. An image's tokens, ``t x (h / merge) x (w / merge)`` in row-major order, take
``(start + t_i, start + row, start + col)``, where ``start`` is the position after the text before
it; the text after the image continues from ``start + max(h, w) / merge``. A request's last
position is thus below its token count, and decoding continues from ``position = cached tokens +
delta`` with ``delta = max position + 1 - prompt length`` (zero for a text-only prompt), the same
on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rope_positions(token_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int,
                   merge: int) -> tuple[torch.Tensor, int]:
    """``(positions [3, len(token_ids)] int64, delta)`` of a prompt whose image placeholders (runs of
    ``image_token_id``, one run of ``t * h * w / merge ** 2`` per image) belong to ``grids`` in order.
    ValueError when the placeholders and the grids do not match."""
    ids = list(token_ids)
    n = len(ids)
    out = torch.empty((3, n), dtype=torch.int64)
    pos, i, image = 0, 0, 0
    while i < n:
        if ids[i] != image_token_id:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        if image >= len(grids):
            raise ValueError(f"the prompt has more image placeholders than the {len(grids)} image(s) given")
        t, h, w = grids[image]
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if i + count > n or any(tok != image_token_id for tok in ids[i:i + count]):
            raise ValueError(f"image {image} needs {count} consecutive placeholder tokens at token {i}, "
                             "the prompt has fewer")
        tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).flatten()
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).flatten()
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).flatten()
        out[:, i:i + count] = torch.stack([tt, hh, ww]) + pos
        pos += max(gh, gw)
        i += count
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image(s) given but the prompt has placeholders for {image}")
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta
