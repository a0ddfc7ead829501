"""Reading the YAML files of the command line (run plans, serving configs) with one rule for
errors: ValueError naming the file and what is wrong with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed document (JSON is YAML too); ``what`` names the file's role in messages."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"{what} {str(path)!r}: cannot read it ({err.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{what} {str(path)!r}: not valid YAML: {err}") from None
