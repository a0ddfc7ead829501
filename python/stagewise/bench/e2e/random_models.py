"""The random checkpoints `stagewise bench e2e --model random-...` runs: a published model's shape
with seeded random weights, written once into the temp folder on first use and reused after.

The weights never go through transformers' own initialisation, which for an 8B model takes minutes
on the CPU: transformers builds the model on the meta device only to name its tensors and their
shapes (the names ``save_pretrained`` writes), and each tensor is drawn here (normal of std 0.02;
norm weights ones, biases zeros, as transformers initialises them), on the GPU when there is one,
and copied to the host one safetensors shard (at most :data:`SHARD_BYTES`) at a time, so the host
never holds the model twice. The folder has no tokenizer: the prompts are fixed token ids
(:func:`stagewise.bench.e2e.prompts.make_prompts`) and the chat questions are left out.

A folder's name holds the model, its decoder layer count, its dtype and a digest of everything
that decides its contents, so a changed shape never reuses an old folder. The same seed draws
other numbers on the GPU than on the CPU: a folder's weights depend on where it was built.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SHARD_BYTES = 4 * 10**9
"""The most bytes of tensors in one safetensors file."""
FORMAT = 2
"""Of how a folder is written (part of its digest: a change here rebuilds every folder)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RandomModel:
    """A model shape whose random checkpoint ``--model NAME`` builds."""

    name: str
    """What ``--model`` calls it."""
    model_class: str
    """transformers' class of the model, e.g. ``LlamaForCausalLM`` (its ``config_class`` takes :attr:`config`)."""
    config: dict
    """The keyword arguments of that config class."""
    dtype: str
    """Of the weights written: float32, bfloat16 or float16."""
    text_key: str | None = None
    """The field of :attr:`config` holding the decoder's own config (a vision model's ``text_config``);
    None: the decoder's fields are :attr:`config`'s own."""
    std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"RandomModel {self.name}: dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def layers(self) -> int:
        """Decoder layers."""
        return (self.config[self.text_key] if self.text_key else self.config)["num_hidden_layers"]

    def with_layers(self, layers: int) -> RandomModel:
        """The same shape with ``layers`` decoder layers."""
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"--random-layers must be an int >= 1, got {layers!r}")
        config = copy.deepcopy(self.config)
        (config[self.text_key] if self.text_key else config)["num_hidden_layers"] = layers
        return dataclasses.replace(self, config=config)

    def digest(self) -> str:
        """Eight hex digits of everything that decides the folder's contents."""
        what = dict(model_class=self.model_class, config=self.config, dtype=self.dtype, std=self.std,
                    seed=self.seed, format=FORMAT)
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]

    def folder_name(self) -> str:
        return f"stagewise-{self.name}-{self.layers}l-{self.dtype}-{self.digest()}"


# Hidden 2048, 8 decoder layers (GQA 16/8 of 128), ViT of depth 8 (Qwen3-VL's 1152 wide, patch 16)
# with DeepStack at blocks 1, 3, 5; a 32k vocabulary keeps the embedding from dominating.
QWEN3_VL = RandomModel(
    name="random-qwen3-vl", model_class="Qwen3VLForConditionalGeneration", dtype="float32", text_key="text_config",
    config=dict(
        vision_config=dict(depth=8, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=2048,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[1, 3, 5]),
        text_config=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, intermediate_size=6144, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        image_token_id=31995, video_token_id=31996, vision_start_token_id=31997, vision_end_token_id=31998))

# Meta-Llama-3-8B's config.json: 8.03B parameters, 16 GB in bfloat16 at 32 layers.
LLAMA3_8B = RandomModel(
    name="random-llama3-8b", model_class="LlamaForCausalLM", dtype="bfloat16",
    config=dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=500000.0),
                tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001))

MODELS = {m.name: m for m in (QWEN3_VL, LLAMA3_8B)}
"""Every random model, by its ``--model`` name."""


