"""The zoo decoder as pure functions of a ModelConfig and a nested dict of parameters, scanning stacked layers.

:func:`forward` is the training forward pass (logits, or the final hidden
states, and MoE router statistics). Beside it are the parts that the cached
forward of :mod:`zoo.model.decode` runs as well: the embedding, one decoder layer
around its attention (:func:`decoder_layer`) and the output head; both scan
their stacks of layers with :mod:`zoo.model.layer_scan`. :class:`Decoder` is a
thin Flax NNX module over the same parameters (``nnx.Param`` with logical
axes) whose call runs the jitted :func:`forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.errors import UserError
from zoo.layers.attention import attend as attend_heads
from zoo.layers.attention import attention, head_major, mla_attention, output_projection, qkv_heads
from zoo.layers.blocks import ACTIVATIONS, dense, rms_norm, soft_cap
from zoo.layers.linear_attention import linear_attention
from zoo.layers.mlp import mlp
from zoo.layers.moe import aux_losses, moe_mlp, parallel_moe_block
from zoo.lora.projections import LayerLora, LoraDropout
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.context import check_layers_split
from zoo.model.layer_layout import (
    is_kv_shared,
    kind_config,
    kind_stack_slice,
    layer_output,
    layer_weights,
    split_by_kind,
    stack_kinds,
    store_layers,
)
from zoo.model.layer_scan import Segment, scan_segments, stack_slice
from zoo.model.masks import chunk_ids, kind_chunk, kind_window, visibility
from zoo.model.mrope import mrope_positions
from zoo.model.multimodal import (
    blocks_of_kind,
    deepstack_runs,
    deepstack_slice,
    embed_images,
    image_blocks,
    text_ids,
)
from zoo.model.params import flatten, init_params, nest, param_specs
from zoo.model.per_layer_inputs import add_per_layer_input, per_layer_inputs
from zoo.model.rope import layer_query_scale, layer_rope, query_temperature, rope_flags, rope_tables_by_kind
from zoo.model.sharding import batch_sharded
from zoo.model.vision import VisionInputs


def norm(cfg: ModelConfig, x: jax.Array, w: jax.Array) -> jax.Array:
    """RMSNorm of x by weight w with the model's epsilon and weight offset."""
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)


