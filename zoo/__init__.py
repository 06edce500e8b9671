"""lmzoo's model zoo: one configurable JAX decoder, its checkpoints, sharding and registry.

The names below load on first use (PEP 562): importing any zoo module (``zoo.errors``, ``zoo.console``) runs this
file, and every command reads and checks its arguments and config before JAX is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from zoo.errors import UserError

if TYPE_CHECKING:
    from zoo.checkpoint import read_config
    from zoo.config import ModelConfig, RopeConfig
    from zoo.loading import load, load_params
    from zoo.model import Decoder, forward

__version__ = "0.1.0"
__all__ = ["load", "load_params", "read_config", "ModelConfig", "RopeConfig", "UserError", "Decoder", "forward"]

# Each public name and the module that defines it (those modules import JAX).
_HOMES = {"read_config": "zoo.checkpoint", "ModelConfig": "zoo.config", "RopeConfig": "zoo.config",
          "load": "zoo.loading", "load_params": "zoo.loading", "Decoder": "zoo.model", "forward": "zoo.model"}


def __getattr__(name: str) -> Any:
    """``zoo.load`` and the other public names, imported from their modules on first use; ``zoo.checkpoint`` and
    the other modules too (once this file imported them all)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later uses find it without this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"zoo.{name}") is not None:
        return importlib.import_module(f"zoo.{name}")  # importing sets the attribute: asked once
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
