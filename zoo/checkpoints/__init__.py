"""Zoo checkpoints: the format (written streaming and atomic, verified), adapters, quantized bases, loading."""

from zoo import submodules

__getattr__ = submodules(__name__)
