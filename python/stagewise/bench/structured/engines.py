"""llguidance (the runtime's grammar engine) and xgrammar (when importable: a benchmark-only
baseline, ``pip install xgrammar``) on the same tokenizer, schemas and answers: the vocabulary's
set-up, a 20-field schema's compile, the per-token cost of a mask plus its token's advance at each
batch size (one matcher per row, the rows one after the other, as the runtime fills them), and which
of a set of schemas each compiles."""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time

SCHEMA_20 = {"type": "object", "additionalProperties": False, "properties": {
    **{f"s{i}": {"type": "string", "maxLength": 12} for i in range(4)},
    **{f"i{i}": {"type": "integer", "minimum": 0, "maximum": 1000} for i in range(4)},
    **{f"f{i}": {"type": "number"} for i in range(3)},
    **{f"b{i}": {"type": "boolean"} for i in range(3)},
    **{f"e{i}": {"enum": ["red", "green", "blue"]} for i in range(3)},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "when": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
    "owner": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}}}
SCHEMA_20["required"] = list(SCHEMA_20["properties"])
ANSWER_20 = {**{f"s{i}": f"word{i}" for i in range(4)}, **{f"i{i}": 10 * i + 7 for i in range(4)},
             **{f"f{i}": i + 0.25 for i in range(3)}, **{f"b{i}": i % 2 == 0 for i in range(3)},
             **{f"e{i}": ["red", "green", "blue"][i] for i in range(3)}, "tags": ["a", "bb"], "when": "2026-11-29",
             "owner": {"name": "Ann", "age": 41}}
"""A valid answer to :data:`SCHEMA_20`, in the schema's key order."""

COVERAGE = {
    "nested objects and arrays": {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "object", "properties": {"b": {"type": "array", "items": {"type": "integer"}}}}}}},
    "$ref / $defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                     "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "enum and const": {"type": "object", "properties": {"e": {"enum": [1, "x", None]}, "c": {"const": "k"}}},
    "string pattern": {"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"},
    "string format date-time": {"type": "string", "format": "date-time"},
    "string format email": {"type": "string", "format": "email"},
    "minLength / maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems / maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "minimum / exclusiveMaximum": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if / then / else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
}
"""Schema features, one schema each: a user's schema uses several."""


def _tokenizer(model: str):
    from stagewise.model.loader import open_checkpoint

    ckpt = open_checkpoint(model)
    return ckpt.tokenizer(), ckpt.config


