"""The prompts of the end-to-end runs (``stagewise bench e2e`` and ``stagewise plan validate``): each
row exactly ``prompt_len`` token ids, windows of one fixed text."""

from __future__ import annotations

from stagewise.model.loader import Checkpoint

TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships into harbour. "
        "Over the centuries, towers of stone replaced the hills, oil lamps replaced the open flames, and "
        "lenses of polished glass sent the light far out to sea. Keepers lived in small houses beside the "
        "towers, trimming wicks, winding clockwork and writing the weather into their logbooks each night. ")


def make_prompts(ckpt: Checkpoint, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts of exactly ``prompt_len`` ids: windows of the tokenized TEXT (repeated),
    row i starting 7 * i tokens in; deterministic ids when the checkpoint has no tokenizer."""
    vocab = ckpt.config.vocab_size
    need = prompt_len + 7 * batch
    try:
        ids = ckpt.tokenizer().encode(TEXT, add_special_tokens=False).ids
    except FileNotFoundError:
        ids = []
    if len(set(ids)) < 8:  # a tokenizer that knows none of the words: fall back to fixed ids
        ids = [(31 * i + 7) % vocab for i in range(need)]
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[7 * i : 7 * i + prompt_len] for i in range(batch)]
