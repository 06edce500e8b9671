"""Programs compiled for an accelerator from this machine: TPU topologies, the compiler's options, what a chip
holds of a compiled (or refused) program and its largest buffers. Train's and generation's ``--compile-only``
(pretrain/compile_only.py, eval/generate_compile.py) report through it."""

from zoo import submodules

__getattr__ = submodules(__name__)
