"""The model: its configuration, the decoder as pure functions, parameters, sharding rules, KV-cache decoding."""

from zoo import submodules

__getattr__ = submodules(__name__)
