"""Tiny random-weight Hugging Face models and the parity metrics the tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def make_llama(folder: Path, seed: int = 0, dtype=None, save_kwargs=None, **overrides):
    """Save a tiny random LlamaForCausalLM (transformers' own config class) to ``folder``.

    ``dtype`` (a torch dtype) casts the saved weights; ``save_kwargs`` go to save_pretrained.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    # Larger-than-default weights give peaked distributions, so KL and argmax
    # comparisons actually discriminate.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **(save_kwargs or {}))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' fp32 logits for int tokens [batch, seq]."""
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax in float64."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(got))."""
    lp, lq = log_softmax(ref), log_softmax(got)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def random_tokens(vocab: int, batch: int = 2, seq: int = 48, seed: int = 0) -> np.ndarray:
    """Random int32 token ids."""
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq)).astype(np.int32)
