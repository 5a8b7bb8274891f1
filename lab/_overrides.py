"""Command-line overrides of a document: ``repeats=5 base_config.lr=0.1 arms.small.lr=1e-3``.

As OmegaConf's dotlist: each override is ``dotted.key=value``, the value read as YAML by a
safe loader: ``5`` is an int, ``0.1`` a float, ``[1, 2]`` a list, ``null`` None, ``'5'`` a
string. Unlike plain ``yaml.safe_load`` (YAML 1.1), ``1e-3`` is a float, as in YAML 1.2
and OmegaConf: a learning rate typed on a command line is a number. A part of the key walks
into a mapping by key, into a list by index (``arms.0.lr``) or by the ``name`` of its item
(``arms.small.lr``). So one experiment file serves many launches without a copy per change.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from lab.errors import ConfigError

__all__ = ["apply_overrides", "parse_override"]


class _ValueLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads ``1e-3`` and ``1E5`` (no dot) as floats."""


_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"base_config.lr=0.1"`` as ``(("base_config", "lr"), 0.1)``; one line if malformed."""
    key, sep, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise ConfigError(f"override {text!r}: write dotted.key=value, e.g. repeats=5")
    try:
        value = yaml.load(raw, Loader=_ValueLoader)  # safe: a SafeLoader subclass
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(
            f"override {text!r}: the value is not YAML ({problem}); quote it: {key}='...'"
        ) from None
    return parts, value


def apply_overrides(
    data: dict[str, Any],
    overrides: Sequence[str],
    *,
    fields: Callable[[tuple[str, ...]], Sequence[str] | None] = lambda path: None,
) -> dict[str, Any]:
    """A copy of `data` with each override applied, in order (a later one wins).

    `fields(path)` lists the keys a mapping at `path` may hold (None: any key, as a base
    config's, which its own model checks later); a key outside them is one line naming
    the valid ones. Missing mappings on the way are created, so ``base_config.lr=0.1``
    works on a file without ``base_config``.
    """
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = out
        for depth, part in enumerate(parts):
            here = parts[:depth]
            last = depth == len(parts) - 1
            if isinstance(node, list):
                index = _index(node, part, text, ".".join(here))
                if last:
                    node[index] = value
                else:
                    node = node[index]
                continue
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {text!r}: {'.'.join(here)} is {node!r}, not a mapping; "
                    f"override {'.'.join(here)} itself"
                )
            valid = fields(here)
            if valid is not None and part not in valid:
                where = f"{'.'.join(here)}: " if here else ""
                raise ConfigError(
                    f"override {text!r}: {where}unknown field {part!r}; valid: {', '.join(valid)}"
                )
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return out


def _index(items: list[Any], part: str, text: str, where: str) -> int:
    """The item of a list that `part` names: by index, or by the ``name`` of a mapping."""
    if part.isdigit() and int(part) < len(items):
        return int(part)
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("name") == part:
            return i
    names = [str(item["name"]) for item in items if isinstance(item, dict) and "name" in item]
    named = f" or a name: {', '.join(names)}" if names else ""
    raise ConfigError(
        f"override {text!r}: {where} has no item {part!r}; give an index 0..{len(items) - 1}{named}"
    )
