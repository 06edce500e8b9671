"""Which attention kernel the training forward runs, and the kernels other than the blockwise XLA path.

``ModelConfig.attention`` names it: ``blockwise`` (:mod:`zoo.kernels.blockwise`, every platform), ``cudnn`` (cuDNN's
flash attention through :func:`jax.nn.dot_product_attention`, NVIDIA GPUs), ``splash`` (the Pallas TPU kernel,
:mod:`zoo.kernels.splash`; in Pallas's interpret mode off a TPU, for tests) or ``auto``: cuDNN where it applies on an
NVIDIA GPU, splash where it applies on a TPU, else blockwise. cuDNN's fused kernel takes 16-bit q/k/v of one
head size up to 128 (so not DeepSeek's latent attention, whose query/key and value heads differ) and no logit
soft-cap (Gemma 2): ``auto`` keeps those on the blockwise path, and ``cudnn`` asked for them is an error naming
the reason.

No kernel gets a [seq, seq] mask: the blockwise path builds each block's mask inside the block from a
:class:`zoo.model.masks.Visibility` (segment ids, row offsets, the window, shared prefixes). cuDNN takes rows of one
document each through its causal mask type and the rows' lengths, and packed rows through its packed layout
(each document's start and length, :func:`packed_layout`), with the window; that needs a bound on the documents
a row holds (``data.max_segments`` with best-fit packing), and it cannot express shared prefixes or a context
shard's queries: :func:`cudnn_rows_obstacle` (``auto`` then takes the blockwise path). Splash gets the segment
ids and the window. It cannot express DPO's shared prefixes (a token reading another segment) and needs
sequences in whole 128-token blocks: :func:`splash_obstacle`. Neither takes Gemma 3's bidirectional image blocks
(``Visibility.block_ids``: a query reading later keys of its block), so ``auto`` runs those rows blockwise.

The platform is the one the program is built for: the devices of the mesh in context (``jax.set_mesh``, as a
sharded train step is traced: a TPU program compiled from a CPU host is a TPU program), else JAX's default.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp

from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.masks import Visibility

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


BLOCKS_OBSTACLE = "bidirectional image blocks (Gemma 3's image tokens) let a query read later keys of its block"


def cudnn_rows_obstacle(segments: int | None, prefix: bool = False, blocks: bool = False) -> str | None:
    """Why cuDNN's kernel cannot take rows of at most ``segments`` documents (None: no bound known), with DPO's
    shared prefixes when ``prefix``, bidirectional image blocks when ``blocks``, without a [seq, seq] mask; None:
    it can."""
    from zoo.model.context import context_size

    if blocks:
        return BLOCKS_OBSTACLE + ", which cuDNN's causal masks cannot"
    if prefix:
        return ("shared prefixes (prefix_ids, DPO's pairs) let a token read another segment, which cuDNN's packed "
                "documents cannot")
    if context_size() > 1:
        return "context parallelism's query shards do not start at their keys' first row, as cuDNN's causal mask does"
    if segments is None:
        return ("packed rows have no bound on their documents for cuDNN's packed layout: set data.max_segments "
                "(best-fit packing) or data.packing: false")
    if segments > 1 and platform() == "gpu" and not _hopper():
        return "cuDNN's packed layout (packed rows) needs a Hopper GPU or later (compute capability 9.0)"
    return None


def _hopper() -> bool:
    """Whether this process's GPU is an NVIDIA Hopper or later (cuDNN's packed layout needs one)."""
    from jax._src.cudnn.fused_attention_stablehlo import check_compute_capability

    try:
        return bool(check_compute_capability("9.0"))
    except Exception:  # no CUDA GPU in this process (a program traced for another): as cuDNN itself would find
        return False


def splash_obstacle(seq: int | None = None, prefix: bool = False, blocks: bool = False) -> str | None:
    """Why splash attention cannot run the attention of rows of ``seq`` tokens (None: not known yet), with DPO's
    shared prefixes when ``prefix`` (:func:`zoo.model.masks.attention_mask`'s ``prefix_ids``), bidirectional image
    blocks when ``blocks``; None: it can. Any model can: grouped-query heads, Gemma 2's soft-cap, sliding windows,
    latent attention's unequal head sizes."""
    from zoo.kernels.splash import LANES
    from zoo.model.context import context_size

    if blocks:
        return BLOCKS_OBSTACLE + ", which splash's causal masks cannot"
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


def uses_splash(cfg: ModelConfig, seq: int | None = None, prefix: bool = False, blocks: bool = False) -> bool:
    """Whether the training forward's attention is splash for rows of ``seq`` tokens (with shared prefixes when
    ``prefix``, bidirectional image blocks when ``blocks``): ``splash`` asked for (a :class:`zoo.errors.UserError`
    naming the reason where it cannot run), or ``auto`` on a TPU where it can."""
    obstacle = splash_obstacle(seq, prefix, blocks) or (sinks_obstacle("splash's") if cfg.attn_sinks else None)
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


def check_rows(attention: str, seq: int, segments: int | None = 1) -> None:
    """A :class:`zoo.errors.UserError` when ``attention`` (a config's ``model.attention``) cannot take the task's
    rows: ``splash`` and rows of ``seq`` tokens not whole splash blocks, or ``cudnn`` and packed rows of no bound
    on their documents (``segments`` None): said with the other config checks, before a run writes anything,
    rather than when the step is first traced."""
    if attention == "splash":
        _refuse("splash", splash_obstacle(seq))
    if attention == "cudnn" and segments is None:
        _refuse("cudnn", cudnn_rows_obstacle(segments))


def kernel_for(cfg: ModelConfig, dtype: jnp.dtype, seq: int | None = None, prefix: bool = False,
               segments: int | None = 1, blocks: bool = False) -> str:
    """The kernel (``blockwise``, ``cudnn`` or ``splash``) the training forward runs for ``cfg.attention``, q's
    dtype, rows of ``seq`` tokens (None: not known yet) of at most ``segments`` documents (None: no bound),
    shared prefixes (``prefix``) and bidirectional image blocks (``blocks``).

    ``cudnn`` or ``splash`` asked for where it cannot run is a :class:`zoo.errors.UserError` naming the reason."""
    if cfg.attention == "blockwise":
        return "blockwise"
    if uses_splash(cfg, seq, prefix, blocks):
        return "splash"
    obstacle = cudnn_obstacle(cfg, dtype) or cudnn_rows_obstacle(segments, prefix, blocks)
    if cfg.attention == "cudnn":
        _refuse("cudnn", platform_obstacle("cudnn") or obstacle)
        return "cudnn"
    return "cudnn" if obstacle is None and platform() == "gpu" and _cuda() else "blockwise"


def _cuda() -> bool:
    """Whether the GPU is NVIDIA's (CUDA's backend, not ROCm's)."""
    device = jax.devices()[0]
    version = str(getattr(device.client, "platform_version", ""))
    return "nvidia" in device.device_kind.lower() or "cuda" in version.lower()


def packed_layout(segment_ids: jax.Array, segments: int) -> tuple[jax.Array, jax.Array]:
    """The documents of rows [b, t] of segment ids (0: padding) as cuDNN's packed layout takes them: (lengths
    [b, segments], starts [b, segments + 1]), int32, the row's documents in row order, -1 past its last. A document
    is a run of one nonzero id; runs past the ``segments``-th are left out (their rows then read nothing), which
    the packer's bound (``data.max_segments``) rules out. O(b * t): no [t, t] array."""
    b, t = segment_ids.shape
    real = segment_ids != 0
    before = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    first = real & (segment_ids != before)  # a document's first row
    run = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1  # each row's document index
    starts = jnp.sort(jnp.where(first, jnp.arange(t, dtype=jnp.int32), t), axis=1)[:, :segments]
    if starts.shape[1] < segments:  # rows shorter than the bound
        starts = jnp.pad(starts, ((0, 0), (0, segments - starts.shape[1])), constant_values=t)
    counts = jax.vmap(lambda r, m: jnp.zeros(segments, jnp.int32).at[r].add(m, mode="drop"))(
        jnp.where(real, run, segments), real.astype(jnp.int32))
    present = starts < t
    lengths = jnp.where(present, counts, -1)
    starts = jnp.pad(jnp.where(present, starts, -1), ((0, 0), (0, 1)), constant_values=-1)
    return lengths, starts


def cudnn_attention(qg: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility, scale: float,
                    implementation: Literal["cudnn", "xla"] = "cudnn") -> jax.Array:
    """cuDNN flash attention of head-major q/k/v (:func:`zoo.layers.attention.head_major`: q [b, kv, group, t, d],
    k and v [b, kv, s, d]) under ``vis`` (:class:`zoo.model.masks.Visibility`); returns [b, t, kv * group * d], the
    layout of :func:`zoo.kernels.blockwise.blockwise_attention` (query head n reads key/value head n // group in both).
    ``implementation="xla"`` runs the same call through XLA (any platform: the layouts checked on the CPU).

    No mask: rows of one document each (``vis.segments`` 1: one document, then padding) go through cuDNN's
    causal mask with each row's length as its query and key/value sequence lengths; rows of up to
    ``vis.segments`` documents through its packed layout (:func:`packed_layout`: each document's start and
    length, causal within it); the window either way. Rows it cannot take that way (:func:`cudnn_rows_obstacle`)
    are a ValueError: :func:`kernel_for` does not pick cuDNN for them. Padding rows come out 0.

    ``implementation="xla"`` (rows of one document each only) runs the same call through XLA, so the layouts are
    checked on the CPU; the packed layout is cuDNN's own call (``jax.nn`` has none), checked on a GPU."""
    b, hk, g, t, d = qg.shape
    obstacle = cudnn_rows_obstacle(vis.segments, vis.prefix_ids is not None, vis.block_ids is not None)
    if obstacle or k.shape[2] != t:
        raise ValueError(f"cudnn_attention: {obstacle or 'queries and keys of different lengths'}")
    assert vis.segments is not None  # by cudnn_rows_obstacle
    q = qg.transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g, d)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    real = vis.segment_ids != 0
    if vis.segments == 1:
        lengths = jnp.sum(real, axis=1, dtype=jnp.int32)
        window = None if vis.window is None else (vis.window - 1, 0)
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths,
                                           key_value_seq_lengths=lengths, local_window_size=window,
                                           implementation=implementation)
    else:
        if implementation != "cudnn":
            raise ValueError("cudnn_attention: packed rows run on cuDNN only")
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_call

        lengths, starts = packed_layout(vis.segment_ids, vis.segments)
        out = cudnn_call(q, k, v, None, None, lengths, lengths, starts, starts, scale=scale,
                         mask_type=MaskType.PADDING_CAUSAL, sliding_window_length=vis.window)
    # Padding rows belong to no document: cuDNN leaves them unspecified, and no target reads them.
    return jnp.where(real[:, :, None], out.reshape(b, t, hk * g * d), 0)
