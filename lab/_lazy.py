"""A package's public names, each imported from its module when first used (PEP 562).

`lab`, `lab.loop` and `lab.rl` name their public classes at the top while importing none of
their modules: ``import lab`` and the ``lab`` command stay fast, and torch is imported by the
names that need it, not by the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, where: Mapping[str, str], namespace: dict[str, Any], public: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of `package`, whose `namespace` is its globals:
    ``package.<name>`` imports the module `where` names for it on first access, then keeps
    the value in `namespace` (later lookups skip the function); `public` is its ``__all__``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *public])

    return __getattr__, __dir__
