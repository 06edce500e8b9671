"""Named tensor transforms between Hugging Face layouts and zoo layouts.

Each transform has a forward (HF tensor -> one layer's zoo tensor) and an
inverse (for export). They are referenced by name from the mapping tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from zoo.model.config import ModelConfig

Fn = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclass(frozen=True)
class Transform:
    """A layout change and its inverse."""

    forward: Fn
    inverse: Fn


def _heads_in(kind: str) -> Transform:
    """Linear [heads*head_dim, embed] (torch out x in) <-> zoo [embed, heads, head_dim]."""

    def n(cfg: ModelConfig) -> int:
        return cfg.num_heads if kind == "q" else cfg.num_kv_heads

    return Transform(
        forward=lambda w, cfg: w.reshape(n(cfg), cfg.head_dim, w.shape[-1]).transpose(2, 0, 1),
        inverse=lambda w, cfg: w.transpose(1, 2, 0).reshape(n(cfg) * cfg.head_dim, w.shape[0]),
    )


def _bias_heads(kind: str) -> Transform:
    """Bias [heads*head_dim] <-> [heads, head_dim]."""

    def n(cfg: ModelConfig) -> int:
        return cfg.num_heads if kind == "q" else cfg.num_kv_heads

    return Transform(
        forward=lambda b, cfg: b.reshape(n(cfg), cfg.head_dim),
        inverse=lambda b, cfg: b.reshape(-1),
    )


def _gguf_unpermute(kind: str) -> Transform:
    """llama.cpp stores q/k rows interleaved for its RoPE; undo (and redo) that permutation."""

    def n(cfg: ModelConfig) -> int:
        return cfg.num_heads if kind == "q" else cfg.num_kv_heads

    def fwd(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        h = n(cfg)
        return w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def inv(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        h = n(cfg)
        return w.reshape(h, 2, w.shape[0] // h // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return Transform(fwd, inv)


def _compose(*names: str) -> Transform:
    ts = [TRANSFORMS[n] for n in names]

    def fwd(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        for t in ts:
            x = t.forward(x, cfg)
        return x

    def inv(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        for t in reversed(ts):
            x = t.inverse(x, cfg)
        return x

    return Transform(fwd, inv)


TRANSFORMS: dict[str, Transform] = {
    "identity": Transform(lambda x, cfg: x, lambda x, cfg: x),
    # torch Linear weights are [out, in]; zoo matmuls take [in, out].
    "transpose": Transform(lambda w, cfg: w.T, lambda w, cfg: w.T),
    "q_in": _heads_in("q"),
    "kv_in": _heads_in("kv"),
    # o_proj [embed, heads*head_dim] <-> zoo [heads, head_dim, embed]
    "o_out": Transform(
        lambda w, cfg: w.T.reshape(cfg.num_heads, cfg.head_dim, w.shape[0]),
        lambda w, cfg: w.reshape(-1, w.shape[-1]).T,
    ),
    "q_bias": _bias_heads("q"),
    "kv_bias": _bias_heads("kv"),
    "gguf_unpermute_q": _gguf_unpermute("q"),
    "gguf_unpermute_k": _gguf_unpermute("kv"),
    # llama.cpp stores an RMSNorm weight as the factor it multiplies by: Gemma's (1 + w) is written as
    # w + 1 (every *norm.weight, Gemma 3's q/k norms included), while the zoo keeps w with norm_offset.
    "gguf_norm": Transform(lambda w, cfg: w - np.float32(cfg.norm_offset),
                           lambda w, cfg: w + np.float32(cfg.norm_offset)),
}
def _rope_perm(cfg: ModelConfig) -> np.ndarray:
    """DeepSeek checkpoints interleave RoPE pairs; the zoo keeps them rotate-half ordered."""
    dr = cfg.qk_rope_head_dim
    if not cfg.hf_rope_interleave:
        return np.arange(dr)
    return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])


def _mla_q() -> Transform:
    """q_proj / q_b_proj [heads*(nope+rope), in] <-> [in, heads, nope+rope], RoPE rows de-interleaved."""

    def fwd(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        dn = cfg.qk_nope_head_dim
        w = w.reshape(cfg.num_heads, -1, w.shape[-1])
        w = np.concatenate([w[:, :dn], w[:, dn:][:, _rope_perm(cfg)]], axis=1)
        return w.transpose(2, 0, 1)

    def inv(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        dn = cfg.qk_nope_head_dim
        w = w.transpose(1, 2, 0)
        w = np.concatenate([w[:, :dn], w[:, dn:][:, np.argsort(_rope_perm(cfg))]], axis=1)
        return w.reshape(-1, w.shape[-1])

    return Transform(fwd, inv)


def _mla_kv_a() -> Transform:
    """kv_a_proj_with_mqa [rank+rope, embed] <-> [embed, rank+rope], RoPE rows de-interleaved."""

    def fwd(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        r = cfg.kv_lora_rank
        return np.concatenate([w[:r], w[r:][_rope_perm(cfg)]], axis=0).T

    def inv(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        r = cfg.kv_lora_rank
        w = w.T
        return np.concatenate([w[:r], w[r:][np.argsort(_rope_perm(cfg))]], axis=0)

    return Transform(fwd, inv)


TRANSFORMS["mla_q_in"] = _mla_q()
TRANSFORMS["mla_kv_a_in"] = _mla_kv_a()
# kv_b_proj [heads*(nope+v), rank] <-> [rank, heads, nope+v]
TRANSFORMS["mla_kv_b_in"] = Transform(
    lambda w, cfg: w.reshape(cfg.num_heads, -1, w.shape[-1]).transpose(2, 0, 1),
    lambda w, cfg: w.transpose(1, 2, 0).reshape(-1, w.shape[0]),
)
# o_proj [embed, heads*v] <-> [heads, v, embed]
TRANSFORMS["mla_o_out"] = Transform(
    lambda w, cfg: w.T.reshape(cfg.num_heads, cfg.v_head_dim, w.shape[0]),
    lambda w, cfg: w.reshape(-1, w.shape[-1]).T,
)
# A stack of expert weights [experts, out, in] (llama.cpp's ffn_*_exps) <-> zoo [experts, in, out].
TRANSFORMS["experts_transpose"] = Transform(lambda w, cfg: w.swapaxes(-1, -2), lambda w, cfg: w.swapaxes(-1, -2))
# A stack of torch Linear weights [experts, out, in] (llama.cpp's *_exps) <-> the zoo's [experts, in, out].
TRANSFORMS["swap_last"] = Transform(lambda w, cfg: w.swapaxes(-1, -2), lambda w, cfg: w.swapaxes(-1, -2))
TRANSFORMS["gguf_q_in"] = _compose("gguf_unpermute_q", "q_in")
TRANSFORMS["gguf_k_in"] = _compose("gguf_unpermute_k", "kv_in")
# Llama 4's q/k rows pair RoPE's dimensions as llama.cpp's do (its RoPE turns interleaved pairs): the same transforms.
TRANSFORMS["rope_pairs_q_in"] = TRANSFORMS["gguf_q_in"]
TRANSFORMS["rope_pairs_k_in"] = TRANSFORMS["gguf_k_in"]


def _global(name: str) -> Transform:
    """Transform ``name`` of a Gemma 4 full layer: with that kind's head_dim and kv heads (zoo.model.layer_layout)."""
    from zoo.model.layer_layout import kind_config

    t = TRANSFORMS[name]
    return Transform(lambda w, cfg: t.forward(w, kind_config(cfg, "full")),
                     lambda w, cfg: t.inverse(w, kind_config(cfg, "full")))


