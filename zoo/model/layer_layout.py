"""Layers whose weights differ in shape by kind or position (Gemma 4): per-kind attention dims, the kind-split
stacks of attention weights, and the KV-shared layers' stack.

Gemma 4's full-attention layers have wider heads (``global_head_dim``) and maybe fewer key/value heads than its
sliding ones, so their attention weights cannot share one stack with the sliding layers': with
``cfg.global_head_dim`` set, each stack of layers keeps the sliding layers' attention weights under their usual
names (``layers.q`` [sliding layers, ...]) and the full layers' under ``global_`` names (``layers.global_q``
[full layers, ...]); every other weight stays stacked over all the stack's layers. A layer at one position of a
repeated block (:class:`zoo.model.layer_scan.Segment`) reads its kind's weights as a strided view
(:class:`zoo.model.layer_scan.Strided`: the scan slices the stack's [repeats, step, ...] reshape, no copy), as the
KV cache's per-kind stacks are read as strided slices (:func:`zoo.model.decode._kind_slice`); a run of a stack's layers
(:attr:`zoo.model.config.ModelConfig.layer_runs`) takes its part of each kind's stack (:func:`kind_stack_slice`).

The last ``cfg.kv_shared_layers`` layers (their own stack, ``shared_layers``:
:attr:`zoo.model.config.ModelConfig.layer_stacks`) have no key/value weights: each
attends with the keys and values of the last earlier layer of its kind (:func:`store_layers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from zoo.model.config import ModelConfig
from zoo.model.layer_scan import Strided

ATTENTION_WEIGHTS = ("q", "k", "v", "o", "q_norm", "k_norm", "attn_gate")
LINEAR = "lin_"  # prefix of a linear-attention layer's weight (Qwen3-Next: stacked over the linear layers only)
GLOBAL = "global_"  # prefix of a full layer's attention weight in a kind-split stack
KV_WEIGHTS = ("k", "v", "k_norm")  # what a KV-shared layer has none of


def kind_config(cfg: ModelConfig, kind: str) -> ModelConfig:
    """``cfg`` with the attention dims of layers of ``kind`` (Gemma 4's full layers: global_head_dim and
    global_kv_heads); ``cfg`` itself for every other model and kind."""
    if kind != "full" or not cfg.global_head_dim:
        return cfg
    return dataclasses.replace(cfg, head_dim=cfg.global_head_dim, num_kv_heads=cfg.global_kv_heads or cfg.num_kv_heads)


def split_name(cfg: ModelConfig, kind: str, name: str) -> str:
    """The stored name of attention weight ``name`` of a layer of ``kind`` (``global_q`` for a full layer's q
    where the kinds are split; ``name`` otherwise)."""
    if cfg.global_head_dim and kind == "full" and name in ATTENTION_WEIGHTS:
        return GLOBAL + name
    return name


def split_by_kind(cfg: ModelConfig) -> bool:
    """Whether some stacked weights hold the layers of one kind only: Gemma 4's full layers' attention, Qwen3-Next's
    linear layers' weights (``lin_``) and its full layers' attention."""
    return bool(cfg.global_head_dim) or "linear" in cfg.kinds


def kind_split(cfg: ModelConfig, name: str) -> str | None:
    """The kind whose layers alone a stacked weight ``name`` (the name inside its stack) holds, or None when it
    is stacked over every layer of its stack."""
    if "linear" in cfg.kinds:  # Qwen3-Next: the linear layers' own weights, and the full layers' attention
        return "linear" if name.startswith(LINEAR) else "full" if name in ATTENTION_WEIGHTS else None
    if not cfg.global_head_dim:
        return None
    if name.startswith(GLOBAL) and name[len(GLOBAL):] in ATTENTION_WEIGHTS:
        return "full"
    return "sliding" if name in ATTENTION_WEIGHTS else None


def is_kv_shared(cfg: ModelConfig, prefix: str) -> bool:
    """Whether the layers of stack ``prefix`` reuse earlier layers' keys and values."""
    return bool(cfg.kv_shared_layers) and prefix == "shared_layers"


