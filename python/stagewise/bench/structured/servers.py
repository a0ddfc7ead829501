"""The same structured requests through servers side by side, one after the other on the same
cores: ``stagewise serve`` (llguidance), llama.cpp's (llama-cpp-python's server, whose
``response_format`` schema becomes a GBNF grammar) and vLLM's CPU backend (xgrammar). Each gets
each prompt free and held to one JSON schema (a nested object, an array, an enum, numbers, a
pattern), greedy and streamed, so that per server:

- **valid**: the held answers that parse and that the schema validates (``jsonschema``);
- **TTFT** and **TPOT** medians, free and held (the free answers generate ``max_tokens``, their
  end of sequence suppressed): held over free is what the constraint costs in that server;
- **first held TTFT**: the first request with the schema, which compiles it (the others find it
  compiled, where the server caches).
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "scores", "address"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
PROMPTS = ["Describe a person who lives in Paris as JSON.", "Invent a user of a website, as JSON.",
           "Give me a JSON record for a guest named Ann.", "An admin from Tokyo, as a JSON object.",
           "Write a JSON profile of a retired teacher.", "A young user from Lima, in JSON.",
           "JSON for a guest who visits Oslo.", "Describe the oldest person you can imagine, as JSON."]
SERVERS = ("stagewise", "llama.cpp", "vllm")


def held_body(server: str) -> dict:
    """The request fields that hold an answer to :data:`SCHEMA` on ``server``."""
    if server == "llama.cpp":  # llama-cpp-python's dialect of response_format
        return {"response_format": {"type": "json_object", "schema": SCHEMA}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}


def ask(url: str, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streamed greedy chat request: its text, TTFT, and TPOT over its streamed pieces."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **extra}
    text, times = "", []
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"bench structured: {url} answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = (choices[0].get("delta") or {}).get("content") or ""
            if piece:
                text += piece
                times.append(time.perf_counter())
    if not times:
        return {"text": "", "ttft_s": None, "tpot_s": None, "pieces": 0}
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"text": text, "ttft_s": times[0] - sent, "tpot_s": tpot, "pieces": len(times)}


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def measure_server(name: str, url: str, model: str, n: int, max_tokens: int, free_extra: dict) -> dict:
    """``n`` prompts, each free then held, alternating (one warm-up request first)."""
    ask(url, model, "Say hello.", 4, {})
    free, held = [], []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
        free.append(ask(url, model, prompt, max_tokens, free_extra))
        held.append(ask(url, model, prompt, max_tokens, held_body(name)))
    ok = [valid(h["text"]) for h in held]

    def med(rows, key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    row = {"server": name, "requests": n, "valid": sum(ok), "first_held_ttft_s": held[0]["ttft_s"],
           "ttft_free_s": med(free, "ttft_s"), "ttft_held_s": med(held[1:] or held, "ttft_s"),
           "tpot_free_s": med(free, "tpot_s"), "tpot_held_s": med(held, "tpot_s"),
           "held_pieces_mean": sum(h["pieces"] for h in held) / n, "example": held[0]["text"][:300],
           "invalid_examples": [h["text"][:300] for h, good in zip(held, ok) if not good][:2]}
    if row["tpot_free_s"] and row["tpot_held_s"]:
        row["tpot_overhead"] = row["tpot_held_s"] / row["tpot_free_s"] - 1
    return row


def markdown(rows: list[dict], n: int, max_tokens: int) -> list[str]:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = [f"The same {n} chat prompts through each server, free ({max_tokens} tokens, end of sequence suppressed) "
             f"and held to one JSON schema (nested object, array, enum, integers with bounds, a pattern), greedy, "
             f"streamed, one request at a time, one server after the other:", "",
             "| server | valid | first held TTFT ms | TTFT free / held ms | TPOT free / held ms | constraint cost |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        cost = "-" if r.get("tpot_overhead") is None else f"{100 * r['tpot_overhead']:+.1f} %"
        lines.append(f"| {r['server']} | {r['valid']}/{r['requests']} | {ms(r['first_held_ttft_s'])} | "
                     f"{ms(r['ttft_free_s'])} / {ms(r['ttft_held_s'])} | {ms(r['tpot_free_s'])} / "
                     f"{ms(r['tpot_held_s'])} | {cost} |")
    return lines
