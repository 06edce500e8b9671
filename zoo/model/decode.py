"""Incremental decoding: a KV cache and a cache-aware forward pass of the zoo decoder.

:func:`forward_cached` runs the same code as :func:`zoo.model.decoder.forward`
(embedding, :func:`zoo.model.decoder.decoder_layer` with its norms and MLP / MoE,
the segment scans of :func:`zoo.model.layer_scan.scan_segments`, the projections into
heads and out of them from :mod:`zoo.layers.attention`, RoPE tables, output head)
on t new tokens per row, attending to what the cache holds plus the new
tokens, and returns the cache with the new keys/values written. What is its
own is the cache: ring slots, masks over them, attention split between the
cached slots and the new tokens (:mod:`zoo.model.cached_attention`), and the writes. Prefill (t = prompt length)
and decoding (t = 1) are the same function.

Every cache is a ring of S slots: position p lives in slot p % S. Full layers
get S = ``max_len``, so nothing wraps while the sequence fits; sliding-window
layers get S = min(sliding_window, max_len), since a query never looks
further back than the window. New tokens attend to the old slots and to each
other (not to the cache after writing), so a chunk longer than the ring still
sees every key its mask allows; only the last S positions are then written.
MLA layers (DeepSeek) cache the normed kv latent and the roped shared key,
and expand them into per-head keys and values at each call.

Keys and values are stored head-major, keys transposed ([.., kv_heads,
head_dim, S]) and values not ([.., kv_heads, S, head_dim]): the layouts in
which the score and value products take their right-hand operand, so that no
step transposes (copies) the cache. The cached slots and the new tokens are
scored separately and share one softmax: the cache is never concatenated with
the new keys. Generation (:mod:`eval.generate`) uses the static shortcuts of
:func:`forward_step`: ``fresh`` (an empty cache: the prompt attends to itself
only, blockwise like the training forward, instead of to max_len empty slots
too), ``view`` (only the first ``view`` slots can be filled: the rest is not
read, so a step's cost follows the filled length, not max_len) and ``last``
(only one position per row goes through the output head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from zoo.layers.linear_attention import linear_attention
from zoo.lora.projections import LayerLora
from zoo.lora.weights import Weights
from zoo.model.cache_io import Written, entry_shapes, gather_pages, rows_states, write_ring
from zoo.model.cached_attention import gqa_attention, mla_attention, new_token_masks, slot_positions
from zoo.model.config import ModelConfig
from zoo.model.decoder import decoder_layer, embed_tokens, norm, output_logits
from zoo.model.layer_layout import (
    is_kv_shared,
    kind_config,
    kind_stack_slice,
    layer_output,
    layer_weights,
    split_by_kind,
    store_layers,
)
from zoo.model.layer_scan import Segment, scan_segments, stack_slice
from zoo.model.longrope import switch_to_long
from zoo.model.masks import kind_chunk, kind_window
from zoo.model.mrope import mrope_positions
from zoo.model.multimodal import (
    blocks_of_kind,
    deepstack_runs,
    deepstack_slice,
    embed_images,
    image_blocks,
    text_ids,
)
from zoo.model.per_layer_inputs import per_layer_inputs
from zoo.model.rope import layer_query_scale, layer_rope, query_temperature, rope_flags, rope_tables_by_kind
from zoo.model.vision import VisionInputs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Cache:
    """Per-layer keys/values and each row's length.

    ``layers[prefix][kind]`` holds, for the layers of that parameter stack
    (``layers`` / ``dense_layers``) and kind (``full`` / ``sliding``) in
    order, stacked arrays ``k`` [n, batch, kv_heads, head_dim, S] (roped
    keys, transposed) and ``v`` [n, batch, kv_heads, S, head_dim], or for
    MLA ``latent`` [n, batch, S, kv_lora_rank] and ``k_pe`` [n, batch, S, qk_rope_head_dim] (DeepSeek-V3.2: and its
    indexer's keys ``index_k`` [n, batch, S, index_head_dim]). ``lengths`` [batch] int32
    counts the tokens of each row already in the cache. ``rope_delta`` [batch] int32 (multimodal RoPE only, else
    None): what each row's images moved its positions by (transformers' ``rope_deltas``: the prefill's largest
    position + 1 - its tokens), added to every later token's position.
    """

    layers: dict[str, dict[str, dict[str, jax.Array]]]
    lengths: jax.Array
    rope_delta: jax.Array | None = None


def _kind_sizes(cfg: ModelConfig, max_len: int) -> dict[str, int]:
    """Ring size of each layer kind."""
    sizes = {"full": max_len}
    if "sliding" in cfg.kinds:
        assert cfg.sliding_window is not None  # ModelConfig refuses sliding layers without a window
        sizes["sliding"] = min(cfg.sliding_window, max_len)
    if "chunked" in cfg.kinds:  # Llama 4: a query's keys lie within its chunk's size
        assert cfg.attention_chunk_size is not None  # ModelConfig refuses chunked layers without one
        sizes["chunked"] = min(cfg.attention_chunk_size, max_len)
    return sizes


def _cache_tree(cfg: ModelConfig, batch: int, max_len: int, make: Any) -> Cache:
    """A cache whose every array is ``make(shape, logical axes, dtype or None)`` (None: the cache's own dtype)."""
    sizes = _kind_sizes(cfg, max_len)
    layers: dict[str, dict[str, dict[str, Any]]] = {}
    for prefix, stack, _ in cfg.layer_stacks:
        kinds = tuple(cfg.kinds[i] for i in stack)
        if is_kv_shared(cfg, prefix):
            layers[prefix] = {}  # Gemma 4's KV-shared layers read their stored layers' entries: none of their own
            continue
        layers[prefix] = {
            kind: {name: make(shape, axes, jnp.float32 if name == "rec" else None) for name, (shape, axes)
                   in entry_shapes(kind_config(cfg, kind), kinds.count(kind), batch, sizes.get(kind, 0), kind).items()}
            for kind in sorted(set(kinds))}
    delta = make((batch,), ("batch",), jnp.int32) if cfg.rope.mrope_section else None
    return Cache(layers, make((batch,), ("batch",), jnp.int32), delta)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32,
               mesh: Mesh | None = None) -> Cache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens each (prompt and generated together).

    With ``mesh`` every array is placed as :func:`cache_shardings` says: split
    like the heads of the weights laid out for decoding, rows on data.
    """
    def make(shape: tuple[int, ...], axes: tuple, dt: Any) -> jax.Array:
        a = jnp.zeros(shape, dt or dtype)
        return a if mesh is None else jax.device_put(a, _decode_sharding(mesh, axes, shape))

    return _cache_tree(cfg, batch, max_len, make)


def abstract_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any, mesh: Mesh) -> Cache:
    """:func:`init_cache`'s arrays as ``jax.ShapeDtypeStruct`` s with their shardings on ``mesh`` (nothing
    allocated): for compiling generation without a device (``zoo generate --compile-only``)."""
    return _cache_tree(cfg, batch, max_len, lambda shape, axes, dt: jax.ShapeDtypeStruct(
        shape, dt or dtype, sharding=_decode_sharding(mesh, axes, shape)))


def cache_shardings(cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh) -> Cache:
    """The shardings of :func:`init_cache`'s arrays on ``mesh`` (a Cache of NamedShardings)."""
    return _cache_tree(cfg, batch, max_len, lambda shape, axes, dt: _decode_sharding(mesh, axes, shape))


