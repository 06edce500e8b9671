"""Fused Hugging Face tensors: one tensor of the checkpoint holding several zoo parameters, split while converting
and joined back bit for bit while exporting.

A :class:`Fusion` is data: the fused tensor's name, the names its parts go by in the conversion tables, the axis
they share, and how they fill it, in blocks one after another (Phi-3/Phi-4's ``qkv_proj`` [q; k; v] and
``gate_up_proj`` [gate; up] rows) or interleaved one index at a time (gpt-oss's experts' ``gate_up_proj``
[experts, embed, 2 x mlp], gate in the even columns, up in the odd; Qwen3-VL-MoE's experts' ``gate_up_proj``, gate then
up, in either of its two orders: :func:`with_expert_layout`). Converting, :class:`SplitReader` stands in
front of the checkpoint's reader and shows each fused tensor as its parts, under the names the family's table
reads (``q_proj``, ``mlp.experts.gate_proj``, ...). Exporting, :func:`fuse_planned` replaces the planned part
tensors by their fused tensor, and :func:`join` builds it from its parts, one layer at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from zoo.errors import UserError
from zoo.model.config import ModelConfig


@dataclass(frozen=True)
class Fusion:
    """One fused tensor of a layer: its name and its parts' names (suffixes after the layer's prefix).

    ``sizes``: how long each part is along ``axis`` (``qkv``: q, k and v heads * head_dim; ``mlp``: the MLP
    width each; ``expert_mlp``: the routed experts' width each; Qwen3-Next's, per group: ``qkvz`` a key head's
    q, k and its value heads' v and z, ``ba`` its value heads' b and a, ``q_gate`` an attention head's q and
    gate). ``interleaved``: the parts alternate index by index along ``axis`` instead of following one another
    in blocks. ``groups``: the ModelConfig field counting groups (None: one): the axis is that many groups one
    after another, each holding the parts in blocks (Qwen3-Next's in_proj_qkvz per key head; axis 0 only).
    ``when``: a ModelConfig flag (``!flag`` negated) the fusion holds under, as the tables' rules have (None:
    always).
    """

    fused: str
    parts: tuple[str, ...]
    sizes: str
    axis: int = 0
    interleaved: bool = False
    when: str | None = None
    groups: str | None = None

    def applies(self, cfg: ModelConfig) -> bool:
        """Whether a checkpoint of config ``cfg`` fuses its tensors this way."""
        if self.when is None:
            return True
        return bool(getattr(cfg, self.when.lstrip("!"))) != self.when.startswith("!")

    def group_count(self, cfg: ModelConfig) -> int:
        """How many groups the fused axis holds (1 unless ``groups``)."""
        return 1 if self.groups is None else int(getattr(cfg, self.groups))

    def part_sizes(self, cfg: ModelConfig) -> tuple[int, ...]:
        """Each part's length along ``axis`` (within one group where ``groups``), in order."""
        if self.sizes in ("qkvz", "ba"):
            r = cfg.linear_value_heads // cfg.linear_key_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            return (dk, dk, r * dv, r * dv) if self.sizes == "qkvz" else (r, r)
        if self.sizes == "q_gate":
            return cfg.head_dim, cfg.head_dim
        if self.sizes == "lin_qkv":
            qk = cfg.linear_key_heads * cfg.linear_key_head_dim
            return qk, qk, cfg.linear_value_heads * cfg.linear_value_head_dim
        if self.sizes == "qkv":
            d = cfg.head_dim
            return cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d
        width = cfg.moe_intermediate_size if self.sizes == "expert_mlp" else cfg.intermediate_size
        return (width,) * len(self.parts)

    def selections(self, sizes: tuple[int, ...]) -> list[tuple[Any, ...]]:
        """Each part's index into the fused tensor (its parts ``sizes`` long along ``axis``)."""
        lead = (Ellipsis,) if self.axis < 0 else (slice(None),) * self.axis
        if self.interleaved:
            n = len(self.parts)
            return [(*lead, slice(k, None, n)) for k in range(n)]
        ends = np.cumsum((0, *sizes))
        return [(*lead, slice(int(a), int(b))) for a, b in zip(ends[:-1], ends[1:])]

    def check(self, shape: tuple[int, ...], cfg: ModelConfig, name: str, where: str) -> tuple[int, ...]:
        """The parts' sizes when fused tensor ``name`` has the shape the config implies; else a one-line UserError."""
        sizes, g = self.part_sizes(cfg), self.group_count(cfg)
        if not shape or shape[self.axis] != g * sum(sizes):
            what = "rows" if self.axis == 0 else "columns"
            groups = f"{g} x " if g > 1 else ""
            raise UserError(f"{where}: tensor {name!r} has shape {tuple(shape)} but the config implies "
                            f"{g * sum(sizes)} {what} ({groups}{' + '.join(map(str, sizes))})")
        return sizes


