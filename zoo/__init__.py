"""lmzoo's model zoo: one configurable JAX decoder, its checkpoints, sharding and registry.

The names below load on first use (PEP 562): importing any zoo module (``zoo.errors``, ``zoo.console``) runs this
file, and every command reads and checks its arguments and config before JAX is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from zoo.errors import UserError

if TYPE_CHECKING:
    from zoo.checkpoints.format import read_config
    from zoo.checkpoints.loading import load, load_params
    from zoo.model.config import ModelConfig, RopeConfig
    from zoo.model.decoder import Decoder, forward

__version__ = "0.1.0"
__all__ = ["load", "load_params", "read_config", "ModelConfig", "RopeConfig", "UserError", "Decoder", "forward"]

# Each public name and the module that defines it (those modules import JAX).
_HOMES = {"read_config": "zoo.checkpoints.format", "ModelConfig": "zoo.model.config",
          "RopeConfig": "zoo.model.config", "load": "zoo.checkpoints.loading", "load_params": "zoo.checkpoints.loading",
          "Decoder": "zoo.model.decoder", "forward": "zoo.model.decoder"}


def submodules(package: str) -> Callable[[str], ModuleType]:
    """A package's ``__getattr__`` (PEP 562) that imports its modules on first use, so ``zoo.checkpoints.format``
    works after ``import zoo`` alone, as it did when the modules sat in ``zoo/`` itself."""

    def getattr_(name: str) -> ModuleType:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")  # importing sets the attribute: asked once
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_


def __getattr__(name: str) -> Any:
    """``zoo.load`` and the other public names, imported from their modules on first use; ``zoo.checkpoints.format`` and
    the other modules too (once this file imported them all)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later uses find it without this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"zoo.{name}") is not None:
        return importlib.import_module(f"zoo.{name}")  # importing sets the attribute: asked once
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
