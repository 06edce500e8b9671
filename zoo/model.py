"""The zoo decoder: one Flax NNX module, driven by ModelConfig, scanning stacked layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.config import ModelConfig
from zoo.layers import (
    ACTIVATIONS,
    LoraDropout,
    attention,
    attention_mask,
    dense,
    mla_attention,
    mlp,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    soft_cap,
)
from zoo.moe import aux_losses, moe_mlp
from zoo.params import flatten, init_params, nest, param_specs


@dataclass(frozen=True)
class Segment:
    """``repeats`` consecutive copies of a block of layers of the given kinds, from layer ``start``."""

    start: int
    repeats: int
    kinds: tuple[str, ...]

    @property
    def stop(self) -> int:
        """One past the last layer of the segment."""
        return self.start + self.repeats * len(self.kinds)


def layer_segments(kinds: tuple[str, ...], max_period: int = 12) -> list[Segment]:
    """Cover the layer sequence with repeated blocks, greedily taking the block that covers most.

    Llama: one segment of L x (full). Gemma 2: (sliding, full) x L/2. Gemma 3
    with 26 layers: (5 sliding, full) x 4, then (sliding) x 2. Each segment is
    one scan whose body unrolls only its block, so the program size depends on
    the pattern, never on the depth.
    """
    out, i, n = [], 0, len(kinds)
    while i < n:
        best = Segment(i, 1, kinds[i : i + 1])
        for p in range(1, min(max_period, n - i) + 1):
            block = kinds[i : i + p]
            reps = 1
            while kinds[i + reps * p : i + (reps + 1) * p] == block:
                reps += 1
            if reps > 1 and reps * p > (best.stop - i):
                best = Segment(i, reps, block)
        out.append(best)
        i = best.stop
    return out


REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer
    # The weight matmuls' outputs: zoo.layers.dense names them (its custom VJP hides the dot itself).
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("dense")),
}


def forward(
    cfg: ModelConfig,
    params: dict[str, Any],
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    return_aux: bool = False,
    remat: str = "none",
    lora: dict[str, Any] | None = None,
    lora_scale: float | jax.Array | None = None,
    lora_dropout: float = 0.0,
    dropout_rng: jax.Array | None = None,
    return_hidden: bool = False,
    prefix_ids: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, dict]:
    """Logits [batch, seq, vocab] (float32) of the decoder for int tokens [batch, seq].

    ``segment_ids`` marks packed documents (attention never crosses a change
    of id; id 0 is padding); ``positions`` restart at each document. Both
    default to one document per row. With ``return_aux`` (MoE models) it also
    returns the router losses and statistics of :func:`zoo.moe.aux_losses`.
    ``remat`` trades compute for memory in training: "full" recomputes each
    layer in the backward pass, "save_dots" keeps only the weight matmuls'
    outputs (attention scores and elementwise work are recomputed).

    ``lora`` is a LoRA adapter tree keyed like ``params`` (see
    :func:`zoo.lora.init_lora`): each adapted projection adds
    ``lora_scale * (x @ A) @ B`` (``lora_scale`` from :func:`zoo.lora.lora_scale`)
    beside its base matmul. The adapters are scanned with their layers.

    ``lora_dropout`` (a Python float, so static under jit) with a ``dropout_rng``
    key applies LoRA dropout, for training: each adapter reads
    ``dropout(x)`` (every element of every token kept with probability
    1 - p and scaled by 1/(1 - p), a fresh mask per adapted projection and
    layer) while its base weight reads x. Without the key, or with p = 0,
    no dropout: the forward pass is the plain one (as for evaluation).

    With ``return_hidden`` it returns the final normed hidden states
    [batch, seq, hidden] in place of the logits (the head is then applied by
    the caller, e.g. :func:`zoo.loss.next_token_nll_sum` with
    :func:`head_weight`), so no [tokens, vocab] array need exist.

    ``prefix_ids`` [batch, seq] name, per token, one more segment whose
    earlier tokens it attends to (a shared prefix; see
    :func:`zoo.layers.attention_mask`); not for sliding-window models.
    """
    if lora is not None and lora_scale is None:
        raise ValueError("forward: lora adapters need lora_scale (zoo.lora.lora_scale(lora_cfg))")
    drop_keys = _dropout_keys(cfg, lora, lora_dropout, dropout_rng)
    b, t = tokens.shape
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rope_scale = rope_attention_factor(cfg.rope)
    ropes = {"full": rope_tables(positions, rope_inv_freq(cfg.rope, cfg.rope_dim), rope_scale)}
    masks = {"full": attention_mask(segment_ids, prefix_ids=prefix_ids)}
    if "sliding" in cfg.kinds:
        local = cfg.rope_local or cfg.rope
        ropes["sliding"] = rope_tables(positions, rope_inv_freq(local, cfg.rope_dim), rope_attention_factor(local))
        masks["sliding"] = attention_mask(segment_ids, cfg.sliding_window, prefix_ids)
    valid = segment_ids != 0
    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale:
        # transformers casts the normalizer to the embedding dtype first.
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)

    def norm(x: jax.Array, w: jax.Array) -> jax.Array:
        return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)

    def layer(x: jax.Array, p: dict, lp: dict | None, key: jax.Array | None, kind: str,
              moe: bool) -> tuple[jax.Array, dict]:
        window = cfg.sliding_window if kind == "sliding" else None
        drop = None if key is None else LoraDropout(lora_dropout, key)
        if cfg.mla:  # MLA has no adapters (zoo.lora)
            h = mla_attention(norm(x, p["attn_norm"]), p, *ropes[kind], masks[kind], cfg, window)
        else:
            h = attention(x, p, *ropes[kind], masks[kind], cfg, window, norm_w=p["attn_norm"], lora=lp,
                          lora_scale=lora_scale, drop=drop)
        if cfg.post_norms:
            h = norm(h, p["post_attn_norm"])
        x = x + h
        stats: dict = {}
        if moe:
            h, stats = moe_mlp(norm(x, p["mlp_norm"]), p, cfg, valid, lora=lp, lora_scale=lora_scale, drop=drop)
        else:
            h = mlp(x, p, cfg, norm_w=p["mlp_norm"], lora=lp, lora_scale=lora_scale, drop=drop)
        if cfg.post_norms:
            h = norm(h, p["post_mlp_norm"])
        return x + h, stats

    layer_stats = []
    for prefix, start, stop, moe in cfg.layer_groups:
        for seg in layer_segments(cfg.kinds[start:stop]):
            period = len(seg.kinds)
            # One stacked tree per position in the block (a strided slice; all of the stack when the
            # period is 1), so each layer's weights enter the scan body as scanned inputs themselves:
            # the backward pass then reads them from the parameters, not from a stacked copy.
            # The LoRA adapters (stacked like their weights) and the layers' dropout keys are sliced and
            # scanned the same way, so the scan body never indexes a stack.
            adapters = (lora or {}).get(prefix)
            keys = None if drop_keys is None or adapters is None else drop_keys[start:stop]
            stacked = [jax.tree.map(lambda a: a[seg.start + j : seg.stop : period],
                                    (params[prefix], adapters, keys))
                       for j in range(period)]

            def block(x: jax.Array, p: list, kinds: tuple[str, ...] = seg.kinds, moe: bool = moe):
                out = []
                for j, kind in enumerate(kinds):
                    x, st = layer(x, *p[j], kind, moe)
                    out.append(st)
                return x, jax.tree.map(lambda *a: jnp.stack(a), *out) if moe else None

            if remat != "none":
                block = jax.checkpoint(block, policy=REMAT_POLICIES[remat], prevent_cse=False)
            # One scan per segment: compile time does not grow with depth.
            x, ys = jax.lax.scan(block, x, stacked)
            if moe:
                layer_stats.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), ys))
    x = norm(x, params["final_norm"])
    logits = x if return_hidden else soft_cap(dense(x, head_weight(cfg, params), jnp.float32), cfg.final_softcap)
    if not return_aux:
        return logits
    if not layer_stats:
        return logits, {}
    stats = jax.tree.map(lambda *a: jnp.concatenate(a), *layer_stats)
    return logits, aux_losses(stats, cfg)


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
    which :mod:`zoo.sharding` maps to mesh axes.
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

    def param_dict(self) -> dict[str, Any]:
        """Parameters as a plain nested dict of arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, return_aux: bool = False):
        """Logits [batch, seq, vocab] for int32 tokens [batch, seq] (and router aux with ``return_aux``)."""
        return _jit_forward(self.cfg, self.param_dict(), tokens, segment_ids, positions, return_aux)


_jit_forward = jax.jit(forward, static_argnums=(0, 5))
