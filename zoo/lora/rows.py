"""Several LoRA adapters over one base in one batch: each row of a decoding batch with its own adapter, or none.

:func:`stack_adapters` stacks N adapter trees (each keyed as
:func:`zoo.lora.params.init_lora` makes them, with its own scale, rank and
targets) into one :class:`RowAdapters`: per adapted weight, A
[layers, N + 1, *in, r] and B [layers, N + 1, r, *out], where

- entry 0 is all zeros, "no adapter" (the base model), and entry i + 1 is ``adapters[i]``;
- ranks are zero-padded to the largest of that weight's adapters (exact: a zero column of A meets a zero row of
  B, adding nothing);
- each adapter's scale (alpha / r) is folded into its B, so the applied scale is 1;
- a weight an adapter does not target gets zeros in its entry.

:meth:`RowAdapters.select` gathers each row's entry ([layers, b, ...]: the
layers stay first, where :func:`zoo.model.layer_scan.stack_slice` and the
layer scans slice them) and :meth:`RowAdapters.weights` wraps that as the
:class:`zoo.lora.weights.Weights` (``rows=True``) that
:func:`zoo.model.decode.forward_step` (and :func:`zoo.model.decoder.forward`)
take::

    stack = stack_adapters(cfg, [(tree_a, lora_scale(cfg_a)), (tree_b, lora_scale(cfg_b))])
    w = stack.weights(base, jnp.asarray([1, 0, 2]))  # row 0: adapter a, row 1: the base, row 2: adapter b
    logits, cache = forward_step(cfg, w, tokens, cache, valid, fresh=True)

Each adapted projection then adds ``(x[i] @ A[i]) @ B[i]`` for each row i
beside its base matmul (:func:`zoo.lora.projections.row_branch`), never fused with it.
Refused (a UserError naming the adapter and the weight): adapters of the MoE
experts' weights (routed, Gemma 4's fused, shared: their tokens are flattened
across rows before they reach them), of a vision-language model's image tower
or connector, and weights trained whole (a reward model's score head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo.errors import UserError
from zoo.lora.params import adapter_lead, adapter_specs
from zoo.lora.projections import ROW_REFUSED
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.params import flatten, nest, param_specs


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class RowAdapters:
    """N adapters stacked for per-row serving (:func:`stack_adapters`): ``adapters`` keyed like
    :func:`zoo.lora.params.init_lora`'s tree, each leaf [layers, N + 1, ...] with entry 0 the base (zeros), their
    scales folded into B. A pytree (``adapters`` its leaves), so it can enter a jitted step whole."""

    adapters: dict[str, Any]

    @property
    def count(self) -> int:
        """Entries, the base's included: N + 1 (row indexes run 0 .. N)."""
        return int(jax.tree.leaves(self.adapters)[0].shape[1])

    def select(self, index: jax.Array) -> dict[str, Any]:
        """Each row's adapter tree for ``index`` [b] (entry numbers 0 .. :attr:`count` - 1, 0: the base; one out of
        range reads NaN, jnp.take's fill): leaves [layers, b, ...]."""
        return jax.tree.map(lambda a: jnp.take(a, index, axis=1), self.adapters)

    def weights(self, base: Any, index: jax.Array) -> Weights:
        """The :class:`Weights` for a batch whose row r uses entry ``index[r]``: ``base`` with :meth:`select`'s
        per-row adapters, scale 1 (folded into B), ``rows=True``."""
        return Weights(base, self.select(index), 1.0, rows=True)

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        """The adapters are the one child."""
        return (self.adapters,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple[Any, ...]) -> RowAdapters:
        """The inverse of :meth:`tree_flatten`."""
        return cls(children[0])