# family -> its fused tensors (a line per family; the tables name the parts).
_QWEN3_5 = (Fusion("linear_attn.in_proj_qkv.weight", tuple(f"linear_attn.in_proj_qkv_{n}.weight" for n in "qkv"),
                   "lin_qkv"),
            Fusion("self_attn.q_proj.weight", ("self_attn.q_proj_query.weight", "self_attn.q_proj_gate.weight"),
                   "q_gate", groups="num_heads"))
FUSIONS: dict[str, tuple[Fusion, ...]] = {
    "phi3": (
        Fusion("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"), "qkv"),
        Fusion("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp"),
    ),
    # transformers' GptOssExperts: [experts, embed, 2 x mlp] and [experts, 2 x mlp], gate and up column by column.
    "gpt_oss": (
        Fusion("mlp.experts.gate_up_proj", ("mlp.experts.gate_proj", "mlp.experts.up_proj"), "expert_mlp",
               axis=-1, interleaved=True),
        Fusion("mlp.experts.gate_up_proj_bias", ("mlp.experts.gate_proj_bias", "mlp.experts.up_proj_bias"),
               "expert_mlp", axis=-1, interleaved=True),
    ),
    # Qwen3-VL-MoE's experts: gate then up, in blocks, along the last axis as the Hub's files hold them [experts,
    # embed, 2 x mlp]; along the middle one as transformers 5 saves them [experts, 2 x mlp, embed] (its Linear order).
    "qwen3_vl_moe": (
        Fusion("mlp.experts.gate_up_proj", ("mlp.experts.gate_proj", "mlp.experts.up_proj"), "expert_mlp",
               axis=-1, when="!hf_experts_out_in"),
        Fusion("mlp.experts.gate_up_proj", ("mlp.experts.gate_proj", "mlp.experts.up_proj"), "expert_mlp",
               axis=1, when="hf_experts_out_in"),
    ),
    # Qwen3-Next: per key head [q, k, its value heads' v, z] rows and [b, a] rows; per attention head [q, gate] rows.
    "qwen3_next": (
        Fusion("linear_attn.in_proj_qkvz.weight", tuple(f"linear_attn.in_proj_{n}.weight" for n in "qkvz"), "qkvz",
               groups="linear_key_heads"),
        Fusion("linear_attn.in_proj_ba.weight", ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
               "ba", groups="linear_key_heads"),
        Fusion("self_attn.q_proj.weight", ("self_attn.q_proj_query.weight", "self_attn.q_proj_gate.weight"),
               "q_gate", groups="num_heads"),
        # llama.cpp's qwen3next files: attn_q as q_proj; attn_qkv the linear layers' q, k, v rows in blocks (its
        # converter takes them out of in_proj_qkvz's groups, z going to attn_gate); ssm_ba as in_proj_ba.
        Fusion("attn_q.weight", ("attn_q_query.weight", "attn_q_gate.weight"), "q_gate", groups="num_heads"),
        Fusion("attn_qkv.weight", ("attn_qkv_q.weight", "attn_qkv_k.weight", "attn_qkv_v.weight"), "lin_qkv"),
        Fusion("ssm_ba.weight", ("ssm_ba_b.weight", "ssm_ba_a.weight"), "ba", groups="linear_key_heads"),
    ),
    # Qwen3.5 (dense and MoE): in_proj_qkv's q, k and v rows in blocks; q_proj as Qwen3-Next's.
    "qwen3_5": _QWEN3_5,
    # ... and Qwen3.5-MoE's experts as the Hub's files hold them: [experts, 2 x mlp, embed], gate then up in blocks
    # (ModelConfig.hf_experts_out_in; one expert at a time as transformers' save_pretrained writes them otherwise).
    "qwen3_5_moe": (*_QWEN3_5,
                    Fusion("mlp.experts.gate_up_proj", ("mlp.experts.gate_proj", "mlp.experts.up_proj"), "expert_mlp",
                           axis=1, when="hf_experts_out_in")),
    # Llama 4's experts: [experts, embed, 2 x mlp], gate then up in blocks along the last axis.
    "llama4": (Fusion("feed_forward.experts.gate_up_proj", ("feed_forward.experts.gate_proj",
                                                            "feed_forward.experts.up_proj"), "expert_mlp", axis=-1),),
}
# families whose fused experts come in either order (ModelConfig.hf_experts_out_in; Qwen3.5-MoE's: fused or one by
# one): the fused tensor that says which
EXPERT_ORDER = {"qwen3_vl_moe": "mlp.experts.gate_up_proj", "qwen3_5_moe": "mlp.experts.gate_up_proj"}