TRANSFORMS["global_q_in"] = _global("q_in")
TRANSFORMS["global_kv_in"] = _global("kv_in")
TRANSFORMS["global_o_out"] = _global("o_out")


def _tower(name: str) -> Transform:
    """Transform ``name`` of a vision tower's attention: with the tower's heads and key/value heads."""
    import dataclasses

    def tower(cfg: ModelConfig) -> ModelConfig:
        v = cfg.vision
        assert v is not None, "a vision transform on a model without a vision tower"
        return dataclasses.replace(cfg, num_heads=v.num_heads, num_kv_heads=v.kv_heads, head_dim=v.head_dim)

    t = TRANSFORMS[name]
    return Transform(lambda w, cfg: t.forward(w, tower(cfg)), lambda w, cfg: t.inverse(w, tower(cfg)))


TRANSFORMS["vq_in"] = _tower("q_in")
TRANSFORMS["vo_out"] = _tower("o_out")
TRANSFORMS["vq_bias"] = _tower("q_bias")
TRANSFORMS["vkv_in"] = _tower("kv_in")  # Gemma 4's tower: its own key/value heads (GQA)
# A scalar tensor (Gemma 4's clip bounds) <-> a one-element vector: each layer's slice of a stacked [L, 1] weight.
TRANSFORMS["scalar"] = Transform(lambda w, cfg: w.reshape(1), lambda w, cfg: w.reshape(()))


