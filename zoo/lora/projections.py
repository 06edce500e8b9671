"""LoRA adapters beside the base matmuls: the adapter branch, its dropout, and adapted projections.

An adapter {"a", "b"} of weight W adds ``scale * (x @ A) @ B`` to ``x @ W``.
It always runs beside the base matmul, never merged into W (a merged
weight's gradient would cost a full weight gradient), and where it can its
A matmul joins the base weights' fused norm + projection (:mod:`zoo.layers.blocks`),
so LoRA keeps no extra normed copy of x. The adapter trees themselves
(specs, init, merge) live in :mod:`zoo.lora.params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.blocks import dense, dense_unnamed, normed_dense, rms_norm
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig

# Every weight that can carry a LoRA adapter, in a fixed order: its index is folded into the layer's dropout
# key, so each adapted projection draws its own mask (q's adapter never sees v's mask).
ADAPTABLE = ("q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down",
             "shared_gate", "shared_up", "shared_down", "expert_gate_up",  # Gemma 4's fused experts
             "proj",  # a vision-language model's connector (zoo.model.vision)
             "qkv", "fc1", "fc2",  # the Qwen towers' fused q/k/v and their patch mergers' MLP (zoo.lora.vision_targets)
             # Qwen3-Next: the full layers' output gate and the linear layers' projections (zoo.layers.linear_attention)
             "attn_gate", "lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "lin_out")
# Folded into a LoRA run's dropout key for an image tower's layers, its connector and Qwen3-VL's DeepStack mergers,
# so their masks are drawn apart from the decoder's layers' (zoo.model.vision's SigLIP tower too).
TOWER_DROPOUT, PROJECTOR_DROPOUT, DEEPSTACK_DROPOUT = 1 << 20, (1 << 20) + 1, (1 << 20) + 2
# The weights whose adapters cannot be per batch row (LayerLora.rows): the MoE experts' (routed, Gemma 4's fused
# and shared), which read the tokens flattened across rows.
ROW_REFUSED = ("expert_gate", "expert_up", "expert_down", "expert_gate_up", "shared_gate", "shared_up", "shared_down")


@dataclass(frozen=True)
class LoraDropout:
    """LoRA dropout within one layer: ``rate`` and that layer's PRNG ``key``.

    Calling it on an adapter's input x zeroes each element with probability
    ``rate`` and scales the rest by 1/(1 - rate) (inverted dropout, so the
    expected adapter output is unchanged). Only the adapter branch sees the
    dropped input, as peft's ``scale * B(A(dropout(x)))``: the base weight
    still multiplies x itself.
    """

    rate: float | jax.Array
    key: jax.Array

    def __call__(self, x: jax.Array, name: str) -> jax.Array:
        """x with dropout applied, the mask drawn from this layer's key and the adapted weight ``name``."""
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(jax.random.fold_in(self.key, ADAPTABLE.index(name)), keep, x.shape)
        return jnp.where(mask, x / keep, 0).astype(x.dtype)


@dataclass(frozen=True)
class LayerLora:
    """One layer's LoRA as its projections read it: ``adapters`` by weight name ({"a", "b"} each; a routed
    expert's stacked on the expert axis like its weight), their ``scale``, and the layer's dropout (None: none).
    The decoder makes one per layer from its :class:`zoo.lora.weights.Weights` (None where a layer has no
    adapters), so the layers take one value rather than adapters, scale and dropout side by side.

    ``rows``: each adapter is one per batch row, A [batch, *in, r] and B [batch, r, *out] (several fine-tunes
    served in one batch, :mod:`zoo.lora.rows`): each row's x meets its own A and B, beside the base matmul,
    never fused with it. Decoding only: no dropout, and no routed or shared experts' adapters (their tokens are
    flattened across rows before they reach them)."""

    adapters: dict
    scale: float | jax.Array = 1.0
    drop: LoraDropout | None = None
    rows: bool = False

    def __post_init__(self) -> None:
        if self.rows and self.drop is not None:
            raise ValueError("per-row LoRA adapters decode only: no dropout")
        experts = [n for n in self.adapters if n in ROW_REFUSED] if self.rows else []
        if experts:
            raise ValueError(f"per-row LoRA adapters of expert weights {experts} are not supported")

    def of(self, names: tuple[str, ...]) -> tuple[dict | None, ...]:
        """The adapter of each named weight (None where it has none)."""
        return tuple(self.adapters.get(n) for n in names)

    def apart(self, x: jax.Array, name: str, dtype: Any, contract: int = 1) -> jax.Array:
        """The adapter of weight ``name`` on its own (not fused with a base matmul) for input x, cast to ``dtype``:
        on the dropped copy of x with dropout, each row's own adapter with :attr:`rows`."""
        adapter = self.adapters[name]
        if self.rows:
            return row_branch(x, adapter, self.scale, dtype)
        return lora_branch(x if self.drop is None else self.drop(x, name), adapter, self.scale, dtype, contract)


