"""Several LoRA adapters over one base in one batch (zoo.lora.rows): each row's logits through the per-row path
equal that row's through the single-adapter path (zoo.lora.weights.Weights with one adapter tree, whose logits
tests/test_lora.py checks against peft) or the base alone."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lora_fixtures import lora_base_params
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, init_lora, lora_scale
from zoo.lora.rows import stack_adapters
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decode import forward_step, init_cache
from zoo.model.decoder import forward

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
CFG = ModelConfig(family="llama", **TINY)
# Gemma 2: (sliding, full) blocks, so the per-row adapters are sliced with period 2 like their weights (the window,
# 3, shorter than the prompt), (1 + w) norms, post norms and soft-caps.
GEMMA2 = ModelConfig(family="gemma2", **TINY, norm_offset=1.0, embed_scale=True, post_norms=True,
                     hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=8, attn_softcap=4.0, final_softcap=6.0,
                     sliding_window=3, tie_word_embeddings=True, layer_types=("sliding", "full"))
# Different ranks, scales and targets: A1 every projection (o contracts two axes; q/k/v and gate/up fused with
# their norm in the single-adapter path), A2 three of them at a smaller rank, padded to A1's where both adapt.
A1 = LoraConfig(rank=4, alpha=8.0)
A2 = LoraConfig(rank=2, alpha=6.0, targets=["q_proj", "v_proj", "down_proj"])
PROMPT, ROWS = 6, (1, 0, 2)  # rows: adapter A1, the base, adapter A2


def _random_adapters(cfg: ModelConfig, lc: LoraConfig, seed: int) -> dict:
    """init_lora's tree for ``lc`` with every A and B random (a zero B would hide most mistakes), drawn in NumPy."""
    rng = np.random.RandomState(seed)
    shapes = jax.eval_shape(lambda: init_lora(cfg, lc, jax.random.key(0)))
    return jax.tree.map(lambda a: jax.device_put(rng.normal(0, 0.3, a.shape).astype(np.float32)), shapes)


# Gemma 2's case (about 6 s: softcaps and its own programs) in the full suite; Llama's in the fast lane too.
@pytest.mark.parametrize("cfg", [CFG, pytest.param(GEMMA2, marks=pytest.mark.slow)], ids=["llama", "gemma2"])
def test_rows_equal_each_adapter_alone(cfg):
    """A batch of 3 rows with adapters [A1, none, A2] through forward_step (a fresh prefill, then one decode step)
    and through the training forward (zoo.model.decoder.forward) gives each row the logits the single-adapter
    Weights (or the base alone) give it: float32, max-abs <= 1e-5. The three references differ from each other
    by far more than that in every row, so a row given another's adapter (or none) fails."""
    base = lora_base_params(cfg)
    trees = [_random_adapters(cfg, A1, 1), _random_adapters(cfg, A2, 2)]
    scales = [lora_scale(A1), lora_scale(A2)]
    stack = stack_adapters(cfg, list(zip(trees, scales)))
    seqs = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (3, PROMPT + 1)).astype(np.int32))

    # The references: the whole batch under each single-adapter Weights (and the base), one row of each kept.
    ref_fwd = jax.jit(partial(forward, cfg))
    refs = np.stack([np.asarray(ref_fwd(w, seqs)) for w in
                     (Weights(base), Weights(base, trees[0], scales[0]), Weights(base, trees[1], scales[1]))])
    want = refs[list(ROWS), [0, 1, 2]]  # [3 rows, PROMPT + 1, vocab]
    for r in range(3):
        others = np.delete(refs[:, r], ROWS[r], axis=0)
        assert np.abs(others - want[r]).max(axis=(1, 2)).min() > 1e-3  # a wrong adapter shows

    w = stack.weights(base, jnp.asarray(ROWS))
    assert stack.count == 3
    logits, cache = jax.jit(partial(forward_step, cfg, fresh=True))(w, seqs[:, :PROMPT], init_cache(cfg, 3, 16))
    np.testing.assert_allclose(np.asarray(logits), want[:, :PROMPT], atol=1e-5, rtol=0)
    logits, cache = jax.jit(partial(forward_step, cfg))(w, seqs[:, PROMPT:], cache)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], want[:, PROMPT], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ref_fwd(w, seqs)), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tree, match", [
    ({"layers": {"expert_gate": {"a": np.zeros((2, 32, 2)), "b": np.zeros((2, 2, 64))}}},
     "adapter 1 adapts layers.expert_gate, an MoE expert weight"),
    ({"layers": {"shared_down": {"a": np.zeros((2, 64, 2)), "b": np.zeros((2, 2, 32))}}}, "MoE expert weight"),
    ({"vision": {"layers": {"q": {"a": np.zeros((2, 32, 2)), "b": np.zeros((2, 2, 32))}}}},
     "adapter 1 adapts vision.layers.q, in the image tower"),
    ({"projector": {"proj": {"a": np.zeros((32, 2)), "b": np.zeros((2, 32))}}}, "image tower or connector"),
    ({"score": np.zeros((32, 1))}, "adapter 1 trains score whole"),
    ({"layers": {"q": {"a": np.zeros((2, 16, 2)), "b": np.zeros((2, 2, 4, 8))}}}, "adapter 1's layers.q is A"),
    ({"layers": {"nope": {"a": np.zeros((2, 32, 2)), "b": np.zeros((2, 2, 32))}}}, "no layer weight"),
])
def test_stack_refuses_what_rows_cannot_serve(tree, match):
    """stack_adapters refuses, in one line naming the adapter and the weight, the adapters per-row serving
    cannot apply: MoE experts' (routed, shared), an image tower's or connector's, a weight trained whole, and
    adapters that do not fit the model."""
    ok = {"layers": {"q": {"a": np.zeros((2, 32, 2)), "b": np.zeros((2, 2, 4, 8))}}}
    with pytest.raises(UserError, match=match):
        stack_adapters(CFG, [(ok, 1.0), (tree, 1.0)])
