"""One decoder layer's parts: custom-VJP blocks, attention, the MLP, mixture-of-experts and its grouped matmul."""

from zoo import submodules

__getattr__ = submodules(__name__)