@dataclass(frozen=True)
class PartLora:
    """The LoRA of a part of a vision-language model outside the decoder (an image tower, a connector, Qwen3-VL's
    DeepStack mergers), as :meth:`of` reads it from the weights: its ``adapters`` by weight name (a tower's
    stacked over its layers, as their weights; None: none), their ``scale``, and its dropout ``rate`` and ``key``
    (None: no dropout, as in evaluation and sampling)."""

    adapters: dict | None
    scale: float | jax.Array = 1.0
    rate: float | jax.Array = 0.0
    key: jax.Array | None = None

    @classmethod
    def of(cls, params: Any, path: tuple[str, ...], salt: int) -> PartLora:
        """The LoRA of the part at ``path`` (``("vision", "layers")``, ``("projector",)``) of ``params`` (the
        model's parameters, or its :class:`zoo.lora.weights.Weights`), its dropout key folded with ``salt``."""
        w = Weights.wrap(params)
        adapters: Any = w.adapters
        for name in path:
            adapters = (adapters or {}).get(name)
        no_drop = isinstance(w.dropout, (int, float)) and w.dropout <= 0  # evaluation's rate: exactly 0
        key = None if adapters is None or w.rng is None or no_drop else jax.random.fold_in(w.rng, salt)
        return cls(adapters or None, 1.0 if w.scale is None else w.scale, w.dropout, key)

    def keys(self, n: int) -> jax.Array | None:
        """Dropout keys of a part stacked over ``n`` layers (or levels), one each; None without dropout."""
        return None if self.key is None else jax.random.split(self.key, n)

    def layer(self, adapters: dict | None, key: jax.Array | None) -> LayerLora | None:
        """One layer's :class:`LayerLora` of its slice of the adapters and its key (None without adapters)."""
        return None if adapters is None else LayerLora(adapters, self.scale, None if key is None else
                                                       LoraDropout(self.rate, key))

    def whole(self) -> LayerLora | None:
        """The :class:`LayerLora` of a part without layers (a connector)."""
        return self.layer(self.adapters, self.key)


def adapter_of(lora: LayerLora | None, name: str) -> dict | None:
    """The adapter of weight ``name`` in a layer's ``lora`` (None without LoRA, or where it has none)."""
    return None if lora is None else lora.adapters.get(name)


def drop_of(lora: LayerLora | None) -> LoraDropout | None:
    """A layer's LoRA dropout (None without LoRA or without dropout)."""
    return None if lora is None else lora.drop


def lora_branch(x: jax.Array, adapter: dict, scale: float | jax.Array, dtype: Any, contract: int = 1) -> jax.Array:
    """``scale * (x @ A) @ B`` on its own (not fused with a base matmul), cast to ``dtype``.

    Used where A cannot join a fused base matmul: beside a single weight
    (:func:`adapted_dense`) and on inputs the base weight does not read
    (LoRA dropout's dropped copies).
    """
    return lora_out(dense(x, adapter["a"], contract=contract), adapter["b"], scale, dtype)


def lora_out(u: jax.Array, b: jax.Array, scale: float | jax.Array, dtype: Any) -> jax.Array:
    """A LoRA adapter's output, ``scale * u @ B`` for u = x @ A [..., rank], cast to the base output's dtype.

    Not named "dense": under ``remat: save_dots`` only the small u is kept and
    this [tokens, out] product is recomputed (one rank-r matmul).
    """
    return (scale * dense_unnamed(u, b)).astype(dtype)


