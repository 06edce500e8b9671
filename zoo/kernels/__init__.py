"""Attention kernels: which one a run uses (choice.py), the blockwise XLA path, splash (TPU Pallas), and the gated
delta rule of linear-attention layers (gated_delta.py)."""

from zoo import submodules

__getattr__ = submodules(__name__)
