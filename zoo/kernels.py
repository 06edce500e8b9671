"""Which attention kernel the training forward runs, and the kernels other than the blockwise XLA path.

``ModelConfig.attention`` names it: ``blockwise`` (:mod:`zoo.blockwise`, every platform), ``cudnn`` (cuDNN's
flash attention through :func:`jax.nn.dot_product_attention`, NVIDIA GPUs), ``splash`` (the Pallas TPU kernel,
:mod:`zoo.splash`; in Pallas's interpret mode off a TPU, for tests) or ``auto``: cuDNN where it applies on an
NVIDIA GPU, splash where it applies on a TPU, else blockwise. cuDNN's fused kernel takes 16-bit q/k/v of one
head size up to 128 (so not DeepSeek's latent attention, whose query/key and value heads differ) and no logit
soft-cap (Gemma 2): ``auto`` keeps those on the blockwise path, and ``cudnn`` asked for them is an error naming
the reason.

No kernel gets a [seq, seq] mask built in advance: the blockwise path builds each block's mask inside the block
from a :class:`zoo.masks.Visibility` (segment ids, row offsets, the window, shared prefixes). cuDNN takes rows
of one document each through its causal mask type and the rows' lengths (and the window); packed rows and
shared prefixes still need the boolean mask, which :func:`cudnn_attention` builds and passes as an additive
bias beside its causal mask type (so it also skips the key tiles above the diagonal). Splash gets no mask at
all: the segment ids and the window. It cannot express DPO's shared prefixes (a token reading another
segment) and needs sequences in whole 128-token blocks: :func:`splash_obstacle`.

The platform is the one the program is built for: the devices of the mesh in context (``jax.set_mesh``, as a
sharded train step is traced: a TPU program compiled from a CPU host is a TPU program), else JAX's default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp

from zoo.config import ModelConfig
from zoo.errors import UserError
from zoo.masks import Visibility

CUDNN_MAX_HEAD_DIM = 128


def cudnn_obstacle(cfg: ModelConfig, dtype: jnp.dtype) -> str | None:
    """Why cuDNN's flash attention cannot run this model's attention in ``dtype`` (None: it can)."""
    if cfg.mla:
        return "multi-head latent attention has query/key heads of another size than its value heads"
    if cfg.attn_softcap is not None:
        return "cuDNN's kernel has no attention logit soft-cap (attn_softcap)"
    if cfg.attn_sinks:
        return sinks_obstacle("cuDNN's")
    if cfg.head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim {cfg.head_dim} is over cuDNN's {CUDNN_MAX_HEAD_DIM}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN's kernel takes bfloat16 or float16, not {jnp.dtype(dtype).name} (set dtype.compute: bfloat16)"
    return None


def splash_obstacle(seq: int | None = None, prefix: bool = False) -> str | None:
    """Why splash attention cannot run the attention of rows of ``seq`` tokens (None: not known yet), with DPO's
    shared prefixes when ``prefix`` (:func:`zoo.masks.attention_mask`'s ``prefix_ids``); None: it can. Any model
    can: grouped-query heads, Gemma 2's soft-cap, sliding windows, latent attention's unequal head sizes."""
    from zoo.context import context_size
    from zoo.splash import LANES

    if prefix:
        return ("shared prefixes (prefix_ids, DPO's pairs) let a token read another segment, and splash's segment "
                "ids only pair equal ids")
    n = context_size()
    if seq is not None and seq % (LANES * n):
        if n > 1:
            return (f"sequence length {seq} does not split over mesh.context {n} into whole {LANES}-token blocks "
                    "of splash's")
        return f"sequence length {seq} is not a multiple of splash's {LANES}-token blocks"
    return None


def sinks_obstacle(kernel: str) -> str:
    """Why ``kernel`` (cuDNN's, splash's) cannot run a model with attention sinks (gpt-oss): the blockwise path
    alone adds each head's sink logit to the softmax's denominator."""
    return f"{kernel} kernel has no attention sinks (gpt-oss's per-head softmax logit); the blockwise path has"


def uses_splash(cfg: ModelConfig, seq: int | None = None, prefix: bool = False) -> bool:
    """Whether the training forward's attention is splash for rows of ``seq`` tokens (with shared prefixes when
    ``prefix``): ``splash`` asked for (a :class:`zoo.errors.UserError` naming the reason where it cannot run), or
    ``auto`` on a TPU where it can."""
    obstacle = splash_obstacle(seq, prefix) or (sinks_obstacle("splash's") if cfg.attn_sinks else None)
    if cfg.attention == "splash":
        _refuse("splash", platform_obstacle("splash") or obstacle)
        return True
    return cfg.attention == "auto" and obstacle is None and platform() == "tpu"


_TARGET: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("target", default=None)


def platform() -> str:
    """The platform the program is built for ("cpu", "gpu", "tpu"): the one :func:`target` names while a program
    for other devices is traced, else the context mesh's devices' (``jax.set_mesh``), else JAX's default backend."""
    t = _TARGET.get()
    if t:
        return t[0]
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def device_count() -> int:
    """How many devices the program is built for: :func:`target`'s, else the context mesh's, else JAX's."""
    t = _TARGET.get()
    if t:
        return t[1]
    mesh = jax.sharding.get_abstract_mesh()
    return jax.device_count() if mesh.empty else mesh.size


