"""LoRA: the adapters' parameter trees (params.py), the adapted projections beside the base matmuls (projections.py),
the weights a forward pass computes with as one value (weights.py), and the names of a vision-language model's
tower and connector targets (vision_targets.py)."""

from zoo import submodules

__getattr__ = submodules(__name__)
