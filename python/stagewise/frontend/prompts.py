"""Prompts into token ids: text through the checkpoint's tokenizer, optionally inside its chat
template, or ids as given."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def encode_prompts(tokenizer, prompts: str | Sequence[str] | None,
                   prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None, *, chat: bool,
                   render: Callable[[list[dict[str, Any]]], str],
                   image_counts: Sequence[int] | None = None) -> list[list[int]]:
    """One list of ids per prompt. Exactly one of ``prompts`` (text) and ``prompt_token_ids`` (a
    list of ints or a list of such lists); ``chat`` wraps each text in ``render([user message])``,
    whose content lists ``image_counts[i]`` images before the text when prompt i has images."""
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
        counts = list(image_counts or [0] * len(texts))
        texts = [render([{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": t}]
                          if n else t}]) for t, n in zip(texts, counts)]
    # A chat template writes the special tokens itself (as transformers' apply_chat_template assumes).
    return [tokenizer.encode(t, add_special_tokens=not chat).ids for t in texts]


def render_chat(checkpoint, tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None, *,
                template: str | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """``checkpoint``'s chat template (or ``template``) applied to ``messages`` (and OpenAI-style
    ``tools``, for a template that takes them), with the assistant turn opened; ``template_kwargs``:
    more variables for it (Qwen3's ``enable_thinking``)."""
    template = template or checkpoint.chat_template
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
    extra = {} if tools is None else {"tools": tools}
    given = dict(template_kwargs or {})
    clash = sorted(set(given) & ({"messages", "add_generation_prompt", "tools"} | set(special)))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: the server sets them")
    return env.from_string(template).render(**given, messages=messages, add_generation_prompt=True, **special, **extra)


def expand_image_placeholders(ids: list[int], tokens_per_image: Sequence[int], *, image_token_id: int,
                              vision_start_id: int, vision_end_id: int) -> list[int]:
    """``ids`` with one image placeholder token per merged patch of each image: each run of
    ``image_token_id`` stands for the next image and becomes ``tokens_per_image[i]`` tokens (a run
    already that long is kept). A prompt without placeholders gets ``vision start, placeholders,
    vision end`` for each image in front of its text, where a chat template puts them. ValueError
    when the runs and the images differ in number."""
    runs = [i for i, t in enumerate(ids) if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]
    if not runs:
        front = [tok for n in tokens_per_image for tok in (vision_start_id, *[image_token_id] * n, vision_end_id)]
        return front + list(ids)
    if len(runs) != len(tokens_per_image):
        raise ValueError(f"the prompt has {len(runs)} image placeholder(s) but {len(tokens_per_image)} image(s) "
                         "were given")
    out, i, image = [], 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        run = next((j for j in range(i, len(ids)) if ids[j] != image_token_id), len(ids)) - i
        want = tokens_per_image[image]
        if run not in (1, want):
            raise ValueError(f"image {image}: its placeholder run has {run} tokens; expected 1 (expanded here) or "
                             f"{want} (one per merged patch)")
        out += [image_token_id] * want
        i, image = i + run, image + 1
    return out


def check_lengths(encoded: list[list[int]], params: list, length: int) -> None:
    """ValueError naming every prompt whose tokens plus max_new_tokens exceed ``length``."""
    over = [f"prompt {i} has {len(ids)} tokens + max_new_tokens {p.max_new_tokens} = "
            f"{len(ids) + p.max_new_tokens}" for i, (ids, p) in enumerate(zip(encoded, params))
            if ids and len(ids) + p.max_new_tokens > length]
    if over:
        raise ValueError(f"Pipeline.generate: more tokens than the model length {length} allows: "
                         + "; ".join(over[:8]) + (f"; and {len(over) - 8} more" if len(over) > 8 else ""))
