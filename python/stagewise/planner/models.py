"""The models a plan is made for: a config.json (or a folder holding one), a built-in config
(``planner/models/*.json``: qwen3-4b, falcon-40b, qwen3-vl-235b-a22b) or a checkpoint stagewise
can open."""

from __future__ import annotations

from pathlib import Path

from stagewise.model.config import ModelConfig
from stagewise.model.hf_config import parse_config_file

MODELS_DIR = Path(__file__).resolve().parent / "models"


class PlanError(ValueError):
    """A user error: printed as ``stagewise plan: <message>``, exit status 2."""


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def resolve_model(arg: str) -> tuple[ModelConfig, str]:
    """``(config, name)`` of a config file/folder, a built-in config or an openable checkpoint."""
    path = Path(arg)
    if path.is_file() and path.suffix == ".json" or path.is_dir() and (path / "config.json").is_file():
        name = path.stem if path.is_file() and path.name != "config.json" else path.resolve().parent.name \
            if path.is_file() else path.resolve().name
        return parse_config_file(path), name
    builtin = MODELS_DIR / f"{arg.lower()}.json"
    if builtin.is_file():
        return parse_config_file(builtin), arg.lower()
    from stagewise.model.loader import open_checkpoint

    try:
        return open_checkpoint(arg).config, path.stem or arg
    except (FileNotFoundError, ValueError) as err:
        raise PlanError(f"unknown model {arg!r}: not a config.json, a folder holding one, a built-in config "
                        f"({', '.join(builtin_models())}) or a checkpoint ({err})") from None
