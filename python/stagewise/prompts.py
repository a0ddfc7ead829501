"""Prompts into token ids: text through the checkpoint's tokenizer, optionally inside its chat
template, or ids as given."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def encode_prompts(tokenizer, prompts: str | Sequence[str] | None,
                   prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None, *, chat: bool,
                   render: Callable[[list[dict[str, str]]], str]) -> list[list[int]]:
    """One list of ids per prompt. Exactly one of ``prompts`` (text) and ``prompt_token_ids`` (a
    list of ints or a list of such lists); ``chat`` wraps each text in ``render([user message])``."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("Pipeline.generate: give exactly one of prompts and prompt_token_ids")
    if prompt_token_ids is not None:
        if chat:
            raise ValueError("Pipeline.generate: chat=True needs text prompts, not prompt_token_ids")
        ids = list(prompt_token_ids)
        if ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            ids = [ids]  # one prompt given as a flat list
        if not all(isinstance(p, (list, tuple)) for p in ids):
            raise ValueError("Pipeline.generate: prompt_token_ids must be a list of ints or a list of "
                             f"lists of ints, got {prompt_token_ids!r:.200}")
        return [list(p) for p in ids]
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not all(isinstance(p, str) for p in texts):
        raise ValueError(f"Pipeline.generate: prompts must be a string or a list of strings, got {prompts!r:.200}")
    if tokenizer is None:
        raise ValueError("Pipeline.generate: this checkpoint has no tokenizer; pass prompt_token_ids")
    if chat:
        texts = [render([{"role": "user", "content": t}]) for t in texts]
    # A chat template writes the special tokens itself (as transformers' apply_chat_template assumes).
    return [tokenizer.encode(t, add_special_tokens=not chat).ids for t in texts]


def render_chat(checkpoint, tokenizer, messages: list[dict[str, str]]) -> str:
    """``checkpoint``'s chat template applied to ``messages``, with the assistant turn opened."""
    template = checkpoint.chat_template
    if not template:
        raise ValueError(f"Pipeline: checkpoint {str(checkpoint.path)!r} has no chat template; use chat=False")
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    config, special = checkpoint.config, {}
    for name, token_id in (("bos_token", config.bos_token_id),
                           ("eos_token", config.eos_token_ids[0] if config.eos_token_ids else None)):
        if token_id is not None:
            special[name] = tokenizer.id_to_token(token_id) or ""
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