def fusions(cfg: ModelConfig) -> tuple[Fusion, ...]:
    """The fused tensors of a checkpoint of config ``cfg``."""
    return tuple(f for f in FUSIONS.get(cfg.family, ()) if f.applies(cfg))


def with_expert_layout(cfg: ModelConfig, reader: Any) -> ModelConfig:
    """``cfg`` with the order of its fused experts' axes as the checkpoint ``reader`` holds them (``cfg`` itself for
    other families). transformers reads either (its Transpose with check_dims): the [experts, 2 x mlp, embed] of
    its own save_pretrained as it is, any other shape (the Hub's [experts, embed, 2 x mlp]) transposed; so does
    this, deciding on the first layer's tensor (a wrong shape anywhere is then the conversion's shape error)."""
    fused = EXPERT_ORDER.get(cfg.family)
    name = next((n for n in reader.names() if fused and _prefix(n, fused) is not None), None)
    if name is None:
        return cfg
    out_in = tuple(reader.shape(name)) == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    return dataclasses.replace(cfg, hf_experts_out_in=out_in)


def _prefix(name: str, suffix: str) -> str | None:
    """``name`` minus ``suffix`` (a whole dotted component), or None when ``name`` does not end with it."""
    if name == suffix:
        return ""
    return name[: len(name) - len(suffix)] if name.endswith("." + suffix) else None


def split(x: np.ndarray, fusion: Fusion, sizes: tuple[int, ...], position: int) -> np.ndarray:
    """Part ``position`` of fused tensor ``x`` (copied, contiguous); ``sizes`` per group where ``fusion.groups``."""
    if fusion.groups is not None:  # [groups x (parts in blocks), ...] rows: each group's block of the part
        g = x.shape[0] // sum(sizes)
        part = x.reshape(g, sum(sizes), *x.shape[1:])[:, fusion.selections(sizes)[position][0]]
        return np.ascontiguousarray(part.reshape(g * sizes[position], *x.shape[1:]))
    return np.ascontiguousarray(x[fusion.selections(sizes)[position]])