@contextlib.contextmanager
def target(platform_name: str, devices: int) -> Iterator[None]:
    """Trace programs for ``devices`` devices of ``platform_name`` (sizes that depend on the backend, such as
    the loss's and the MLP's chunks, and ``auto`` kernels, follow it) while this is open: for programs traced
    without a mesh in context (GRPO's sampler under ``--compile-only``)."""
    token = _TARGET.set((platform_name, devices))
    try:
        yield
    finally:
        _TARGET.reset(token)


def platform_obstacle(attention: str) -> str | None:
    """Why the kernel ``attention`` cannot run on this program's platform (None: it can, or it is not a kernel
    bound to one)."""
    if attention == "cudnn" and platform() != "gpu":
        return f"cuDNN attention runs on NVIDIA GPUs, not on {platform()}"
    if attention == "splash" and platform() == "gpu":  # interpret mode is for tests on CPUs; a GPU has cuDNN
        return "splash attention is a TPU kernel (interpreted on CPUs, for tests), not for GPUs"
    return None


def _refuse(attention: str, obstacle: str | None) -> None:
    """The one-line UserError of ``model.attention`` asked for where it cannot run (nothing when ``obstacle`` is
    None)."""
    if obstacle:
        raise UserError(f"model.attention {attention}: {obstacle}; use attention: auto or blockwise")


def check_platform(attention: str, compute: str) -> None:
    """A :class:`zoo.errors.UserError` when ``attention`` (a config's ``model.attention``) cannot run here with
    compute dtype ``compute`` whatever the model: said before a run writes anything."""
    _refuse(attention, platform_obstacle(attention))
    if attention == "cudnn" and compute not in ("bfloat16", "float16"):
        raise UserError(f"model.attention cudnn: cuDNN's kernel takes 16-bit inputs, not {compute}; set "
                        "dtype.compute: bfloat16")


def check_rows(attention: str, seq: int) -> None:
    """A :class:`zoo.errors.UserError` when ``attention`` (a config's ``model.attention``) is ``splash`` and rows of
    ``seq`` tokens (the task's row length) are not whole splash blocks: said with the other config checks, before a
    run writes anything, rather than when the step is first traced."""
    if attention == "splash":
        _refuse("splash", splash_obstacle(seq))


def kernel_for(cfg: ModelConfig, dtype: jnp.dtype, seq: int | None = None, prefix: bool = False) -> str:
    """The kernel (``blockwise``, ``cudnn`` or ``splash``) the training forward runs for ``cfg.attention``, q's
    dtype, rows of ``seq`` tokens (None: not known yet) and shared prefixes (``prefix``).

    ``cudnn`` or ``splash`` asked for where it cannot run is a :class:`zoo.errors.UserError` naming the reason."""
    if cfg.attention == "blockwise":
        return "blockwise"
    if uses_splash(cfg, seq, prefix):
        return "splash"
    obstacle = cudnn_obstacle(cfg, dtype)
    if cfg.attention == "cudnn":
        _refuse("cudnn", platform_obstacle("cudnn") or obstacle)
        return "cudnn"
    return "cudnn" if obstacle is None and platform() == "gpu" and _cuda() else "blockwise"


def _cuda() -> bool:
    """Whether the GPU is NVIDIA's (CUDA's backend, not ROCm's)."""
    device = jax.devices()[0]
    version = str(getattr(device.client, "platform_version", ""))
    return "nvidia" in device.device_kind.lower() or "cuda" in version.lower()


def cudnn_attention(qg: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility, scale: float,
                    implementation: Literal["cudnn", "xla"] = "cudnn") -> jax.Array:
    """cuDNN flash attention of head-major q/k/v (:func:`zoo.attention.head_major`: q [b, kv, group, t, d],
    k and v [b, kv, s, d]) under ``vis`` (:class:`zoo.masks.Visibility`); returns [b, t, kv * group * d], the
    layout of :func:`zoo.blockwise.blockwise_attention` (query head n reads key/value head n // group in both).
    ``implementation="xla"`` runs the same call through XLA (any platform: the layouts checked on the CPU).

    Rows of one document each (``vis.packed`` False: one document, then padding) need no mask: cuDNN's causal
    mask with each row's length as its query and key/value sequence lengths, and the window as its
    ``local_window_size``. Packed rows, shared prefixes and context parallelism's query blocks (s > t) still get
    the boolean mask [b, 1, t, s], built whole here and passed as a bias (this API has no segment ids): the
    one place the training forward builds one."""
    b, hk, g, t, d = qg.shape
    s = k.shape[2]
    q = qg.transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g, d)
    kw: dict[str, Any] = {}
    if not vis.packed and vis.prefix_ids is None and s == t:
        lengths = jnp.sum(vis.segment_ids != 0, axis=1, dtype=jnp.int32)
        kw = {"query_seq_lengths": lengths, "key_value_seq_lengths": lengths}
        if vis.window is not None:
            kw["local_window_size"] = (vis.window - 1, 0)
    else:
        kw["mask"] = vis.block(0, t, 0, s)[:, None]
    # cuDNN's causal mask type aligns query i with key i: not the case for a context shard's queries (s > t).
    out = jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale,
                                       is_causal=s == t, implementation=implementation, **kw)
    return out.reshape(b, t, hk * g * d)