class _Llguidance:
    name = "llguidance"

    def __init__(self, tok, cfg) -> None:
        import llguidance

        self.ll = llguidance
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=cfg.vocab_size,
                                                eos_token=list(cfg.eos_token_ids))
        self.vocab_s = time.perf_counter() - start
        self.words = (cfg.vocab_size + 31) // 32

    def compile(self, schema: dict):
        m = self.ll.LLMatcher(self.tokenizer, self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema)),
                              log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matchers(self, compiled, n: int) -> list:
        return [compiled.deep_copy() for _ in range(n)]

    def new_mask(self, n: int):
        import torch

        return torch.empty(n, self.words, dtype=torch.int32)

    def fill(self, matcher, mask, i: int) -> None:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr() + i * self.words * 4, self.words * 4)

    def advance(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, cfg) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.vocab_size = xgrammar, cfg.vocab_size
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok),
                                                       vocab_size=cfg.vocab_size,
                                                       stop_token_ids=list(cfg.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab_s = time.perf_counter() - start

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def new_mask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matcher, mask, i: int) -> None:
        matcher.fill_next_token_bitmask(mask, i)

    def advance(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def _engines(tok, cfg, log) -> list:
    out = []
    for cls in (_Llguidance, _Xgrammar):
        try:
            out.append(cls(tok, cfg))
        except ImportError as err:
            log(f"bench structured: {cls.name} is not installed ({err}); pip install {cls.name} to compare it")
    return out


def _version(name: str) -> tuple[str, str, list[str]]:
    meta = importlib.metadata.metadata(name)
    licence = meta.get("License-Expression") or meta.get("License") or "-"
    requires = [r.split(";")[0].strip() for r in importlib.metadata.requires(name) or [] if "extra ==" not in r]
    return meta["Version"], licence, requires


def measure(model: str, sizes: list[int], *, tiny: bool = False, log=print) -> list[dict]:
    tok, cfg = _tokenizer(model)
    answer = tok.encode(json.dumps(ANSWER_20)).ids + list(cfg.eos_token_ids)[:1]
    rows = []
    for engine in _engines(tok, cfg, log):
        version, licence, requires = _version(engine.name)
        start = time.perf_counter()
        compiled = engine.compile(SCHEMA_20)
        first = engine.matchers(compiled, 1)[0]
        mask = engine.new_mask(1)
        engine.fill(first, mask, 0)  # some engines finish compiling on the first mask
        compile_s = time.perf_counter() - start
        per_token = {}
        for b in sizes:
            runs = []
            for _ in range(1 if tiny else 3):
                matchers, mask = engine.matchers(compiled, b), engine.new_mask(b)
                start = time.perf_counter()
                for t in answer[:-1]:
                    for i, m in enumerate(matchers):
                        engine.fill(m, mask, i)
                        engine.advance(m, t)
                runs.append((time.perf_counter() - start) / (len(answer) - 1))
            per_token[str(b)] = statistics.median(runs)
        covered = {}
        for feature, schema in COVERAGE.items():
            try:
                engine.compile(schema)
                covered[feature] = True
            except Exception:  # noqa: BLE001 - what the engine refuses, whatever its error type
                covered[feature] = False
        rows.append({"engine": engine.name, "version": version, "licence": licence, "requires": requires,
                     "vocab_s": engine.vocab_s, "compile_20_fields_s": compile_s, "answer_tokens": len(answer) - 1,
                     "mask_and_advance_s": per_token, "coverage": covered})
        log(f"  {engine.name} {version}: vocabulary {engine.vocab_s * 1e3:.0f} ms, 20-field schema "
            f"{compile_s * 1e3:.1f} ms, per token " + ", ".join(f"batch {b} {s * 1e6:.0f} us"
                                                                for b, s in per_token.items())
            + f", {sum(covered.values())}/{len(covered)} schema features")
    return rows


def markdown(info: dict, rows: list[dict]) -> list[str]:
    from stagewise.bench import report

    sizes = list(rows[0]["mask_and_advance_s"]) if rows else []
    lines = ["# Structured output: the grammar engines and what the mask costs", "",
             f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, {report.isa_line(info)}; "
             f"torch {info['torch']}  ", f"Date (UTC): {info['date_utc']}; commit {info['git_commit']}  ",
             f"Model (tokenizer): {info['model']}; the 20-field schema's answer: "
             f"{rows[0]['answer_tokens'] if rows else '-'} tokens", "",
             "| engine | version | licence | run-time dependencies | vocabulary set-up ms | 20-field schema compile ms | "
             + " | ".join(f"mask + advance, batch {b}, us/token" for b in sizes) + " | schema features compiled |",
             "|---|---|---|---|---:|---:|" + "---:|" * len(sizes) + "---:|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['version']} | {r['licence']} | {', '.join(r['requires']) or 'none'} | "
                     f"{r['vocab_s'] * 1e3:.0f} | {r['compile_20_fields_s'] * 1e3:.1f} | "
                     + " | ".join(f"{r['mask_and_advance_s'][b] * 1e6:.0f}" for b in sizes)
                     + f" | {sum(r['coverage'].values())}/{len(r['coverage'])} |")
    if rows:
        lines += ["", "Schema features (one schema each): " + "; ".join(
            f"{feature}: " + ", ".join(f"{r['engine']} {'yes' if r['coverage'][feature] else 'no'}" for r in rows)
            for feature in rows[0]["coverage"])]
    return lines