def embed_tokens(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """The input embeddings [batch, seq, hidden] of int tokens (scaled by sqrt(hidden) where the family does)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale:
        # transformers casts the normalizer to the embedding dtype first.
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)
    return x


def output_logits(cfg: ModelConfig, params: dict[str, Any], h: jax.Array) -> jax.Array:
    """Float32 logits [..., vocab] of final normed hidden states h [..., hidden] (soft-capped where configured)."""
    return soft_cap(dense(h, head_weight(cfg, params), jnp.float32), cfg.final_softcap)


def decoder_layer(cfg: ModelConfig, x: jax.Array, p: dict, attend: Callable[[jax.Array], tuple[jax.Array, Any]],
                  moe: bool, valid: jax.Array, lora: LayerLora | None = None,
                  per_layer: jax.Array | None = None,
                  deepstack: jax.Array | None = None) -> tuple[jax.Array, Any, dict]:
    """One decoder layer: x + attention, then x + MLP (each output post-normed where the family does).

    ``attend(x)`` is the layer's attention, returning (output, anything else:
    the cached forward's new keys/values), so the training and the cached
    forward share everything around it. ``moe`` picks :func:`zoo.layers.moe.moe_mlp`
    (``valid`` [batch, seq] marks the tokens its statistics count) over the
    dense :func:`zoo.layers.mlp.mlp`; ``lora`` is this layer's LoRA (adapters,
    scale, dropout; None: none). Gemma 4: ``cfg.parallel_moe`` runs
    :func:`zoo.layers.moe.parallel_moe_block` (dense MLP and experts side by side);
    ``per_layer`` [batch, seq, width] is this layer's per-layer input
    (:mod:`zoo.model.per_layer_inputs`), added after the MLP; ``cfg.layer_scalars``
    then scales the layer's output. Qwen3-VL: ``deepstack`` [batch, seq, hidden] (this layer's DeepStack level,
    zero off the image tokens: :func:`zoo.model.multimodal.embed_images`) is added to the output.
    Returns (x, attend's extra, router statistics; {} when dense).
    """
    x = batch_sharded(x)  # the residual stream keeps the batch split (zoo.model.sharding.batch_sharded)
    h, extra = attend(x)
    if cfg.post_norms:
        h = norm(cfg, h, p["post_attn_norm"])
    x = batch_sharded(x + h)
    stats: dict = {}
    if moe and cfg.parallel_moe:
        h, stats = parallel_moe_block(x, p, cfg, valid, lora=lora)
    elif moe:
        h, stats = moe_mlp(norm(cfg, x, p["mlp_norm"]), p, cfg, valid, lora=lora)
    else:  # without pre-norms (OLMo 2/3) the MLP reads x itself
        h = mlp(x, p, cfg, norm_w=p.get("mlp_norm"), lora=lora)
    if cfg.post_norms:
        h = norm(cfg, h, p["post_mlp_norm"])
    x = batch_sharded(x + h)
    if per_layer is not None:
        x = add_per_layer_input(cfg, x, p, per_layer)
    if cfg.layer_scalars:
        x = x * p["layer_scalar"].astype(x.dtype)
    if deepstack is not None:
        x = batch_sharded(x + deepstack.astype(x.dtype))
    return x, extra, stats


@overload
def forward(
    cfg: ModelConfig,
    params: dict[str, Any] | Weights,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    return_aux: Literal[False] = False,
    remat: str = "none",
    return_hidden: bool = False,
    prefix_ids: jax.Array | None = None,
    max_segments: int | None = None,
    vision: VisionInputs | None = None,
) -> jax.Array: ...


@overload
def forward(
    cfg: ModelConfig,
    params: dict[str, Any] | Weights,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    return_aux: Literal[True] = ...,
    remat: str = "none",
    return_hidden: bool = False,
    prefix_ids: jax.Array | None = None,
    max_segments: int | None = None,
    vision: VisionInputs | None = None,
) -> tuple[jax.Array, dict]: ...


@overload
def forward(
    cfg: ModelConfig,
    params: dict[str, Any] | Weights,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    return_aux: bool = ...,
    remat: str = "none",
    return_hidden: bool = False,
    prefix_ids: jax.Array | None = None,
    max_segments: int | None = None,
    vision: VisionInputs | None = None,
) -> jax.Array | tuple[jax.Array, dict]: ...


def forward(cfg: ModelConfig, params: dict[str, Any] | Weights, tokens: jax.Array, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None, return_aux: bool = False, remat: str = "none",
            return_hidden: bool = False, prefix_ids: jax.Array | None = None,
            max_segments: int | None = None, vision: VisionInputs | None = None) -> jax.Array | tuple[jax.Array, dict]:
    """Logits [batch, seq, vocab] (float32) of the decoder for int tokens [batch, seq].

    ``segment_ids`` marks packed documents (attention never crosses a change
    of id; id 0 is padding); ``positions`` restart at each document. Both
    default to one document per row. ``max_segments`` (static) bounds the
    documents a row of ``segment_ids`` holds (None: no bound known), which
    lets cuDNN's kernel take packed rows without a mask (:mod:`zoo.kernels.choice`). With ``return_aux`` (MoE models) it also
    returns the router losses and statistics of :func:`zoo.layers.moe.aux_losses`.
    ``remat`` trades compute for memory in training: "full" recomputes each
    layer in the backward pass, "save_dots" keeps only the weight matmuls'
    outputs (attention scores and elementwise work are recomputed); "offload"
    keeps the layers' inputs and their attention projections' outputs in the
    host's memory instead of the device's and recomputes the MLP, as MaxText
    runs Llama-3.1-8B on v6e (:data:`zoo.model.layer_scan.REMAT_POLICIES`).

    ``params`` is the base alone, or :class:`zoo.lora.weights.Weights`: the
    base with LoRA adapters (a tree keyed like the base, see
    :func:`zoo.lora.params.init_lora`), each adapted projection adding
    ``scale * (x @ A) @ B`` (the scale from :func:`zoo.lora.params.lora_scale`)
    beside its base matmul. The adapters are scanned with their layers. With
    ``rows`` each batch row has its own adapter (:mod:`zoo.lora.rows`; no dropout).

    The weights' dropout rate (a Python float, so static under jit) with their
    ``rng`` key applies LoRA dropout, for training: each adapter reads
    ``dropout(x)`` (every element of every token kept with probability
    1 - p and scaled by 1/(1 - p), a fresh mask per adapted projection and
    layer) while its base weight reads x. Without the key, or with p = 0,
    no dropout: the forward pass is the plain one (as for evaluation).

    With ``return_hidden`` it returns the final normed hidden states
    [batch, seq, hidden] in place of the logits (the head is then applied by
    the caller, e.g. :func:`zoo.model.loss.next_token_nll_sum` with
    :func:`head_weight`), so no [tokens, vocab] array need exist.

    ``prefix_ids`` [batch, seq] name, per token, one more segment whose
    earlier tokens it attends to (a shared prefix; see
    :func:`zoo.model.masks.attention_mask`); not for sliding-window models.

    Under a mesh with a ``context`` axis over 1 (``jax.set_mesh``) the activations' sequence is split over it
    and attention gathers the keys (:mod:`zoo.model.context`); t must divide by its size.

    ``vision`` (a vision-language model's images as patches, :class:`zoo.model.vision.VisionInputs`) puts each
    image token's feature in place of its embedding (:func:`zoo.model.multimodal.embed_images`), and Qwen3-VL's
    DeepStack levels to the first layers' outputs. A model with multimodal RoPE (Qwen2.5-VL, Qwen3-VL) takes
    ``positions`` [3, batch, seq] as they are, or turns 1-D ones into them with the images
    (:func:`zoo.model.mrope.mrope_positions`).
    """
    w = Weights.wrap(params)
    base: dict[str, Any] = w.base
    lora, lora_dropout = w.adapters, w.dropout
    scale: float | jax.Array = 1.0 if w.scale is None else w.scale  # read only with adapters
    drop_keys = _dropout_keys(cfg, lora, lora_dropout, w.rng)
    b, t = tokens.shape
    if segment_ids is None:
        segment_ids, max_segments = jnp.ones((b, t), jnp.int32), 1
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if vision is not None and cfg.rope.mrope_section and positions.ndim == 2:  # Qwen2.5-VL: (time, row, column)
        positions = mrope_positions(cfg.vision, tokens, positions, vision,  # type: ignore[arg-type]
                                    segment_ids, prefix_ids)
    ropes = rope_tables_by_kind(cfg, positions)
    # What each layer kind's queries see, from the segment ids: no kernel gets a [b, 1, t, t] mask built here
    # (zoo.model.masks.Visibility; zoo.kernels.choice).
    # Rows with images: Gemma 3's image tokens attend within their image both ways (zoo.model.multimodal).
    blocks, ahead = image_blocks(cfg, tokens) if vision is not None else (None, 0)
    seen = {kind: visibility(segment_ids, kind_window(cfg, kind), prefix_ids, max_segments,
                             blocks_of_kind(cfg, kind, blocks), ahead, chunk_ids(kind_chunk(cfg, kind), positions))
            for kind in ropes}
    valid = segment_ids != 0
    ids = tokens if vision is None else text_ids(cfg, tokens)
    x = embed_tokens(cfg, base, ids)
    deep = None  # Qwen3-VL's DeepStack levels [levels, b, t, hidden], scanned with the first layers
    if vision is not None:
        x, deep = embed_images(cfg, w, tokens, x, vision, remat)
    # Gemma 4: each layer's per-layer input [layers, b, t, width], scanned with the layers' weights: its token
    # part reads an image token as the padding token (transformers' llm_input_ids), its projection the
    # embeddings with the images in place.
    ple = per_layer_inputs(cfg, base, ids, x) if cfg.per_layer_input_size else None
    shared: dict[str, tuple[jax.Array, jax.Array]] = {}  # kind -> the keys/values the KV-shared layers reuse
    # No context parallelism over linear-attention layers, checked here too: set-up's check_context sees only the
    # trained model, not the others a run traces on its mesh (GKD's teacher, GRPO's reward models) or a caller's own
    check_layers_split(cfg.kinds)
    if "linear" in cfg.kinds and (prefix_ids is not None or blocks is not None):
        raise UserError("linear-attention layers (Qwen3-Next) run on packed documents only: no shared prefixes "
                        "(DPO's shared prompts: set dpo.share_prompt false) and no image blocks")
    layer = _training_layer(cfg, ropes, seen, valid, scale, lora_dropout, shared, w.rows,
                            query_temperature(cfg, positions), segment_ids)
    x, layer_stats = _run_stacks(cfg, base, x, layer, lora, drop_keys, ple, remat, shared, deep)
    x = norm(cfg, x, base["final_norm"])
    logits = x if return_hidden else output_logits(cfg, base, x)
    if not return_aux:
        return logits
    if not layer_stats:
        return logits, {}
    stats = jax.tree.map(lambda *a: jnp.concatenate(a), *layer_stats)
    return logits, aux_losses(stats, cfg)


def _training_layer(cfg: ModelConfig, ropes: dict[str, tuple[jax.Array, jax.Array]], seen: dict[str, Any],
                    valid: jax.Array, scale: float | jax.Array, lora_dropout: float | jax.Array,
                    shared: dict[str, tuple[jax.Array, jax.Array]],
                    rows: bool = False, temperature: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> Callable[..., tuple[jax.Array, Any]]:
    """The training forward's layer as :func:`_run_stacks` scans it: ``layer(x, inputs, kind, moe, prefix)``.

    ``inputs`` are one layer's (weights, adapters, dropout key, NoPE flag, per-layer input, DeepStack level);
    ``ropes`` and
    ``seen`` the rope tables and visibility by layer kind. Gemma 4's KV-shared layers read their keys/values
    from ``shared``, which :func:`_run_stacks` fills as the storing layers' stack is done; a storing layer's
    output then carries its keys/values beside its router statistics. ``rows``: the adapters are per batch row.
    ``temperature`` [b, t]: Llama 4's query temperature of the NoPE layers (:func:`zoo.model.rope.query_temperature`).
    ``segment_ids`` [b, t]: the packed documents, read by Qwen3-Next's linear layers (:mod:`zoo.layers.linear_attention`).
    """
    sharing = cfg.kv_shared_layers > 0

    def layer(x: jax.Array, inputs: tuple, kind: str, moe: bool, prefix: str) -> tuple[jax.Array, Any]:
        p, lp, key, rope_on, pli, deep = inputs
        drop = None if key is None else LoraDropout(lora_dropout, key)
        lora = None if lp is None else LayerLora(lp, scale, drop, rows)
        kcfg = kind_config(cfg, kind)

        def attend(x: jax.Array) -> tuple[jax.Array, Any]:
            if kind == "linear":  # Qwen3-Next's Gated DeltaNet: no RoPE, no mask, a state over each document
                assert segment_ids is not None, "linear layers read the segment ids"
                return linear_attention(x, p, cfg, segment_ids, p["attn_norm"], lora)[0], None
            if cfg.mla:  # MLA has no adapters (zoo.lora.params)
                return mla_attention(norm(cfg, x, p["attn_norm"]), p, *ropes[kind], seen[kind], cfg), None
            # Without pre-norms (OLMo 2/3) attention reads x itself; a NoPE layer's q and k are not rotated.
            cos, sin = layer_rope(ropes[kind], rope_on)
            if sharing:  # Gemma 4: a layer's keys/values go out to the KV-shared layers, which take them in
                reuse = shared[kind] if is_kv_shared(cfg, prefix) else None
                q, k, v = qkv_heads(x, p, cos, sin, kcfg, p.get("attn_norm"), lora, reuse)
                out = attend_heads(*head_major(q, k, v), seen[kind], kcfg, p["sinks"] if cfg.attn_sinks else None)
                return output_projection(out, p, kcfg, lora), None if reuse is not None else (k, v)
            return attention(x, p, cos, sin, seen[kind], kcfg, norm_w=p.get("attn_norm"), lora=lora, rope_on=rope_on,
                             q_scale=layer_query_scale(temperature, rope_on)), None

        x, kv, stats = decoder_layer(cfg, x, p, attend, moe, valid, lora, pli, deep)
        return x, ((stats, kv) if sharing else stats)

    return layer


def _run_stacks(cfg: ModelConfig, params: dict[str, Any], x: jax.Array, layer: Callable[..., tuple[jax.Array, Any]],
                lora: dict[str, Any] | None, drop_keys: jax.Array | None, ple: jax.Array | None, remat: str,
                shared: dict[str, tuple[jax.Array, jax.Array]],
                deep: jax.Array | None = None) -> tuple[jax.Array, list[dict]]:
    """x through every run of :attr:`ModelConfig.layer_runs`, each with :func:`zoo.model.layer_scan.scan_segments`; returns x and the
    MoE layers' router statistics in layer order (one tree per segment). Fills ``shared`` (Gemma 4's stored
    keys/values) as the layers that store them are done. ``deep``: Qwen3-VL's DeepStack levels, scanned with the
    first layers (their runs split off: :func:`zoo.model.multimodal.deepstack_runs`)."""
    sharing = cfg.kv_shared_layers > 0
    layer_stats: list[dict] = []
    runs = cfg.layer_runs if deep is None else deepstack_runs(cfg.layer_runs, deep.shape[0])
    for prefix, start, stop, moe, first in runs:
        # The LoRA adapters (stacked like their weights) and the layers' dropout keys are sliced and
        # scanned with the weights, so the scan body never indexes a stack.
        adapters = (lora or {}).get(prefix)
        keys = None if drop_keys is None or adapters is None else drop_keys[start:stop]
        kinds = cfg.kinds[start:stop]
        weights = (params[prefix], adapters)
        if split_by_kind(cfg):  # Gemma 4, Qwen3-Next: weights stacked by kind (zoo.model.layer_layout)
            weights = kind_stack_slice(cfg, weights, stack_kinds(cfg, prefix), first, stop - start)
        else:
            weights = stack_slice(weights, first, stop - start)
        stacked = weights + (keys, rope_flags(cfg, start, stop), None if ple is None else ple[start:stop],
                             deepstack_slice(deep, start, stop))

        def inputs(seg: Segment, j: int, stacked: tuple = stacked, kinds: tuple[str, ...] = kinds) -> tuple:
            if not split_by_kind(cfg):
                return seg.at(j, stacked)
            # Gemma 4, Qwen3-Next: a block position's weights are a strided view of its kind's stack.
            w, a, *rest = stacked
            return (layer_weights(cfg, w, kinds, seg, j), None if a is None else layer_weights(cfg, a, kinds, seg, j),
                    *seg.at(j, tuple(rest)))

        x, done = scan_segments(x, kinds, inputs, partial(layer, moe=moe, prefix=prefix), remat,
                                stack=moe and not sharing)
        if sharing:
            # Per-layer outputs come per block position (the kinds' keys differ in shape): the stored layers'
            # keys/values, and the statistics in layer order.
            shared.update({kind: layer_output(done, i - start, False)[1] for kind, i in store_layers(cfg).items()
                           if start <= i < stop})
            if moe:
                layer_stats.extend(jax.tree.map(lambda *a: jnp.stack(a, 1).reshape((-1,) + a[0].shape[1:]),
                                                *[o[0] for o in outs]) for _, outs in done)
        elif moe:
            # Each segment's statistics are [repeats, period, ...]: layer order once flattened.
            layer_stats.extend(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), ys) for _, ys in done)
    return x, layer_stats


def stored_head(cfg: ModelConfig, params: dict[str, Any]) -> tuple[jax.Array, bool]:
    """(the output head as stored, whether it is vocab-major): a tied embedding [vocab, hidden] as it is,
    for losses that read it in place (``vocab_major``), else ``lm_head`` [hidden, vocab]."""
    tied = cfg.tie_word_embeddings
    return (params["embed"] if tied else params["lm_head"]), tied


def head_weight(cfg: ModelConfig, params: dict[str, Any]) -> jax.Array:
    """The output head [hidden, vocab]: the transposed embedding when tied, else ``lm_head``."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def _dropout_keys(cfg: ModelConfig, lora: dict | None, rate: float | jax.Array,
                  rng: jax.Array | None) -> jax.Array | None:
    """One LoRA-dropout key per layer [num_layers], or None when no dropout applies.

    None without adapters, without a key, or with a rate of exactly 0: the
    forward pass then keeps the adapters fused with their base matmuls. A
    traced rate cannot be checked, so it always takes the dropout path.
    """
    if lora is None or rng is None:
        return None
    if isinstance(rate, (int, float)) and rate <= 0:
        return None
    return jax.random.split(rng, cfg.num_layers)