def _conv_patch_inverse(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    assert cfg.vision is not None, "a vision transform on a model without a vision tower"
    p = cfg.vision.patch_size
    return w.T.reshape(w.shape[1], -1, p, p)


# A conv patch embedding [D, C, p, p] <-> the zoo's [C * p * p, D]: the host flattens each patch in the same
# (channel, row, column) order (zoo.data.vision_layout), so the conv is one matmul.
TRANSFORMS["conv_patch"] = Transform(lambda w, cfg: w.reshape(w.shape[0], -1).T, _conv_patch_inverse)


def _vqkv_in(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A tower's fused qkv Linear [3 * D, D] -> [D, 3, heads, head_dim] (Qwen2.5-VL)."""
    assert cfg.vision is not None, "a vision transform on a model without a vision tower"
    return w.reshape(3, cfg.vision.num_heads, cfg.vision.head_dim, w.shape[-1]).transpose(3, 0, 1, 2)


def _conv3d_patch_inverse(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    v = cfg.vision
    assert v is not None, "a vision transform on a model without a vision tower"
    return w.T.reshape(w.shape[1], v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size)


TRANSFORMS["vqkv_in"] = Transform(_vqkv_in, lambda w, cfg: w.transpose(1, 2, 3, 0).reshape(-1, w.shape[0]))
TRANSFORMS["vqkv_bias"] = Transform(lambda b, cfg: _vqkv_in(b[:, None], cfg)[0], lambda b, cfg: b.reshape(-1))
# Qwen2.5-VL's conv3d patch embedding [D, C, T, p, p] <-> [C * T * p * p, D]: the processor flattens each patch in
# the same (channel, frame, row, column) order.
TRANSFORMS["conv3d_patch"] = Transform(lambda w, cfg: w.reshape(w.shape[0], -1).T, _conv3d_patch_inverse)


def _linear_heads(keys: bool) -> Transform:
    """Qwen3-Next's linear layers: a Linear [heads * dim, embed] <-> [embed, heads, dim], by its key heads (q, k)
    or value heads (v, z)."""
    def hd(cfg: ModelConfig) -> tuple[int, int]:
        if keys:
            return cfg.linear_key_heads, cfg.linear_key_head_dim
        return cfg.linear_value_heads, cfg.linear_value_head_dim

    return Transform(lambda w, cfg: w.reshape(*hd(cfg), w.shape[-1]).transpose(2, 0, 1),
                     lambda w, cfg: w.transpose(1, 2, 0).reshape(-1, w.shape[0]))


TRANSFORMS["lin_k_in"] = _linear_heads(True)
TRANSFORMS["lin_v_in"] = _linear_heads(False)
# out_proj [embed, value heads * v_dim] <-> [value heads, v_dim, embed]
TRANSFORMS["lin_out"] = Transform(
    lambda w, cfg: w.T.reshape(cfg.linear_value_heads, cfg.linear_value_head_dim, w.shape[0]),
    lambda w, cfg: w.reshape(-1, w.shape[-1]).T)
# llama.cpp's ssm_a: the decay rate -exp(A_log) it stores in place of A_log (float32: exp and log round).
TRANSFORMS["neg_exp"] = Transform(lambda w, cfg: np.log(-w.astype(np.float32)).astype(w.dtype),
                                  lambda w, cfg: -np.exp(w.astype(np.float32)).astype(w.dtype))
# A depthwise Conv1d's weight [channels, 1, kernel] <-> the zoo's taps [kernel, channels].
TRANSFORMS["conv_taps"] = Transform(lambda w, cfg: w[:, 0, :].T, lambda w, cfg: w.T[:, None, :])


def hf_shape(transform: str, piece: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """The shape of the HF tensor that a zoo piece of shape ``piece`` comes from through ``transform`` (computed
    on a zero-stride array: no memory)."""
    empty = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), piece, (0,) * len(piece))
    return tuple(TRANSFORMS[transform].inverse(empty, cfg).shape)
# DeepSeek-V3.2's indexer wq_b [index_heads*index_dim, q_lora_rank] <-> [q_lora_rank, index_heads, index_dim]
TRANSFORMS["index_q_in"] = Transform(
    lambda w, cfg: w.reshape(cfg.index_n_heads, cfg.index_head_dim, w.shape[-1]).transpose(2, 0, 1),
    lambda w, cfg: w.transpose(1, 2, 0).reshape(-1, w.shape[0]),
)
