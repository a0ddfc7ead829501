"""The sampling options of ``generate`` and ``launch``: one flag per field of
:class:`~stagewise.engine.params.SamplingParams`, named, typed, helped and defaulted by the field
(its :class:`~stagewise.engine.params.Option` and type), so that a new field is a new flag.

A flag not given is None here: its value is then a run plan's ``sampling:`` value, else the
field's default (:func:`sampling_args`)."""

from __future__ import annotations

import argparse
import json
import typing
from typing import Any

from stagewise.engine.params import SURFACES, SamplingParams, defaults, options


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _file(kind: str):
    """An argparse type that reads the named file: its text, or its JSON object."""
    def read(path: str):
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as err:
            raise argparse.ArgumentTypeError(f"cannot read {path!r}: {err.strerror}") from None
        if kind == "text":
            return text
        try:
            return json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{path!r} is not valid JSON: {err}") from None
    read.__name__ = f"{kind} file"
    return read


def _form(name: str, hint: Any, file: bool = False) -> dict[str, Any]:
    """The argparse form of a field of type ``hint`` (``file``: the flag names a file holding it)."""
    if file:
        return {"type": _file("json" if hint == (dict | None) else "text")}
    if hint is bool:
        return {"action": "store_true"}
    if hint is float:
        return {"type": float}
    if hint in (int, int | None):
        return {"type": int}
    if hint == (str | None):
        return {"type": str}
    if hint == list[str]:
        return {"action": "append"}
    if hint == list[int]:
        return {"type": _token_ids}
    raise TypeError(f"SamplingParams.{name}: no command-line form for a field of type {hint}")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling", "a run plan's sampling: section replaces the defaults; "
                                                  "the options given replace both")
    hints = typing.get_type_hints(SamplingParams)
    fallback = defaults()
    for row in SURFACES:
        opt, default = options()[row.field], fallback[row.field]
        said = "" if default is None or default is False or default == [] else f" (default: {default})"
        form = _form(row.field, hints[row.field], opt.file)
        if opt.metavar is not None:
            form["metavar"] = opt.metavar
        group.add_argument(row.flag, dest=row.field, default=None, help=opt.help + said, **form)


def sampling_args(args: argparse.Namespace, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling values of a command that differ from the fields' defaults: ``plan`` (a run
    plan's ``sampling``), replaced by the options given."""
    given = {row.field: getattr(args, row.field) for row in SURFACES if getattr(args, row.field) is not None}
    return {**(plan or {}), **given}