def join(fusion: Fusion, parts: list[np.ndarray], dtype: np.dtype, groups: int = 1) -> np.ndarray:
    """The fused tensor of ``parts`` (each in the HF layout, in ``fusion.parts`` order), as ``dtype``; ``groups``:
    :meth:`Fusion.group_count` where ``fusion.groups``."""
    if fusion.groups is not None:
        blocks = [p.reshape(groups, p.shape[0] // groups, *p.shape[1:]) for p in parts]
        return np.concatenate(blocks, axis=1).reshape(-1, *parts[0].shape[1:]).astype(dtype)
    axis = fusion.axis % parts[0].ndim
    sizes = tuple(p.shape[axis] for p in parts)
    shape = (*parts[0].shape[:axis], sum(sizes), *parts[0].shape[axis + 1:])
    out = np.empty(shape, dtype)
    for sel, p in zip(fusion.selections(sizes), parts, strict=True):
        out[sel] = p
    return out


class SplitReader:
    """A tensor reader (:class:`convert.readers.TensorReader`) showing each fused tensor as its parts."""

    def __init__(self, inner: Any, cfg: ModelConfig, description: str):
        self.inner, self.cfg, self.description = inner, cfg, description
        # part name -> (fused name, its Fusion, the parts' sizes, the part's position)
        self.parts: dict[str, tuple[str, Fusion, tuple[int, ...], int]] = {}
        for name in inner.names():
            for f in fusions(cfg):
                prefix = _prefix(name, f.fused)
                if prefix is not None:
                    sizes = f.check(tuple(inner.shape(name)), cfg, name, description)
                    for k, part in enumerate(f.parts):
                        self.parts[prefix + part] = (name, f, sizes, k)

    def names(self) -> list[str]:
        """The inner reader's tensors, each fused one replaced by its parts."""
        fused = {v[0] for v in self.parts.values()}
        return [n for n in self.inner.names() if n not in fused] + list(self.parts)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (a part's: its share of the fused tensor)."""
        if name not in self.parts:
            return tuple(self.inner.shape(name))
        fused, f, sizes, k = self.parts[name]
        shape = list(self.inner.shape(fused))
        shape[f.axis] = sizes[k] * shape[f.axis] // sum(sizes)  # a part of each group where f.groups
        return tuple(shape)

    def dtype(self, name: str) -> np.dtype:
        """A tensor's dtype (a part's: the fused tensor's)."""
        return self.inner.dtype(self.parts[name][0] if name in self.parts else name)

    def get(self, name: str) -> np.ndarray:
        """A tensor (a part: its share of the fused tensor, copied)."""
        if name not in self.parts:
            return self.inner.get(name)
        fused, f, sizes, k = self.parts[name]
        return split(self.inner.get(fused), f, sizes, k)


def fusion_of(cfg: ModelConfig, hf_name: str) -> tuple[str, Fusion, int] | None:
    """(the fused tensor's name, its :class:`Fusion`, the part's position) for HF tensor ``hf_name`` when it is
    a part of a fused tensor in ``cfg``'s family; None when it is a tensor of its own."""
    for f in fusions(cfg):
        for k, part in enumerate(f.parts):
            prefix = _prefix(hf_name, part)
            if prefix is not None:
                return prefix + f.fused, f, k
    return None


def fused_named(cfg: ModelConfig, name: str) -> Fusion:
    """The :class:`Fusion` of fused tensor ``name`` in ``cfg``'s family."""
    return next(f for f in fusions(cfg) if _prefix(name, f.fused) is not None)


def split_fused(reader: Any, cfg: ModelConfig, description: str) -> Any:
    """``reader`` as the conversion tables read it: a :class:`SplitReader` for families with fused tensors."""
    return SplitReader(reader, cfg, description) if cfg.family in FUSIONS else reader


def fuse_planned(cfg: ModelConfig, planned: list) -> list:
    """The export's file tensors: each fused tensor's parts replaced by it, in its first part's place, with its
    parts' (zoo parameter, transform) in ``parts``. ``planned`` are :class:`convert.export.PlannedTensor`."""
    by_name = {t.name: t for t in planned}
    fused: dict[str, Any] = {}  # first part's name -> the fused tensor
    taken: set[str] = set()
    for t in planned:
        found = fusion_of(cfg, t.name)
        if found is None or found[2] != 0:
            continue
        name, f, _ = found
        prefix = name[: len(name) - len(f.fused)]
        if any(prefix + p not in by_name for p in f.parts):
            continue  # not every part planned: the tensors stay apart (no such export today)
        group = [by_name[prefix + p] for p in f.parts]
        if len({g.dtype for g in group}) != 1:
            raise UserError(f"cannot fuse {name}: its parts have dtypes {sorted({g.dtype for g in group})}; "
                            "export with --dtype")
        shape = list(t.shape)
        shape[f.axis] = sum(g.shape[f.axis] for g in group)
        fused[t.name] = dataclasses.replace(t, name=name, shape=tuple(shape),
                                            parts=tuple((g.zoo, g.transform) for g in group))
        taken.update(g.name for g in group)
    return [fused[t.name] if t.name in fused else t for t in planned if t.name in fused or t.name not in taken]
