"""The gated delta rule (Gated DeltaNet: Qwen3-Next's linear-attention layers) and its short causal convolution.

Per head, a state S [k_dim, v_dim] is decayed and corrected token by token::

    S_t = exp(g_t) S_{t-1};   u_t = beta_t (v_t - S_t^T k_t);   S_t += k_t u_t^T;   o_t = S_t^T q_t

:func:`gated_delta_step` is that recurrence for one token (decoding). :func:`gated_delta_chunked` is the same
function for a sequence (training, prefill): a :func:`jax.lax.scan` over chunks of ``chunk`` tokens, each chunk's
updates condensed into [chunk, chunk] matmuls and one unit-triangular solve (the "UT transform" of the DeltaNet
paper, as transformers' ``torch_chunk_gated_delta_rule`` and FLA's kernels compute it), so no [seq, seq] array
exists and the scan carries only S.

Packed rows: ``segment_ids`` [b, t] (0 padding). A token whose id differs from the last non-padding token's before
it starts its document from a zero state; padding tokens are identity steps (they neither decay nor write S) and
output zero, so a row's final state is its last document's after its last real token (the prefill's state).

:func:`causal_conv` is the depthwise causal convolution (kernel 4 in the released config, SiLU after it) that
feeds q, k and v, with its own rolling state of the last ``kernel - 1`` inputs; it too never reads across a
document boundary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular


def document_index(segment_ids: jax.Array) -> jax.Array:
    """Each token's document number [b, t] int32, counting from 0 at a row's first document: it steps up where a
    non-padding token's id differs from the last non-padding id before it; padding keeps the number before it
    (leading padding the first document's), so padding never starts a document."""
    b, t = segment_ids.shape
    real = segment_ids != 0
    idx = jnp.where(real, jnp.arange(t)[None], -1)
    last = jax.lax.cummax(idx, axis=1)  # the last real token at or before each position (-1: none yet)
    first = jnp.take_along_axis(segment_ids, jnp.argmax(real, axis=1)[:, None], axis=1)
    eff = jnp.where(last >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last, 0), axis=1), first)
    starts = jnp.concatenate([jnp.zeros((b, 1), bool), eff[:, 1:] != eff[:, :-1]], axis=1)
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