def group_specs(cfg: ModelConfig, specs: dict[str, Any], kinds: tuple[str, ...], prefix: str,
                kind_specs: Callable[[ModelConfig, int], dict[str, Any]]) -> dict[str, Any]:
    """One stack's specs (:func:`zoo.model.params._layer_specs`, all stacked over its len(kinds) layers) laid out as
    this module says: the attention weights split by kind, none for keys/values in a KV-shared stack, and the
    KV-shared layers' MLP doubled where ``double_wide_mlp``. ``kind_specs(kind_cfg, n)``: the specs of n dense
    layers of one kind's config (zoo.model.params passes its own, so this module does not import it)."""
    out = dict(specs)
    shared = is_kv_shared(cfg, prefix)
    if shared:
        for name in KV_WEIGHTS:
            out.pop(name, None)
        if cfg.double_wide_mlp:
            F = 2 * cfg.intermediate_size
            for name in ("gate", "up"):
                s = out[name]
                out[name] = dataclasses.replace(s, shape=s.shape[:-1] + (F,))
            s = out["down"]
            out["down"] = dataclasses.replace(s, shape=(s.shape[0], F) + s.shape[2:])
    if "linear" in cfg.kinds:
        for name in list(out):  # a kind's own weight: stacked over that kind's layers (none: not stored)
            owner = kind_split(cfg, name)
            if owner is not None and owner in kinds:
                out[name] = dataclasses.replace(out[name], shape=(kinds.count(owner),) + out[name].shape[1:])
            elif owner is not None:
                del out[name]
        return out
    if not cfg.global_head_dim:
        return out
    for name in ATTENTION_WEIGHTS:
        out.pop(name, None)
    for kind in ("sliding", "full"):
        n = kinds.count(kind)
        own = kind_specs(kind_config(cfg, kind), n)  # the per-kind dims of one kind's layers
        for name in ATTENTION_WEIGHTS:
            if not n or name not in own or (shared and name in KV_WEIGHTS):
                continue
            if name == "v" and kind == "full" and cfg.attention_k_eq_v:
                continue
            out[split_name(cfg, kind, name)] = own[name]
    return out


def stack_kinds(cfg: ModelConfig, prefix: str) -> tuple[str, ...]:
    """The kinds of the layers of stack ``prefix`` (:attr:`zoo.model.config.ModelConfig.layer_stacks`), in order."""
    return next(tuple(cfg.kinds[i] for i in layers) for p, layers, _ in cfg.layer_stacks if p == prefix)


def kind_stack_slice(cfg: ModelConfig, trees: tuple, kinds: tuple[str, ...], first: int, n: int) -> tuple:
    """:func:`zoo.model.layer_scan.stack_slice` of stacks laid out by kind: layers ``first`` to ``first + n`` of a stack
    whose layers have ``kinds``, from each tree of ``trees`` (weights or adapters by name; None stays None): a
    weight of every layer is sliced there, a kind-split one (:func:`kind_split`) at its kind's layers among them."""
    def one(name: str, a: Any) -> Any:
        owner = kind_split(cfg, name)
        lo, hi = (first, first + n) if owner is None else (kinds[:first].count(owner), kinds[:first + n].count(owner))
        return jax.tree.map(lambda x: x if lo == 0 and x.shape[0] == hi else x[lo:hi], a)

    return tuple(None if tree is None else {name: one(name, a) for name, a in tree.items()} for tree in trees)


def layer_weights(cfg: ModelConfig, stack: dict[str, Any], kinds: tuple[str, ...], seg: Any, j: int) -> dict[str, Any]:
    """The weights of the layers at block position j of segment ``seg`` (of a stack whose layers have ``kinds``),
    under the names one layer reads (``q``, not ``global_q``): :meth:`zoo.model.layer_scan.Segment.at` for the weights of
    every layer, the kind's strided view for the kind-split ones."""
    kind = seg.kinds[j]
    # the kind's layers before the segment, and its positions in the block (a strided view, as Segment.at's)
    lo, step, off = kinds[:seg.start].count(kind), seg.kinds.count(kind), seg.kinds[:j].count(kind)
    out = {}
    for name, a in stack.items():
        owner = kind_split(cfg, name)
        if owner is None:
            out[name] = seg.at(j, a)
        elif owner == kind:
            out[name[len(GLOBAL):] if name.startswith(GLOBAL) else name] = (
                jax.tree.map(lambda x: x[lo: lo + seg.repeats], a) if step == 1
                else jax.tree.map(lambda x: Strided(x, lo, seg.repeats, step, off), a))
    return out


def store_layers(cfg: ModelConfig) -> dict[str, int]:
    """kind -> the layer whose keys/values the KV-shared layers of that kind reuse: the last layer of that kind
    before them (transformers' kv_sharing_modes "store")."""
    first = cfg.num_layers - cfg.kv_shared_layers
    kinds = cfg.kinds
    return {kind: max(i for i in range(first) if kinds[i] == kind) for kind in set(kinds[first:])}


def layer_output(done: list, i: int, stacked: bool) -> Any:
    """Layer i's output (i counted within its stack) from :func:`zoo.model.layer_scan.scan_segments`' per-segment outputs."""
    for seg, outs in done:
        if seg.start <= i < seg.stop:
            r, j = divmod(i - seg.start, len(seg.kinds))
            if stacked:
                return jax.tree.map(lambda a: a[r, j], outs)
            return jax.tree.map(lambda a: a[r], outs[j])
    raise ValueError(f"layer {i} is in no segment")