def adapted_dense(x: jax.Array, w: jax.Array, lora: LayerLora | None, name: str, contract: int = 1) -> jax.Array:
    """:func:`dense` of x and w, plus ``scale * (x @ A) @ B`` when the layer's ``lora`` has an adapter for ``name``.

    The adapter runs beside the base matmul, never merged into w: a merged
    weight's gradient would cost as much as a full weight gradient. With
    the layer's dropout the adapter's x is ``drop(x, name)`` (the base's stays x); with per-row adapters
    (``lora.rows``) each row's x meets its own adapter.
    """
    y = dense(x, w, contract=contract)
    if lora is None or adapter_of(lora, name) is None:
        return y
    return y + lora.apart(x, name, y.dtype, contract)


def projections(x: jax.Array, ws: tuple[jax.Array, ...], cfg: ModelConfig,
                norm_w: jax.Array | None = None, lora: LayerLora | None = None,
                names: tuple[str, ...] = ()) -> tuple[jax.Array, ...]:
    """x @ w for each w in ws; with ``norm_w``, of the RMS-normed x (see :func:`normed_dense`).

    The layer's ``lora`` adapters of the weights ``names`` name (one per w)
    add ``scale * (x @ A) @ B``. The A matmuls go through the same
    :func:`normed_dense` as the base weights, so the normed x is still not
    kept for the backward pass. With LoRA dropout or per-row adapters see :func:`_apart_projections`.
    """
    adapters = (None,) * len(ws) if lora is None else lora.of(names)
    if lora is not None and (lora.drop is not None or lora.rows) and any(ad is not None for ad in adapters):
        return _apart_projections(x, ws, cfg, norm_w, lora, names)
    lora_scale = 1.0 if lora is None else lora.scale
    a_ws = tuple(ad["a"] for ad in adapters if ad is not None)
    if norm_w is None:
        ys = tuple(dense(x, w) for w in ws + a_ws)
    else:
        ys = normed_dense(x, norm_w, ws + a_ws, cfg.rms_norm_eps, cfg.norm_offset)
    out, us = list(ys[:len(ws)]), iter(ys[len(ws):])
    for i, ad in enumerate(adapters):
        if ad is not None:
            out[i] = out[i] + lora_out(next(us), ad["b"], lora_scale, out[i].dtype)
    return tuple(out)


def _apart_projections(x: jax.Array, ws: tuple[jax.Array, ...], cfg: ModelConfig, norm_w: jax.Array | None,
                       lora: LayerLora, names: tuple[str, ...]) -> tuple[jax.Array, ...]:
    """:func:`projections` with LoRA dropout or per-row adapters: the base matmuls stay fused on x, each adapter
    runs apart (:meth:`LayerLora.apart`).

    The A matmuls cannot share the fused norm + projection here: with
    dropout each adapter reads its own dropped copy of the (normed) x, which
    the base weights must not see (that copy is kept for the adapter's
    backward pass: dropout costs activation memory, which is why it is off by
    default); per-row adapters are a batched matmul, one A per row, where the
    fused one multiplies every row by the same weights.
    """
    ys = list(projections(x, ws, cfg, norm_w))
    n = x if norm_w is None else rms_norm(x, norm_w, cfg.rms_norm_eps, cfg.norm_offset)
    for i, name in enumerate(names):
        if lora.adapters.get(name) is not None:
            ys[i] = ys[i] + lora.apart(n, name, ys[i].dtype)
    return tuple(ys)


def row_branch(x: jax.Array, adapter: dict, scale: float | jax.Array, dtype: Any) -> jax.Array:
    """``scale * (x[i] @ A[i]) @ B[i]`` for each batch row i, cast to ``dtype``: x [b, ..., K] (K the weight's
    input axes flattened, as :func:`zoo.layers.blocks.dense` reads them), A [b, *in, r] and
    B [b, r, *out] (:class:`LayerLora` with ``rows``); returns [b, ..., N], N the out axes flattened.

    Two batched matmuls at rank r: per row the same products as :func:`lora_branch`'s."""
    a, b = adapter["a"], adapter["b"]
    rows, k = x.shape[0], x.shape[-1]
    a2 = a.reshape(rows, k, a.shape[-1])
    b2 = b.reshape(rows, b.shape[1], -1)
    u = jnp.einsum("btk,bkr->btr", x.reshape(rows, -1, k), a2)
    y = scale * jnp.einsum("btr,brn->btn", u, b2)
    return y.reshape(*x.shape[:-1], b2.shape[-1]).astype(dtype)