def gated_delta_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule: q, k [b, h, k_dim], v [b, h, v_dim], g (log decay) and beta [b, h],
    state [b, h, k_dim, v_dim] -> (output [b, h, v_dim], new state), in float32."""
    f32 = jnp.float32
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    s = state.astype(f32) * jnp.exp(g)[..., None, None]
    u = (v - jnp.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q), s


def _chunk_body(s: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
    """One chunk of :func:`gated_delta_chunked`: state s [b, h, dk, dv] and the chunk's q, k [b, h, C, dk], v
    [b, h, C, dv], g, beta [b, h, C], document numbers d [b, C] and the previous chunk's last one d0 [b]."""
    q, k, v, g, beta, d, d0 = xs
    c = q.shape[2]
    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
    causal = jnp.tril(jnp.ones((c, c), bool))
    same = (d[:, :, None] == d[:, None, :]) & causal  # [b, C, C]: j <= i within one document
    same = same[:, None]
    diff = cum[..., :, None] - cum[..., None, :]
    # exp only where it is a decay (<= 0): elsewhere the difference may be large and its exp overflow.
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)  # [b, h, C, C]
    kb = k * beta[..., None]
    strict = decay * (1.0 - jnp.eye(c, dtype=decay.dtype))
    a = jnp.einsum("bhik,bhjk->bhij", kb, k) * strict  # unit-lower system: u_i + sum_j<i a_ij u_j = rhs_i
    cont = (d == d0[:, None])[:, None]  # [b, 1, C]: tokens of the document the carried state belongs to
    ecum = jnp.where(cont, jnp.exp(cum), 0.0)
    rhs = v * beta[..., None] - jnp.einsum("bhck,bhkv->bhcv", kb * ecum[..., None], s)
    eye = jnp.eye(c, dtype=a.dtype)
    u = solve_triangular(a + eye, rhs, lower=True, unit_diagonal=True)
    out = jnp.einsum("bhck,bhkv->bhcv", q * ecum[..., None], s)
    out = out + jnp.einsum("bhij,bhjv->bhiv", jnp.einsum("bhik,bhjk->bhij", q, k) * decay, u)
    last = d[:, -1:]  # the chunk's last document: what the state carries on
    tail = jnp.where((d == last)[:, None], jnp.exp(cum[..., -1:] - cum), 0.0)  # [b, h, C]
    keep = jnp.where(d0 == last[:, 0], 1.0, 0.0)[:, None, None, None] * jnp.exp(cum[..., -1])[..., None, None]
    s = s * keep + jnp.einsum("bhck,bhcv->bhkv", k * tail[..., None], u)
    return s, out


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        segment_ids: jax.Array | None = None, chunk: int = 64,
                        state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence, chunk by chunk: q, k [b, t, h, k_dim], v [b, t, h, v_dim], g (log
    decay, <= 0) and beta [b, t, h] -> (outputs [b, t, h, v_dim] float32, final state [b, h, k_dim, v_dim]).

    ``segment_ids`` [b, t] as the module says (None: one document a row); ``state`` the state the row's first
    document continues from (None: zeros). t need not divide by ``chunk``: the tail is padded with identity steps.
    """
    f32 = jnp.float32
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    real = seg != 0
    d = document_index(seg)
    pad = -t % chunk
    n = (t + pad) // chunk
    # Padding is an identity step: no decay (g 0), no write (beta 0); the padded tail continues the last document.
    g = jnp.where(real[..., None], g.astype(f32), 0.0)
    beta = jnp.where(real[..., None], beta.astype(f32), 0.0)

    def chunks(a: jax.Array, fill: str = "zero") -> jax.Array:
        """[b, t, ...] -> [n, b, ..., C] moved so heads lead the chunk's tokens ([n, b, h, C, ...] for heads)."""
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)
        a = jnp.pad(a, widths, mode="edge" if fill == "edge" else "constant")
        a = a.reshape(b, n, chunk, *a.shape[2:])
        if a.ndim == 3:  # document numbers [b, n, C]
            return a.transpose(1, 0, 2)
        if a.ndim == 4:  # g, beta [b, n, C, h]
            return a.transpose(1, 0, 3, 2)
        return a.transpose(1, 0, 3, 2, 4)  # q, k, v [b, n, C, h, d]

    dc = chunks(d, "edge")
    d0 = jnp.concatenate([dc[:1, :, 0], dc[:-1, :, -1]], axis=0)  # [n, b]: the document before each chunk
    xs = (chunks(q.astype(f32)), chunks(k.astype(f32)), chunks(v.astype(f32)), chunks(g), chunks(beta), dc, d0)
    s0 = jnp.zeros((b, h, dk, dv), f32) if state is None else state.astype(f32)
    s, out = jax.lax.scan(_chunk_body, s0, xs)
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, n * chunk, h, dv)[:, :t]  # [n, b, h, C, dv] -> [b, t, h, dv]
    return jnp.where(real[..., None, None], out, 0.0), s


def causal_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None,
                state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """SiLU of the depthwise causal convolution of x [b, t, channels] by w [kernel, channels] (tap kernel - 1
    reads the token itself, tap 0 the one kernel - 1 before it), and the new rolling state [b, kernel - 1,
    channels] (the inputs before the row's next token).

    ``state`` holds the inputs before x (None: zeros), read by the row's first document only; a token never reads
    an earlier document's inputs (``segment_ids`` as :func:`gated_delta_chunked`'s) and padding inputs are zero.
    The new state is the last kernel - 1 inputs up to the row's last real token (real tokens first, padding after:
    a prefill's layout).
    """
    b, t, ch = x.shape
    kern = w.shape[0]
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    real = seg != 0
    d = document_index(seg)
    x = jnp.where(real[..., None], x, 0)
    prev = jnp.zeros((b, kern - 1, ch), x.dtype) if state is None else state.astype(x.dtype)
    ext = jnp.concatenate([prev, x], axis=1)  # [b, kern - 1 + t, ch]
    dext = jnp.concatenate([jnp.zeros((b, kern - 1), d.dtype), d], axis=1)  # the state belongs to document 0
    acc = jnp.zeros((b, t, ch), jnp.float32)
    for tap in range(kern):  # tap reads the token kern - 1 - tap before
        xs = jax.lax.dynamic_slice_in_dim(ext, tap, t, axis=1)
        ok = jax.lax.dynamic_slice_in_dim(dext, tap, t, axis=1) == d
        acc = acc + jnp.where(ok[..., None], xs.astype(jnp.float32) * w[tap].astype(jnp.float32), 0.0)
    y = jax.nn.silu(acc).astype(x.dtype)
    n_real = real.sum(axis=1)  # the next token's inputs: the kern - 1 before it in ext
    at = n_real[:, None] + jnp.arange(kern - 1)[None]
    new_state = jnp.take_along_axis(ext, at[..., None], axis=1)
    return y, new_state
