"""Built-in callbacks beyond the store: files, monitors, notifications; and `build`."""

from lab.callbacks.registry import REGISTRY, build, kinds, register

__all__ = ["REGISTRY", "build", "kinds", "register"]
