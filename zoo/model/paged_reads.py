"""What a cached forward hands a cache kept elsewhere: its new keys and values unwritten (:class:`Written`), and
one layer's reads of a paged pool (:func:`gather_pages`), for the inference engine's paged KV cache
(:mod:`eval.engine.paged`)."""

from __future__ import annotations

from dataclasses import dataclass

import jax


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
    MLA ``latent``/``k_pe`` [pages, page, ...]) read for the rows' page tables ``pages`` [b, P] as a ring of P *
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
