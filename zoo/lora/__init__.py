"""LoRA: adapter parameter trees (adapters.py) and the adapted projections beside the base matmuls."""

from zoo import submodules

__getattr__ = submodules(__name__)