class Decoder(nnx.Module):
    """A decoder-only language model of any zoo family.

    Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata,
    which :mod:`zoo.model.sharding` maps to mesh axes.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, Any] | None = None, *, rngs: nnx.Rngs | None = None,
                 dtype: Any = jnp.float32):
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.cfg = cfg
        specs = param_specs(cfg)
        if params is None:
            params = init_params(cfg, (rngs or nnx.Rngs(0)).params(), dtype)
        flat = flatten(params)
        missing = set(specs) - set(flat)
        if missing:
            raise ValueError(f"missing parameters: {sorted(missing)}")
        tree = nest({p: nnx.Param(flat[p], logical_axes=specs[p].axes) for p in specs})
        self.embed = tree.pop("embed")
        self.final_norm = tree.pop("final_norm")
        self.layers = nnx.Dict(tree.pop("layers"))
        if "dense_layers" in tree:
            self.dense_layers = nnx.Dict(tree.pop("dense_layers"))
        if "lm_head" in tree:
            self.lm_head = tree.pop("lm_head")
        if "shared_layers" in tree:  # Gemma 4's KV-shared layers
            self.shared_layers = nnx.Dict(tree.pop("shared_layers"))
        for name in ("ple_embed", "ple_model_proj", "ple_proj_norm"):  # Gemma 4's per-layer inputs
            if name in tree:
                setattr(self, name, tree.pop(name))
        for name in ("vision", "projector"):  # a vision-language model's tower and connector
            if name in tree:
                setattr(self, name, _nested_dict(tree.pop(name)))

    def param_dict(self) -> dict[str, Any]:
        """Parameters as a plain nested dict of arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, return_aux: bool = False, vision: VisionInputs | None = None):
        """Logits [batch, seq, vocab] for int32 tokens [batch, seq] (and router aux with ``return_aux``); a
        vision-language model's images come as ``vision``."""
        return _jit_forward(self.cfg, self.param_dict(), tokens, segment_ids, positions, return_aux, vision=vision)


def _nested_dict(tree: dict[str, Any]) -> nnx.Dict:
    """A nested dict of parameters as nested ``nnx.Dict``s (the vision tower's ``layers`` sit one level down)."""
    return nnx.Dict({k: _nested_dict(v) if isinstance(v, dict) else v for k, v in tree.items()})


_jit_forward = jax.jit(forward, static_argnums=(0, 5))
