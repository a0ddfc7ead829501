"""The registry of architectures (python/stagewise/model/architectures/): nothing outside an
architecture's file asks for it by name, and what each entry says holds for a model of it (the C++
layer loop takes its layers, or the stage states the entry's reason)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from stagewise.model import architectures
from stagewise.model.architectures.base import StageBuild
from stagewise.model.hf_config import parse_hf_config
from stagewise.model.stage import StageModel

transformers = pytest.importorskip("transformers")

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "stagewise"
ARCHITECTURE_FILES = PACKAGE / "model" / "architectures"
NAMES = set(architectures.BY_NAME) | set(architectures.MODEL_TYPES) | set(architectures.GGUF_ARCHITECTURES)


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _name_tests(path: Path, root: Path = PACKAGE) -> list[str]:
    """Comparisons in ``path`` of something with an architecture's name (``== "falcon"``,
    ``in ("llama", "qwen3")``), and dict keys that are one (a table keyed by architecture)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = [s for side in (node.left, *node.comparators) for s in _literals(side) if s in NAMES]
        elif isinstance(node, ast.Dict):
            names = [s for key in node.keys if key is not None for s in _literals(key) if s in NAMES]
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno}: {name!r}" for name in names]
    return found


def test_nothing_outside_an_architectures_file_tests_its_name():
    """An architecture is one file plus one registry line: the rest of the package reaches it
    through the registry, never by asking which architecture a model is."""
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if ARCHITECTURE_FILES not in path.parents
             for hit in _name_tests(path)]
    assert not found, "architecture names tested outside model/architectures/:\n" + "\n".join(found)


def test_the_name_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(config):\n    return config.architecture == "falcon" or {"qwen3": 1}\n')
    assert _name_tests(probe, tmp_path) == ["probe.py:2: 'falcon'", "probe.py:2: 'qwen3'"]


def test_model_types_and_gguf_names_are_claimed_once():
    pairs = [(t, a.name) for a in architectures.ARCHITECTURES for t in a.hf_defaults]
    assert len({t for t, _ in pairs}) == len(pairs)
    llama = architectures.get("llama")
    with pytest.raises(ValueError, match=r"HF model_type 'llama' is claimed by both 'llama' and 'other'"):
        architectures._index([("llama", llama), ("llama", dataclasses.replace(llama, name="other"))], "HF model_type")
    for entry in architectures.ARCHITECTURES:
        assert entry.multimodal <= set(entry.hf_defaults), entry.name
        assert entry.gguf is None or entry.gguf.model_type in entry.hf_defaults, entry.name


def test_unknown_names_are_refused_with_the_known_ones():
    known = re.escape(str(sorted(architectures.MODEL_TYPES)))
    with pytest.raises(ValueError, match=rf"config.json: model_type 'gpt2' is not supported; expected one of {known}"):
        architectures.for_model_type("gpt2")
    known = re.escape(str(sorted(architectures.GGUF_ARCHITECTURES)))
    with pytest.raises(ValueError, match=rf"gguf: general.architecture 'gpt2' is not supported; "
                                         rf"expected one of {known}"):
        architectures.for_gguf("gpt2")
    with pytest.raises(ValueError, match=r"ModelConfig.architecture: expected one of \[.*'llama'.*\], got 'gpt2'"):
        architectures.get("gpt2")


SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48)
EXTRA = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
         "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
         "mistral": dict(sliding_window=None)}  # its class's 4096-token window: the C++ loop applies none
TEXT_TYPES = sorted(t for t, a in architectures.MODEL_TYPES.items() if t not in a.multimodal)


@pytest.mark.parametrize("model_type", TEXT_TYPES)
def test_the_decode_stack_takes_the_layers_or_the_stage_says_why(model_type):
    """Every text model type of the registry (a new one too): a one-rank CPU stage of it runs the
    C++ layer loop exactly when its entry says so, and otherwise states the entry's reason."""
    entry = architectures.MODEL_TYPES[model_type]
    config = transformers.CONFIG_MAPPING[model_type](**SIZES, **EXTRA.get(model_type, {}))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    cfg = parse_hf_config(config.to_dict())
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, hf.state_dict())
    if entry.decode_stack is None:
        assert stage.python_loop_reason is None and stage.decode_stack.num_layers() == cfg.num_layers
    else:
        assert stage.decode_stack is None and stage.python_loop_reason == f"{entry.name}: {entry.decode_stack}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embedding_scale_rounds_as_transformers_does(monkeypatch, dtype):
    """An entry's ``embedding_scale`` (Gemma's sqrt(hidden)) reaches the stage's embedding, which
    multiplies as transformers' scaled embedding does, in the compute dtype."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    config = transformers.LlamaConfig(**SIZES)
    hf = transformers.LlamaForCausalLM(config)
    cfg, weights = parse_hf_config(config.to_dict()), hf.state_dict()
    monkeypatch.setitem(architectures.BY_NAME, "llama", dataclasses.replace(
        architectures.get("llama"), embedding_scale=lambda c: c.hidden_size**0.5))
    stage = StageModel.from_weights(cfg, 0, 1, weights, dtype=dtype)
    oracle = Gemma3TextScaledWordEmbedding(cfg.vocab_size, cfg.hidden_size, 0, cfg.hidden_size**0.5).to(dtype)
    oracle.weight.data.copy_(weights["model.embed_tokens.weight"])
    ids = torch.tensor([0, 5, 63, 5])
    with torch.no_grad():
        assert torch.equal(stage.embedding(ids), oracle(ids))
    monkeypatch.undo()  # without the scale: the plain lookup
    assert torch.equal(StageModel.from_weights(cfg, 0, 1, weights, dtype=dtype).embedding(ids),
                       weights["model.embed_tokens.weight"].to(dtype)[ids])


def test_stage_build_shares_what_its_layers_ask_for_once():
    made = []
    build = StageBuild(groups=None, rotary=None, dtype=torch.float32, device=torch.device("cpu"))
    first = build.share("local rope", lambda: made.append(1) or object())
    assert build.share("local rope", lambda: made.append(2) or object()) is first and made == [1]


def test_the_manual_lists_every_architecture():
    """docs/cli.md's list of architectures names every registry entry (``qwen3_moe`` as Qwen3-MoE,
    ``gemma3`` as Gemma 3)."""
    text = (PACKAGE.parents[1] / "docs" / "cli.md").read_text()
    listed = re.search(r"Architectures:(.*?)\.\n", text, re.S)
    assert listed, "docs/cli.md: no 'Architectures: ...' sentence"
    compact = re.sub(r"[^a-z0-9]", "", listed.group(1).lower())
    missing = sorted(name for name in architectures.BY_NAME if name.replace("_", "") not in compact)
    assert not missing, f"docs/cli.md's list of architectures leaves out {missing}"
