"""Which attention kernel the training forward runs, and the kernels other than the blockwise XLA path.

``ModelConfig.attention`` names it: ``blockwise`` (:mod:`zoo.blockwise`, every platform), ``cudnn`` (cuDNN's
flash attention through :func:`jax.nn.dot_product_attention`, NVIDIA GPUs) or ``auto``: cuDNN where it applies
on an NVIDIA GPU, else blockwise. cuDNN's fused kernel takes 16-bit q/k/v of one head size up to 128 (so not
DeepSeek's latent attention, whose query/key and value heads differ) and no logit soft-cap (Gemma 2): ``auto``
keeps those on the blockwise path, and ``cudnn`` asked for them is an error naming the reason.

Both kernels see the same boolean mask (:func:`zoo.masks.attention_mask`: causal within each packed document,
windowed, shared prefixes); cuDNN gets it as an additive bias beside its causal mask type, so it also skips the
key tiles above the diagonal.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp

from zoo.config import ModelConfig
from zoo.errors import UserError

CUDNN_MAX_HEAD_DIM = 128


def cudnn_obstacle(cfg: ModelConfig, dtype: jnp.dtype) -> str | None:
    """Why cuDNN's flash attention cannot run this model's attention in ``dtype`` (None: it can)."""
    if cfg.mla:
        return "multi-head latent attention has query/key heads of another size than its value heads"
    if cfg.attn_softcap is not None:
        return "cuDNN's kernel has no attention logit soft-cap (attn_softcap)"
    if cfg.head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim {cfg.head_dim} is over cuDNN's {CUDNN_MAX_HEAD_DIM}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN's kernel takes bfloat16 or float16, not {jnp.dtype(dtype).name} (set dtype.compute: bfloat16)"
    return None


_TARGET: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("target", default=None)


def platform() -> str:
    """The platform the program is built for ("cpu", "gpu", "tpu"): JAX's default backend, or the one
    :func:`target` names while a program for other devices is traced (``--compile-only`` on a CPU host)."""
    t = _TARGET.get()
    return t[0] if t else jax.default_backend()


def device_count() -> int:
    """How many devices the program is built for (:func:`target`'s, else JAX's)."""
    t = _TARGET.get()
    return t[1] if t else jax.device_count()


@contextlib.contextmanager
def target(platform_name: str, devices: int) -> Iterator[None]:
    """Trace programs for ``devices`` devices of ``platform_name`` (sizes that depend on the backend, such as
    the loss's and the MLP's chunks, and ``auto`` kernels, follow it) while this is open."""
    token = _TARGET.set((platform_name, devices))
    try:
        yield
    finally:
        _TARGET.reset(token)


def check_platform(attention: str, compute: str) -> None:
    """A :class:`zoo.errors.UserError` when ``attention`` (a config's ``model.attention``) cannot run here with
    compute dtype ``compute`` whatever the model: said before a run writes anything."""
    if attention == "cudnn":
        if platform() != "gpu":
            raise UserError(f"model.attention cudnn: cuDNN attention runs on NVIDIA GPUs, not on {platform()}; "
                            "use attention: auto or blockwise")
        if compute not in ("bfloat16", "float16"):
            raise UserError(f"model.attention cudnn: cuDNN's kernel takes 16-bit inputs, not {compute}; set "
                            "dtype.compute: bfloat16")


def kernel_for(cfg: ModelConfig, dtype: jnp.dtype) -> str:
    """The kernel (``blockwise`` or ``cudnn``) the training forward runs for ``cfg.attention`` and q's dtype.

    ``cudnn`` asked for where it cannot run is a :class:`zoo.errors.UserError` naming the reason."""
    if cfg.attention == "blockwise":
        return "blockwise"
    obstacle = cudnn_obstacle(cfg, dtype)
    if cfg.attention == "cudnn":
        if platform() != "gpu":
            obstacle = f"cuDNN attention runs on NVIDIA GPUs, not on {platform()}"
        if obstacle:
            raise UserError(f"model.attention cudnn: {obstacle}; use attention: auto or blockwise")
        return "cudnn"
    return "cudnn" if obstacle is None and platform() == "gpu" and _cuda() else "blockwise"


def _cuda() -> bool:
    """Whether the GPU is NVIDIA's (CUDA's backend, not ROCm's)."""
    device = jax.devices()[0]
    version = str(getattr(device.client, "platform_version", ""))
    return "nvidia" in device.device_kind.lower() or "cuda" in version.lower()


def cudnn_attention(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                    implementation: Literal["cudnn", "xla"] = "cudnn") -> jax.Array:
    """cuDNN flash attention of head-major q/k/v (:func:`zoo.attention.head_major`: q [b, kv, group, t, d],
    k and v [b, kv, t, d]) under the boolean ``mask`` [b, 1, t, t]; returns [b, t, kv * group * d], the layout
    of :func:`zoo.blockwise.blockwise_attention` (query head n reads key/value head n // group in both).
    ``implementation="xla"`` runs the same call through XLA (any platform: the layouts checked on the CPU)."""
    b, hk, g, t, d = qg.shape
    q = qg.transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g, d)
    out = jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask=mask,
                                       scale=scale, is_causal=True, implementation=implementation)
    return out.reshape(b, t, hk * g * d)
