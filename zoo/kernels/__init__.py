"""Attention kernels: which one a run uses (choice.py), the blockwise XLA path, and splash (TPU Pallas)."""

from zoo import submodules

__getattr__ = submodules(__name__)