def _refusal(i: int, path: str) -> str | None:
    """Why adapter ``i``'s tree entry ``path`` cannot be served per row (None: it can)."""
    weight, _, leaf = path.rpartition(".")
    where = f"lora rows: adapter {i} adapts {weight or path}"
    if leaf not in ("a", "b"):
        return (f"lora rows: adapter {i} trains {path} whole (a reward model's head); per-row serving takes "
                "LoRA A/B adapters only: serve it alone, its weights merged (zoo.lora.params.merge_lora)")
    if weight.startswith(("vision.", "projector.")):
        return (f"{where}, in the image tower or connector; per-row adapters adapt the language model only: "
                "serve it alone (one adapter for the batch) or merge it (zoo.lora.params.merge_lora)")
    if weight.rpartition(".")[2] in ROW_REFUSED:
        return (f"{where}, an MoE expert weight; per-row adapters adapt attention and dense MLP weights only: "
                "serve it alone (one adapter for the batch) or merge it (zoo.lora.params.merge_lora)")
    return None


def _checked(cfg: ModelConfig, i: int, tree: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Adapter ``i``'s (A, B) by weight path, each checked against ``cfg``'s weight (a UserError otherwise)."""
    flat, specs = flatten(tree), param_specs(cfg)
    for path in flat:
        why = _refusal(i, path)
        if why:
            raise UserError(why)
    out = {}
    for weight in sorted({p.rpartition(".")[0] for p in flat}):
        a, b = flat.get(f"{weight}.a"), flat.get(f"{weight}.b")
        if weight not in specs or a is None or b is None or adapter_lead(cfg, weight) != 1:
            raise UserError(f"lora rows: adapter {i} adapts {weight}, which is no layer weight of this "
                            f"{cfg.family} model with both .a and .b; stack adapters made for this model")
        want = adapter_specs(specs[weight], weight.rpartition(".")[2], a.shape[-1])
        if (tuple(a.shape), tuple(b.shape)) != (want[0].shape, want[1].shape):
            raise UserError(f"lora rows: adapter {i}'s {weight} is A {tuple(a.shape)}, B {tuple(b.shape)}; this "
                            f"model's take A {want[0].shape}, B {want[1].shape}")
        out[weight] = (a, b)
    return out


def stack_adapters(cfg: ModelConfig, adapters: Sequence[tuple[dict[str, Any], float]],
                   dtype: Any = None) -> RowAdapters:
    """The adapters ``(tree, scale)`` (trees as :func:`zoo.lora.params.init_lora` makes them, ``scale`` their
    :func:`zoo.lora.params.lora_scale`) of model ``cfg`` stacked for per-row serving: entry i + 1 is
    ``adapters[i]``, entry 0 the base (see the module docstring). ``dtype``: the stacked leaves' (None: the
    adapters' own, promoted). Built on the host (NumPy: no program compiled per shape), moved to the device once.

    A UserError names the adapter and the weight it cannot serve per row (MoE experts, an image tower or
    connector, a weight trained whole) or that does not fit ``cfg``.
    """
    if not adapters:
        raise UserError("lora rows: no adapters to stack; give at least one (tree, scale)")
    pairs = [_checked(cfg, i, tree) for i, (tree, _) in enumerate(adapters)]
    scales = [float(s) for _, s in adapters]
    leaves = [x for ab in pairs for a, b in ab.values() for x in (a, b)]
    out_dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(*leaves)
    specs = param_specs(cfg)
    flat: dict[str, Any] = {}
    for weight in sorted({w for ab in pairs for w in ab}):
        rank = max(ab[weight][0].shape[-1] for ab in pairs if weight in ab)
        a_shape, b_shape = (s.shape for s in adapter_specs(specs[weight], weight.rpartition(".")[2], rank))
        a_all = np.zeros((a_shape[0], len(pairs) + 1, *a_shape[1:]), np.float32)
        b_all = np.zeros((b_shape[0], len(pairs) + 1, *b_shape[1:]), np.float32)
        for i, (ab, scale) in enumerate(zip(pairs, scales), start=1):
            if weight in ab:
                a, b = (np.asarray(x, np.float32) for x in ab[weight])
                r = a.shape[-1]
                a_all[:, i, ..., :r] = a  # the rank is A's last axis, B's second (after layers)
                b_all[:, i, :r] = scale * b  # the scale folded into B, in float32
        flat[f"{weight}.a"], flat[f"{weight}.b"] = (jax.device_put(x.astype(out_dtype)) for x in (a_all, b_all))
    return RowAdapters(nest(flat))
