"""Batched greedy generation equals one-prompt-at-a-time greedy generation; exact-match scoring."""

import jax
import numpy as np
import pytest
from flax import nnx

from eval.exact_match import Scored, accuracy, chat_prompts
from eval.generate import greedy_batch
from zoo.model.config import ModelConfig
from zoo.model.decoder import Decoder

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.mark.slow
def test_batched_greedy_equals_one_at_a_time():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    model = Decoder(CFG, jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, model.param_dict()))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 64, n).tolist() for n in (3, 11, 7, 1)]
    one = [greedy_batch(model, [p], 6)[0] for p in prompts]
    assert len({tuple(x) for x in one}) > 1  # the prompts lead to different continuations
    assert greedy_batch(model, prompts, 6) == one
    # Stopping: a row ends right after its first EOS, the others go on.
    eos = one[1][2]
    got = greedy_batch(model, prompts, 6, {eos})
    for g, o in zip(got, one):
        assert g == (o[:o.index(eos) + 1] if eos in o else o)


def test_exact_match_scoring():
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a | b"}]}]
    (conv, ref), = chat_prompts(rows)
    assert [m["role"] for m in conv] == ["system", "user"] and ref == "a | b"
    scored = [Scored("q", "a | b", " a | b\nmore"), Scored("q", "a | b", "a|b")]
    assert [s.correct for s in scored] == [True, False] and accuracy(scored) == 0.5
