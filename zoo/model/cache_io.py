"""What the cached forward (:mod:`zoo.model.decode`) reads from and writes to its caches: its new keys and values
unwritten (:class:`Written`), which a cache kept elsewhere (the inference engine's paged KV cache,
:mod:`eval.engine.paged`) writes where it keeps them; one layer's reads of a paged pool (:func:`gather_pages`); and
the ring cache's write (:func:`write_ring`); the shapes of a ring cache's entries (:func:`entry_shapes`), the
linear layers' states (:func:`linear_state_shapes`) and their reads and writes (:func:`rows_states`,
:func:`put_states`)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from zoo.model.config import ModelConfig


@dataclass(frozen=True)
class Written:
    """What a cached forward computed for the cache, before it is written (:func:`forward_step`'s ``entries``): per
    stack and kind, each layer's new entries ``[(index in its kind's cache stack [m], {name: [m, b, t, ...]})]``,
    the new tokens' positions ``pos`` [b, t] and ``valid`` mask, each row's new length and rope delta. A cache laid
    out otherwise (the engine's pages, :mod:`eval.engine.paged`) writes them where it keeps them."""

    entries: dict[str, dict[str, list]]
    pos: jax.Array
    valid: jax.Array
    lengths: jax.Array
    rope_delta: jax.Array | None


def gather_pages(c: dict[str, jax.Array], pages: jax.Array) -> dict[str, jax.Array]:
    """One layer's pool arrays (``k`` [pages, kv_heads, head_dim, page], ``v`` [pages, kv_heads, page, head_dim],
    MLA ``latent``/``k_pe`` (and DeepSeek-V3.2's ``index_k``) [pages, page, ...]) read for the rows' page tables ``pages`` [b, P] as a ring of P *
    page slots: k [b, kv_heads, head_dim, S], v [b, kv_heads, S, head_dim], MLA [b, S, ...]."""
    b = pages.shape[0]
    out = {}
    for name, a in c.items():
        g = a[pages]  # [b, P, ...one page's axes]
        if name == "k":
            out[name] = g.transpose(0, 2, 3, 1, 4).reshape(b, g.shape[2], g.shape[3], -1)
        elif name == "v":
            out[name] = g.transpose(0, 2, 1, 3, 4).reshape(b, g.shape[2], -1, g.shape[4])
        else:
            out[name] = g.reshape(b, -1, g.shape[-1])
    return out


def write_ring(layers: dict, written: dict, pos: jax.Array, valid: jax.Array,
               new_lengths: jax.Array, mla: bool) -> dict:
    """A ring cache's arrays (:class:`zoo.model.decode.Cache`'s ``layers``) with each layer's new entries
    (:func:`zoo.model.decode.forward_step`'s ``written``) scattered into their ring slots.

    Only the last S positions of each row go in (earlier ones would collide
    in the ring and are out of every later query's reach); padding never does.
    """
    out: dict[str, dict[str, dict[str, jax.Array]]] = {}
    rows = jnp.arange(pos.shape[0])[None, :, None]
    for prefix, group in layers.items():
        out[prefix] = {}
        for kind, arrays in group.items():
            if kind == "linear":  # Qwen3-Next's fixed-size states: each layer's replaced whole
                out[prefix][kind] = put_states(arrays, written[prefix][kind])
                continue
            s = arrays["latent"].shape[2] if mla else arrays["v"].shape[3]
            keep = valid & (pos >= new_lengths[:, None] - s)
            slot = jnp.where(keep, pos % s, s)[None]  # slot s is out of range: dropped
            out[prefix][kind] = put_entries(arrays, written[prefix][kind], rows, slot)
    return out


def linear_state_shapes(cfg: ModelConfig, n: int, rows: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of n linear layers' states (Qwen3-Next, :mod:`zoo.layers.linear_attention`) for
    ``rows`` rows (a cache's) or sequence slots (a pool's): the convolution's last inputs ``conv`` [n, rows,
    kernel - 1, channels] and the delta rule's ``rec`` [n, rows, value heads, k_dim, v_dim] (kept in float32),
    split over the value heads like the keys/values over theirs."""
    channels = 2 * cfg.linear_key_heads * cfg.linear_key_head_dim + cfg.linear_value_heads * cfg.linear_value_head_dim
    return {"conv": ((n, rows, cfg.linear_conv_kernel - 1, channels), ("layers", "batch", None, None)),
            "rec": ((n, rows, cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                    ("layers", "batch", "heads", None, None))}


def entry_shapes(cfg: ModelConfig, n: int, batch: int, slots: int,
                 kind: str = "full") -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of one kind's ring cache arrays (:class:`zoo.model.decode.Cache`) for n layers
    of ``batch`` rows and ``slots`` slots: keys and values, MLA's latent and rope keys (DeepSeek-V3.2: and its
    indexer's keys ``index_k``), or Qwen3-Next's linear layers' fixed-size states (:func:`linear_state_shapes`)."""
    if kind == "linear":
        return linear_state_shapes(cfg, n, batch)
    lead, axes = (n, batch, slots), ("layers", "batch", "sequence")
    if cfg.mla:
        sparse = {"index_k": (lead + (cfg.index_head_dim,), axes + (None,))} if cfg.sparse else {}
        return {"latent": (lead + (cfg.kv_lora_rank,), axes + (None,)),
                "k_pe": (lead + (cfg.qk_rope_head_dim,), axes + ("head_dim",)), **sparse}
    lead, axes = (n, batch, cfg.num_kv_heads), ("layers", "batch", "kv_heads")
    return {"k": (lead + (cfg.head_dim, slots), axes + ("head_dim", "sequence")),
            "v": (lead + (slots, cfg.head_dim), axes + ("sequence", "head_dim"))}


def rows_states(c: dict[str, jax.Array], seq_rows: jax.Array | None, empty: jax.Array) -> dict[str, jax.Array]:
    """One linear layer's states as its batch reads them: a pool's at the rows' sequence slots ``seq_rows`` [b]
    (clipped; None: a cache's own rows), zeros for the rows that start empty (``empty`` [b])."""
    if seq_rows is not None:
        c = {n: jnp.take(a, seq_rows, axis=0, mode="clip") for n, a in c.items()}
    return {n: jnp.where(empty.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a) for n, a in c.items()}


def put_states(arrays: dict[str, jax.Array], entries: list, rows: jax.Array | None = None) -> dict[str, jax.Array]:
    """Linear layers' state arrays (``conv`` [n, L, ...], ``rec`` [n, L, ...]) with their new states (``entries``
    as :func:`put_entries`', {name: [m, b, ...]}) put at their layers' indices, all rows (a ring cache's), or rows
    ``rows`` [b] of L (a pool's sequence slots; an out-of-range row is dropped)."""
    idx = jnp.concatenate([i for i, _ in entries])
    new = {name: jnp.concatenate([e[name] for _, e in entries]) for name in arrays}
    if rows is None:
        return {name: a.at[idx].set(new[name].astype(a.dtype)) for name, a in arrays.items()}
    return {name: a.at[idx[:, None], rows[None]].set(new[name].astype(a.dtype), mode="drop")
            for name, a in arrays.items()}


def put_entries(arrays: dict[str, jax.Array], entries: list, lead: jax.Array, at: jax.Array) -> dict[str, jax.Array]:
    """One layer kind's cache arrays (``k`` [n, L, kv_heads, head_dim, A], ``v`` [n, L, kv_heads, A, head_dim], MLA
    ``latent``/``k_pe`` [n, L, A, ...]) with a forward's new entries of its layers (``entries``: :class:`Written`'s
    ``[(index in the stack [m], {name: [m, b, t, ...]})]``) put at ``[index, lead, ..., at]``: ``lead`` and ``at``
    broadcast to [1, b, t] (a ring's rows and slots, or a pool's pages and offsets); an out-of-range index drops
    its entry (padding)."""
    idx = jnp.concatenate([i for i, _ in entries])[:, None, None]
    new = {name: jnp.concatenate([e[name] for _, e in entries]) for name in arrays}
    # new [m, b, t, ...]: the indexed elements of every array, in the order of numpy's advanced indexing.
    where = {"latent": (idx, lead, at), "k_pe": (idx, lead, at), "index_k": (idx, lead, at),
             "k": (idx, lead, slice(None), slice(None), at), "v": (idx, lead, slice(None), at)}
    return {name: a.at[where[name]].set(new[name].astype(a.dtype), mode="drop") for name, a in arrays.items()}