def resolve(model: str, layers: int | None, log=print) -> str:
    """``--model`` and ``--random-layers`` as a checkpoint path: a random model's folder (built on
    first use), any other model as it is."""
    if model not in MODELS:
        if layers is not None:
            raise ValueError(f"--random-layers applies to the random models ({', '.join(MODELS)}), got --model {model!r}")
        return model
    return str(build(MODELS[model] if layers is None else MODELS[model].with_layers(layers), log=log))


def build(model: RandomModel, root: Path | None = None, log=print) -> Path:
    """The folder of ``model`` under ``root`` (default: the temp folder), written on first use.
    Written beside it and renamed into place, so a folder that exists is whole."""
    root = Path(tempfile.gettempdir()) if root is None else Path(root)
    folder = root / model.folder_name()
    if (folder / "config.json").is_file():
        return folder
    part = root / f"{folder.name}.part-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    log(f"bench e2e: building {model.name} ({model.layers} layers, {model.dtype}) in {folder} (once)")
    try:
        write(model, part)
    except BaseException:  # no half-written folder left in the temp folder (a 16 GB one, at full size)
        shutil.rmtree(part, ignore_errors=True)
        raise
    try:
        part.rename(folder)
    except OSError:  # another process built it meanwhile
        if not (folder / "config.json").is_file():
            raise
        shutil.rmtree(part, ignore_errors=True)
    return folder


def write(model: RandomModel, folder: Path) -> None:
    """``model``'s config.json, safetensors shards and their index into ``folder`` (made here)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cls = getattr(transformers, model.model_class)
    config = cls.config_class(**copy.deepcopy(model.config))
    with torch.device("meta"):
        meta = cls(config)
    tensors = _tensor_table(meta)
    dtype = getattr(torch, model.dtype)
    shards = _shards(tensors, dtype.itemsize)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(model.seed)
    folder.mkdir(parents=True)
    files: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        host = {}
        for key, shape, fill in shard:
            t = torch.empty(shape, dtype=dtype, device=device)
            if fill == "normal":
                t.normal_(0.0, model.std, generator=generator)
            else:
                t.fill_(1.0 if fill == "ones" else 0.0)
            host[key] = t.cpu()
        save_file(host, str(folder / name), metadata={"format": "pt"})
        files.update(dict.fromkeys(host, name))
        del host
    if len(shards) > 1:
        total = sum(dtype.itemsize * _numel(shape) for _, shape, _ in tensors)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": files}, indent=2) + "\n")
    config.architectures = [cls.__name__]
    config.dtype = model.dtype
    config.save_pretrained(folder)
    if device == "cuda":
        torch.cuda.empty_cache()  # the benchmark's models come next


def _tensor_table(meta) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, fill) of every tensor ``save_pretrained`` would write for the meta model
    ``meta``; fill: ``ones`` (a norm's weight), ``zeros`` (a bias) or ``normal``."""
    table = []
    for name, p in meta.named_parameters():  # a tied weight once, under its first name, as saved
        owner, _, leaf = name.rpartition(".")
        if leaf == "bias":
            fill = "zeros"
        elif "norm" in type(meta.get_submodule(owner)).__name__.lower():
            fill = "ones"
        else:
            fill = "normal"
        table.append((name, tuple(p.shape), fill))
    extra = sorted(set(meta.state_dict()) - {name for name, _, _ in table})
    if extra:  # persistent buffers: their values are not random, so refuse rather than guess
        raise ValueError(f"random model {type(meta).__name__}: its checkpoint holds buffers {extra[:3]}, "
                         f"which this builder does not write")
    return table


def _shards(tensors: list, itemsize: int) -> list[list]:
    """``tensors`` in order, cut into runs of at most :data:`SHARD_BYTES` (or one tensor)."""
    shards, size = [[]], 0
    for t in tensors:
        nbytes = itemsize * _numel(t[1])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