def kv_cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: Any, mesh: Mesh) -> int:
    """Bytes one chip holds of the keys/values of a cache of ``batch`` rows and ``max_len`` slots laid out by
    :func:`init_cache` on ``mesh`` (its shards: the shape over each dimension's split)."""
    import math

    total = 0
    for s in jax.tree.leaves(abstract_cache(cfg, batch, max_len, dtype, mesh).layers):
        total += math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
    return total


def _decode_sharding(mesh: Mesh, axes: tuple, shape: tuple[int, ...]) -> NamedSharding:
    from zoo.model.sharding import DECODE_RULES, named_sharding

    return named_sharding(mesh, axes, shape, DECODE_RULES)


def decode_shardings(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """Where each weight lives while decoding on ``mesh`` (a nested dict like the parameters).

    :data:`zoo.model.sharding.DECODE_RULES`: tensor-parallel over the tensor and
    fsdp axes (heads, mlp, vocab split; embed whole), so a token step keeps
    every weight resident instead of all-gathering FSDP's embed-split weights
    at each token; the cache (:func:`init_cache`) is split like the k/v heads.
    """
    from zoo.model.params import nest, param_specs

    return nest({k: _decode_sharding(mesh, s.axes, s.shape) for k, s in param_specs(cfg).items()})


def place_for_decoding(cfg: ModelConfig, params: dict[str, Any]) -> tuple[dict[str, Any], Mesh | None]:
    """(``params`` laid out for decoding, their mesh): moved once to :func:`decode_shardings` when they lie on a
    mesh of several devices (as :func:`zoo.load` places them), else as they are with None. Arrays already so
    laid out are not copied."""
    sharding = getattr(params["embed"], "sharding", None)
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None  # a placed array's: concrete
    if not isinstance(mesh, Mesh) or mesh.size == 1:
        return params, None
    return jax.device_put(params, decode_shardings(cfg, mesh)), mesh


def forward_cached(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, cache: Cache,
                   valid: jax.Array | None = None, mla_absorb: bool | None = None) -> tuple[jax.Array, Cache]:
    """Logits [b, t, vocab] (float32) of t new tokens per row, and the cache with them appended.

    Row r's tokens take positions ``cache.lengths[r] + (number of valid tokens
    before them)`` (``lengths + arange(t)`` when all are valid) and attend
    causally to the cache and to each other. ``valid`` [b, t] bool marks real
    tokens: padding is neither attended to, nor written, nor counted into
    ``lengths`` (its logits are meaningless). Jit it with ``cfg`` static: one
    compilation per (batch, t, max_len). MoE layers route every token
    (dropless, whatever ``capacity_factor`` says: generation drops no token).
    A full-attention cache must have room for every position (``max_len``);
    past it, the oldest entries would be overwritten. ``mla_absorb`` (static)
    forces one way of MLA attention (see :func:`zoo.model.cached_attention.mla_attention`); by default
    the cheaper is taken.
    """
    return forward_step(cfg, params, tokens, cache, valid, mla_absorb)


def forward_step(cfg: ModelConfig, params: dict[str, Any] | Weights, tokens: jax.Array, cache: Cache,
                 valid: jax.Array | None = None, mla_absorb: bool | None = None, *, fresh: bool = False,
                 view: int | None = None, last: jax.Array | None = None,
                 hidden: bool = False, vision: VisionInputs | None = None,
                 entries: bool = False, pages: jax.Array | None = None,
                 seq_rows: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """:func:`forward_cached` with generation's shortcuts (``fresh`` and ``view`` static), and LoRA adapters.

    ``fresh``: the cache is empty (every length 0), so its slots are not read.
    ``view``: every row's ``cache.lengths`` is at most ``view``, so only the
    first ``view`` slots of a ring can hold anything and the rest are not read.
    ``last`` [b] int: return only the logits [b, vocab] of position ``last[r]``
    of each row (the output head runs on b positions instead of b * t).
    ``params``: the base alone, or :class:`zoo.lora.weights.Weights` with LoRA
    adapters: each adapted projection adds its adapter beside the base matmul,
    as the training forward does (no merged copy of the weights exists; no dropout); with ``rows`` each row of
    the batch its own adapter (:mod:`zoo.lora.rows`).
    ``hidden`` (static): return the final normed hidden states [b, t, hidden]
    instead of the logits, for a caller that projects the vocabulary in pieces.
    ``vision``: a vision-language model's images of these tokens (the prompt's, at prefill), each image token's
    embedding replaced by its image feature as in the training forward, and where the model has image blocks
    (Gemma 3) each run of image tokens attending within itself both ways; the steps after it are plain text.
    ``entries`` (static): return :class:`Written` (the new keys and values, unwritten) instead of the new cache.
    ``pages`` [b, P]: the cache is paged (the inference engine's pool, :mod:`eval.engine.paged`): each kind's
    arrays hold pages (``k`` [n, pages, kv_heads, head_dim, page], ``v`` [n, pages, kv_heads, page, head_dim], MLA
    ``latent``/``k_pe`` [n, pages, page, ...]) and row r reads pages ``pages[r]`` as P * page slots, position p
    at slot p; each layer gathers its own when it runs (:func:`zoo.model.cache_io.gather_pages`), so only one layer's rows are ever
    copied out of the pool. Needs ``entries`` (the pool is written by its owner); LongRoPE switches per row, and
    its owner re-ropes a row's cached keys before the call in which it crosses (:func:`eval.engine.paged.rerope`).
    ``seq_rows`` [b]: with ``pages``, each row's sequence slot in the pool's linear-layer states (Qwen3-Next; a row
    with no cached token starts from zeros: :func:`zoo.model.cache_io.rows_states`).
    """
    w = Weights.wrap(params)
    base: dict[str, Any] = w.base
    lora = w.adapters
    scale: float | jax.Array = 1.0 if w.scale is None else w.scale  # read only with adapters
    if cfg.capacity_factor is not None:
        cfg = dataclasses.replace(cfg, capacity_factor=None)
    b, t = tokens.shape
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
    vi = valid.astype(jnp.int32)
    pos = cache.lengths[:, None] + jnp.cumsum(vi, axis=1) - vi
    new_lengths = cache.lengths + vi.sum(1)
    assert pages is None or entries, "a paged cache is written by its owner"
    if cfg.rope.kind == "longrope" and not fresh and pages is None:  # Phi-3: past original_max_position_embeddings, long factors
        cache = Cache(switch_to_long(cfg, cache.layers, cache.lengths, new_lengths, slot_positions), cache.lengths,
                      cache.rope_delta)

    rope_pos, delta = _rope_positions(cfg, tokens, pos, valid, new_lengths, cache.rope_delta, vision)
    # A paged cache's rows are requests of their own: LongRoPE switches per row (its owner re-ropes a row's pages
    # before the call that crosses: eval.engine.paged.rerope).
    ropes = rope_tables_by_kind(cfg, rope_pos, valid, per_row=pages is not None)
    # A ring's slots (a paged cache: the same axis is a page's positions, P of them a row).
    slots = {kind: arrays["latent" if cfg.mla else "v"].shape[2 if cfg.mla else 3] * (1 if pages is None
                                                                                    else pages.shape[1])
             for group in cache.layers.values() for kind, arrays in group.items() if kind != "linear"}
    # Slots read per kind: none when fresh, the first `view` when every row fits in them.
    read = {kind: 0 if fresh else (s if view is None else min(s, view)) for kind, s in slots.items()}
    windows = {kind: kind_window(cfg, kind) for kind in slots}
    # The image blocks among the new tokens (the prefill's images), on the layer kinds that have them: each block
    # attends within itself both ways; the steps after it (no images) are plain causal text, as transformers'
    # generate drops token_type_ids after the first step.
    blocks = image_blocks(cfg, tokens)[0] if vision is not None else None
    kind_blocks = {kind: blocks_of_kind(cfg, kind, blocks) for kind in slots}
    masks = {kind: new_token_masks(pos, valid, slot_positions(cache.lengths, n)[:, :n] if n else None, windows[kind],
                                   kind_blocks[kind], kind_chunk(cfg, kind)) for kind, n in read.items()}
    # As the training forward embeds a row with images (zoo.model.decoder.forward): an image token read as id 0.
    ids = tokens if vision is None else text_ids(cfg, tokens)
    x = embed_tokens(cfg, base, ids)
    deep = None  # Qwen3-VL's DeepStack levels of the prefill's images (the steps after it have none)
    if vision is not None:
        x, deep = embed_images(cfg, w.without_dropout(), tokens, x, vision)
    ple = per_layer_inputs(cfg, base, ids, x) if cfg.per_layer_input_size else None
    # Gemma 4: kind -> (the stored layer's cache, its new keys/values), read by the KV-shared layers.
    stored: dict[str, tuple[dict | None, tuple[jax.Array, jax.Array]]] = {}
    causal = {kind: b is None for kind, b in kind_blocks.items()}
    if "linear" in cfg.kinds and pages is not None and seq_rows is None:
        raise ValueError("a paged cache of a model with linear layers needs each row's sequence slot (seq_rows)")
    layer = _cached_layer(cfg, ropes, masks, windows, read, slots, stored, valid, scale, mla_absorb, causal,
                          w.rows, pages, query_temperature(cfg, pos), (seq_rows, cache.lengths == 0))
    x, written = _run_cached_stacks(cfg, base, x, cache, layer, lora, ple, fresh, stored, deep)
    if last is not None:
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    x = norm(cfg, x, base["final_norm"])
    logits = x if hidden else output_logits(cfg, base, x)
    step = Written(written, pos, valid, new_lengths, delta)
    if entries:
        return logits, step
    return logits, Cache(write_ring(cache.layers, written, pos, valid, new_lengths, cfg.mla), new_lengths, delta)


def _rope_positions(cfg: ModelConfig, tokens: jax.Array, pos: jax.Array, valid: jax.Array, new_lengths: jax.Array,
                    delta: jax.Array | None, vision: VisionInputs | None) -> tuple[jax.Array, jax.Array | None]:
    """(the positions RoPE turns by, the cache's new rope delta): ``pos`` itself but for multimodal RoPE, where a
    prefill with images takes its (time, row, column) positions (:func:`zoo.model.mrope.mrope_positions`) and
    records each row's delta, and every other call shifts ``pos`` by the recorded delta (text after the images)."""
    if delta is None:
        return pos, None
    if vision is None:
        return pos + delta[:, None], delta
    assert cfg.vision is not None, "images given to a model without a vision tower"
    p3 = mrope_positions(cfg.vision, tokens, pos, vision)
    top = jnp.max(jnp.where(valid, p3.max(0), -1), axis=1)
    return p3, (top + 1 - new_lengths).astype(jnp.int32)


def _cached_layer(cfg: ModelConfig, ropes: dict[str, tuple[jax.Array, jax.Array]], masks: dict[str, Any],
                  windows: dict[str, int | None], read: dict[str, int], slots: dict[str, int],
                  stored: dict[str, tuple[dict | None, tuple[jax.Array, jax.Array]]], valid: jax.Array,
                  scale: float | jax.Array, mla_absorb: bool | None,
                  causal: dict[str, bool] | None = None, rows: bool = False,
                  pages: jax.Array | None = None,
                  temperature: jax.Array | None = None, states: tuple[jax.Array | None, jax.Array] | None = None
                  ) -> Callable[..., tuple[jax.Array, dict | None]]:
    """The cached forward's layer as :func:`_run_cached_stacks` scans it: ``layer(x, inputs, kind, moe, prefix)``.

    ``inputs`` are one layer's (weights, adapters, NoPE flag, per-layer input, DeepStack level, cache entry); by
    layer kind,
    ``ropes``, ``masks`` and ``windows`` are the rope tables, masks and sliding windows, ``read`` the slots read
    of the ``slots`` a ring has; ``valid`` [b, t] the real tokens; ``causal[kind]`` False when that kind's new
    tokens' mask holds bidirectional blocks (:func:`zoo.model.cached_attention.gqa_attention`; None: all causal).
    ``rows``: the adapters are per batch row (:class:`zoo.lora.projections.LayerLora`). ``pages``: the rows' page
    tables of a paged cache (:func:`forward_step`), gathered here. A KV-shared layer (Gemma 4) reads its stored layer's cache and new keys/values
    from ``stored``. The layer's output is its new cache entries (None for a KV-shared layer: it writes nothing).
    ``temperature`` [b, t]: Llama 4's query temperature of the NoPE layers (:func:`zoo.model.rope.query_temperature`).
    ``states``: (the rows' sequence slots in a pool, or None; the rows that start empty): :func:`rows_states`'.
    """

    def layer(x: jax.Array, inputs: tuple, kind: str, moe: bool, prefix: str) -> tuple[jax.Array, dict | None]:
        p, lp, rope_on, pli, deep, c = inputs
        lora = None if lp is None else LayerLora(lp, scale, rows=rows)  # no dropout in decoding
        reuse = None
        if is_kv_shared(cfg, prefix):
            c, reuse = stored[kind]
        kcfg = kind_config(cfg, kind)
        if kind == "linear":  # Qwen3-Next: a fixed-size state, read and replaced whole
            state = None if c is None or states is None else rows_states(c, *states)

            def recur(x: jax.Array) -> tuple[jax.Array, dict]:
                return linear_attention(x, p, cfg, valid.astype(jnp.int32), p["attn_norm"], lora, state)

            x, new, _ = decoder_layer(cfg, x, p, recur, moe, valid, lora, per_layer=pli, deepstack=deep)
            return x, new
        n = read[kind]
        if c is not None and pages is not None:
            c = gather_pages(c, pages)
        elif c is not None and n < slots[kind]:
            # One layer's arrays: MLA [b, S, r], k [b, hk, d, S], v [b, hk, S, d].
            c = ({name: a[:, :n] for name, a in c.items()} if cfg.mla
                 else {"k": c["k"][..., :n], "v": c["v"][:, :, :n]})

        def attend(x: jax.Array) -> tuple[jax.Array, dict]:
            if cfg.mla:
                return mla_attention(norm(cfg, x, p["attn_norm"]), p, c, *ropes[kind], masks[kind], cfg, mla_absorb)
            return gqa_attention(x, p, c, *layer_rope(ropes[kind], rope_on), masks[kind], windows[kind], kcfg, lora,
                                  reuse, causal is None or causal[kind], rope_on,
                                  layer_query_scale(temperature, rope_on))

        x, new, _ = decoder_layer(cfg, x, p, attend, moe, valid, lora, per_layer=pli, deepstack=deep)
        return x, (None if reuse is not None else new)  # a KV-shared layer writes nothing

    return layer


def _run_cached_stacks(cfg: ModelConfig, params: dict[str, Any], x: jax.Array, cache: Cache,
                       layer: Callable[..., tuple[jax.Array, dict | None]], lora: dict | None, ple: jax.Array | None,
                       fresh: bool, stored: dict[str, tuple[dict | None, tuple[jax.Array, jax.Array]]],
                       deep: jax.Array | None = None) -> tuple[jax.Array, dict[str, dict[str, list]]]:
    """x through every run of :attr:`ModelConfig.layer_runs` on ``cache``; returns x and, per stack and kind, each
    layer's new cache entries with its index in its kind's cache stack (what :func:`zoo.model.cache_io.write_ring` scatters). Fills
    ``stored`` (Gemma 4) as the layers whose keys/values the KV-shared layers reuse are done. ``deep``: Qwen3-VL's
    DeepStack levels, scanned with the first layers (:func:`zoo.model.multimodal.deepstack_runs`)."""
    written: dict[str, dict[str, list]] = {prefix: {kind: [] for kind in group} for prefix, group in cache.layers.items()}
    runs = cfg.layer_runs if deep is None else deepstack_runs(cfg.layer_runs, deep.shape[0])
    for prefix, start, stop, moe, first in runs:
        # A run is its stack's layers first .. first + (stop - start) (ModelConfig.layer_runs): each layer's cache
        # entry comes after those of the stack's earlier layers of its kind.
        stack = next(layers for p, layers, _ in cfg.layer_stacks if p == prefix)
        kinds = tuple(cfg.kinds[i] for i in stack[:first]) + cfg.kinds[start:stop]
        group = cache.layers[prefix]
        # Adapters, the NoPE layers' flags (SmolLM3) and Gemma 4's per-layer inputs are stacked like the weights
        # and sliced with them.
        weights = (params[prefix], (lora or {}).get(prefix))
        if split_by_kind(cfg):  # Gemma 4, Qwen3-Next: weights stacked by kind (zoo.model.layer_layout)
            weights = kind_stack_slice(cfg, weights, tuple(cfg.kinds[i] for i in stack), first, stop - start)
        else:
            weights = stack_slice(weights, first, stop - start)
        stacked = weights + (rope_flags(cfg, start, stop), None if ple is None else ple[start:stop],
                             deepstack_slice(deep, start, stop))

        def inputs(seg: Segment, j: int, kinds: tuple[str, ...] = kinds, group: dict = group,
                   stacked: tuple = stacked, first: int = first, start: int = start, stop: int = stop) -> tuple:
            i0, step = _kind_slice(kinds, dataclasses.replace(seg, start=seg.start + first), j)
            cached = None if fresh or seg.kinds[j] not in group else jax.tree.map(
                lambda a: a[i0: i0 + seg.repeats * step: step], group[seg.kinds[j]])
            if not split_by_kind(cfg):
                return (*seg.at(j, stacked), cached)
            # Gemma 4, Qwen3-Next: a block position's weights are a strided view of its kind's stack.
            w, a, *rest = stacked
            run = cfg.kinds[start:stop]
            return (layer_weights(cfg, w, run, seg, j), None if a is None else layer_weights(cfg, a, run, seg, j),
                    *seg.at(j, tuple(rest)), cached)

        x, done = scan_segments(x, cfg.kinds[start:stop], inputs, partial(layer, moe=moe, prefix=prefix))
        if is_kv_shared(cfg, prefix):
            continue  # a KV-shared layer writes nothing
        for kind, i in store_layers(cfg).items() if cfg.kv_shared_layers else ():
            if start <= i < stop:  # Gemma 4: the stored layer's cache (before this step's writes) and new keys/values
                at = kinds[:first + i - start].count(kind)  # its index in its kind's cache stack
                own = None if fresh else jax.tree.map(lambda a: a[at], group[kind])
                new = layer_output(done, i - start, False)
                stored[kind] = (own, (new["k"], new["v"]))
        # Each layer's new entries with its index in its kind's stack, in the order write_ring concatenates them.
        for seg, news in done:
            for j, (kind, new) in enumerate(zip(seg.kinds, news)):
                i0, step = _kind_slice(kinds, dataclasses.replace(seg, start=seg.start + first), j)
                written[prefix][kind].append((jnp.arange(seg.repeats) * step + i0, new))
    return x, written


def _kind_slice(kinds: tuple[str, ...], seg: Segment, j: int) -> tuple[int, int]:
    """(start, stride) of the layers at block position j of ``seg`` within their kind's cache stack.

    Layers of one kind are stacked in order, so one block position's layers
    are a strided slice of that stack.
    """
    kind = seg.kinds[j]
    return kinds[:seg.start + j].count(kind), seg.kinds.count(kind)


forward_cached_jit = jax.jit(forward_cached, static_argnums=0, static_argnames="mla_absorb")
""":func:`forward_cached`, compiled per config and shape (the cache is not donated)."""
