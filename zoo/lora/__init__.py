"""LoRA: the adapters' parameter trees (params.py), the adapted projections beside the base matmuls (projections.py) and
the weights a forward pass computes with as one value (weights.py)."""

from zoo import submodules

__getattr__ = submodules(__name__)
