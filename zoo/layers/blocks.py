"""Custom-VJP building blocks of the decoder: activations, matmul, RMSNorm, fused norm + matmul, GLU.

Each block is mathematically the plain JAX expression it names; what it adds
is a hand-written backward pass that keeps fewer activations (or transposes
the cheaper operand) than autodiff would, since activation memory and
strided copies are what bound the training step on the CPU. Matmul outputs
are named "dense" so that :func:`jax.checkpoint` policies can save them (a
custom VJP hides the dot inside from the usual dot-based policies).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zoo.model.quant import QuantizedWeight, materialize, zero_cotangent

# transformers' ``hidden_act`` names -> the activation; gelu_pytorch_tanh and gelu_new are the tanh approximation.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}


def dense(x: jax.Array, w: jax.Array, out_dtype: Any = None, contract: int = 1) -> jax.Array:
    """x [..., K] @ w [K, N] (accumulated and returned in ``out_dtype`` when given), with a backward
    pass laid out for XLA:CPU's fast matmul kernels (see :func:`_dense`).

    The weight may keep its stored shape: its first ``contract`` axes make K and
    the rest N (q's [embed, heads, head_dim] is K=embed, N=heads*head_dim), so
    inside a layer scan the backward pass reads the parameter itself rather than
    a stacked copy of a reshaped one. The output is [..., N] and is named "dense"
    for :func:`jax.checkpoint` policies (``remat: save_dots`` saves exactly
    these), since the matmul inside a custom VJP is invisible to them.
    """
    return checkpoint_name(_dense(x, w, out_dtype, contract), "dense")


def _matrix(w: jax.Array, contract: int) -> jax.Array:
    """w as a [K, N] matrix: its first ``contract`` axes flattened into K, the rest into N."""
    return w.reshape(math.prod(w.shape[:contract]), -1)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x: jax.Array, w: jax.Array, out_dtype: Any = None, contract: int = 1) -> jax.Array:
    """x @ w, with a hand-written backward pass.

    The weight gradient contracts over every token, the leading axis of both
    x and the output gradient, so one of them has to be transposed; left to
    itself XLA often transposes the larger one and fuses that transpose into
    the elementwise work that produced it (slow strided writes). Here the
    smaller operand is transposed, as a plain copy, and the result is pinned
    with an optimization barrier so XLA cannot fold the choice back.
    Mathematically this is exactly ``x @ w``.
    """
    return jnp.einsum("...k,kn->...n", x, _matrix(materialize(w), contract), preferred_element_type=out_dtype)


def _dense_fwd(x: jax.Array, w: jax.Array, out_dtype: Any, contract: int) -> tuple[jax.Array, tuple]:
    """x @ w, keeping x and the stored (unreshaped) w for the backward pass: a QLoRA base weight
    (:class:`zoo.model.quant.QuantizedWeight`) is kept quantized and dequantized again there."""
    return _dense(x, w, out_dtype, contract), (x, w)


def _dense_bwd(out_dtype: Any, contract: int, res: tuple[jax.Array, jax.Array],
               g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of x @ w for output gradient g, transposing the smaller of x and g for dw."""
    x, w_stored = res
    if isinstance(w_stored, QuantizedWeight):  # a frozen QLoRA base: dx only, from the re-dequantized weight
        w = _matrix(materialize(w_stored), contract)
        dx = jnp.einsum("...n,kn->...k", g.astype(jnp.promote_types(x.dtype, w.dtype)), w).astype(x.dtype)
        return dx, zero_cotangent(w_stored)
    w = _matrix(w_stored, contract)
    k, n = w.shape
    g = g.astype(jnp.promote_types(x.dtype, w.dtype))
    dx = jnp.einsum("...n,kn->...k", g, w).astype(x.dtype)
    x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
    if k <= n:
        dw = jnp.einsum("tk,tn->kn", x2, g2)  # XLA transposes the first operand: x, the smaller
    else:
        dw = jax.lax.optimization_barrier(jnp.einsum("tn,tk->nk", g2, x2)).T
    return dx, dw.reshape(w_stored.shape).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense_unnamed(x: jax.Array, w: jax.Array) -> jax.Array:
    """:func:`dense` (same backward pass) without the "dense" name, for products a ``remat: save_dots``
    checkpoint should recompute rather than keep (a LoRA adapter's wide B output: see
    :func:`zoo.lora.projections.lora_out`)."""
    return _dense(x, w, None, 1)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm scaled by (offset + weight), computed in float32 (as transformers does), cast back.

    ``offset`` 1.0 is Gemma's ``x * (1 + w)``; 0.0 is Llama's ``w * x``. The
    backward pass keeps only x and the per-row 1/rms (autodiff would also keep
    the float32 normalized x, one more [tokens, embed] array per norm).
    """
    return _rms_norm(x, weight, eps, offset)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm (mean and biased variance over the last axis) scaled by ``weight`` plus ``bias``, computed in
    float32 and cast back (the vision towers' norm: SigLIP's)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """Per-row 1/rms of x [..., 1], in float32."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def _normalize(x: jax.Array, norm_w: jax.Array, r: jax.Array, offset: float) -> jax.Array:
    """(offset + w) * x / rms(x), computed in float32 and cast back to x's dtype."""
    return ((offset + norm_w.astype(jnp.float32)) * (x.astype(jnp.float32) * r)).astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
    """The custom-VJP core of :func:`rms_norm`."""
    return _rms_norm_fwd(x, weight, eps, offset)[0]


def _rms_norm_fwd(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> tuple[jax.Array, tuple]:
    """The normed x, and the residuals (x, weight, per-row 1/rms): not the float32 normed x."""
    r = _inv_rms(x, eps)
    return _normalize(x, weight, r, offset), (x, weight, r)


def _rms_norm_bwd(eps: float, offset: float, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx, dweight) for output gradient g, recomputing the normed x from x and 1/rms."""
    x, weight, r = res
    n = x.astype(jnp.float32) * r
    gf = g.astype(jnp.float32)
    dw = jnp.sum((gf * n).reshape(-1, n.shape[-1]), axis=0).reshape(weight.shape)
    dn = gf * (offset + weight.astype(jnp.float32))
    dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def normed_dense(x: jax.Array, norm_w: jax.Array, ws: tuple[jax.Array, ...], eps: float,
                 offset: float = 0.0) -> tuple[jax.Array, ...]:
    """``dense(rms_norm(x, norm_w), w)`` for each w in ws (q/k/v, or gate/up), sharing one norm.

    Separately, each :func:`dense` would keep the normalized x for its
    backward pass: one more [tokens, embed] array per norm and layer. Here the
    backward pass recomputes it from x and the per-row 1/rms instead (cheap
    elementwise work), so only x is kept, which the residual stream keeps anyway.
    """
    return tuple(checkpoint_name(y, "dense") for y in _normed_dense(x, norm_w, tuple(ws), eps, offset))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normed_dense(x: jax.Array, norm_w: jax.Array, ws: tuple[jax.Array, ...], eps: float,
                  offset: float) -> tuple[jax.Array, ...]:
    """The custom-VJP core of :func:`normed_dense`."""
    return _normed_dense_fwd(x, norm_w, ws, eps, offset)[0]


def _normed_dense_fwd(x: jax.Array, norm_w: jax.Array, ws: tuple[jax.Array, ...], eps: float,
                      offset: float) -> tuple[tuple[jax.Array, ...], tuple]:
    """The products, and the residuals: x, the norm weight, 1/rms and the weights (not the normed x)."""
    r = _inv_rms(x, eps)
    n = _normalize(x, norm_w, r, offset)
    return tuple(_dense(n, w, None, 1) for w in ws), (x, norm_w, r, ws)


def _normed_dense_bwd(eps: float, offset: float, res: tuple,
                      gs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """(dx, dnorm_w, dws): the normed x recomputed once, its gradient summed over the weights."""
    x, norm_w, r, ws = res
    n = _normalize(x, norm_w, r, offset)
    dn: jax.Array | None = None
    dws = []
    for w, g in zip(ws, gs):
        dn_w, dw = _dense_bwd(None, 1, (n, w), g)
        dn = dn_w if dn is None else dn + dn_w
        dws.append(dw)
    assert dn is not None, "normed_dense needs at least one weight"
    dx, dnorm = _rms_norm_bwd(eps, offset, (x, norm_w, r), dn)
    return dx, dnorm, tuple(dws)


_normed_dense.defvjp(_normed_dense_fwd, _normed_dense_bwd)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def glu_down(gate: jax.Array, up: jax.Array, w: jax.Array, act: str) -> jax.Array:
    """(act(gate) * up) @ w, keeping only gate and up for the backward pass (see :func:`glu_dense`)."""
    return glu_dense(gate, up, (w,), act)[0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def glu_dense(gate: jax.Array, up: jax.Array, ws: tuple[jax.Array, ...], act: str) -> tuple[jax.Array, ...]:
    """(act(gate) * up) @ w for each w in ws (the down weight, and its LoRA A), keeping only gate and up.

    Autodiff would store act(gate), its derivative's terms and the product as
    well: three more [tokens, mlp] arrays per layer. Recomputing them in the
    backward pass is cheap elementwise work, and the smaller activation
    memory is what the CPU step is bound by.
    """
    h = ACTIVATIONS[act](gate) * up
    return tuple(dense(h, w) for w in ws)


def _glu_dense_fwd(gate: jax.Array, up: jax.Array, ws: tuple[jax.Array, ...],
                   act: str) -> tuple[tuple[jax.Array, ...], tuple]:
    """The products, and the residuals gate, up and the weights (not act(gate) * up)."""
    return glu_dense(gate, up, ws, act), (gate, up, ws)


def _glu_dense_bwd(act: str, res: tuple,
                   gs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """(dgate, dup, dws), recomputing act(gate) * up and its VJP from gate and up."""
    gate, up, ws = res
    h, glu_vjp = jax.vjp(lambda a, b: ACTIVATIONS[act](a) * b, gate, up)
    dh, dws = None, []
    for w, g in zip(ws, gs):
        dh_w, dw = _dense_bwd(None, 1, (h, w), g)
        dh = dh_w if dh is None else dh + dh_w
        dws.append(dw)
    return (*glu_vjp(dh), tuple(dws))


glu_dense.defvjp(_glu_dense_fwd, _glu_dense_bwd)
