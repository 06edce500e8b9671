"""lmzoo's model zoo: one configurable JAX decoder, its checkpoints, sharding and registry."""

from zoo.checkpoint import read_config
from zoo.config import ModelConfig, RopeConfig
from zoo.errors import UserError
from zoo.loading import load, load_params
from zoo.model import Decoder, forward

__version__ = "0.1.0"
__all__ = ["load", "load_params", "read_config", "ModelConfig", "RopeConfig", "UserError", "Decoder", "forward"]
