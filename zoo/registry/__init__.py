"""The zoo's catalogue of named models and the released Hugging Face configs it names."""

from zoo import submodules

__getattr__ = submodules(__name__)
