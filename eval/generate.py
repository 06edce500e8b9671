"""Greedy generation with a zoo model (fixed-size buffer: one compilation)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zoo.checkpoint import TOKENIZER_DIR
from zoo.errors import UserError
from zoo.model import forward


def load_tokenizer(ckpt: str | Path):
    """The tokenizer stored in a zoo checkpoint."""
    from transformers import AutoTokenizer

    folder = Path(ckpt) / TOKENIZER_DIR
    if not folder.is_dir():
        raise UserError(f"{ckpt} has no {TOKENIZER_DIR}/ folder; convert it from a source with tokenizer files")
    return AutoTokenizer.from_pretrained(str(folder))


def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int] = frozenset()) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (returns only the new tokens).

    Runs the full forward pass on a fixed-length buffer each step; a KV-cache
    decoder replaces this in the evaluation stack.
    """
    n = len(prompt_ids)
    total = n + max_new_tokens
    buf = np.zeros((1, total), np.int32)
    buf[0, :n] = prompt_ids
    params = model.param_dict()
    step = jax.jit(lambda p, t, i: jnp.argmax(forward(model.cfg, p, t)[0, i - 1]))
    out: list[int] = []
    for i in range(n, total):
        nxt = int(step(params, jnp.asarray(buf), i))
        out.append(nxt)
        if nxt in eos_ids:
            break
        buf[0, i] = nxt
    return out


def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int] = frozenset(),
                 pad_id: int = 0) -> list[list[int]]:
    """Greedy continuations of several prompts at once (each returned without its prompt, cut after EOS).

    Rows are right-padded into one fixed buffer, so every step is one forward
    pass over the whole batch and the program compiles once; each row reads the
    logits at its own last position (attention is causal, so the padding to
    its right changes nothing).
    """
    lengths = np.asarray([len(p) for p in prompts])
    total = int(lengths.max()) + max_new_tokens
    buf = np.full((len(prompts), total), pad_id, np.int32)
    for r, p in enumerate(prompts):
        buf[r, :len(p)] = p
    params = model.param_dict()
    step = jax.jit(lambda p, t, i: jnp.argmax(jnp.take_along_axis(forward(model.cfg, p, t), i[:, None, None] - 1,
                                                                  axis=1)[:, 0], axis=-1))
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    for k in range(max_new_tokens):
        nxt = np.asarray(step(params, jnp.asarray(buf), jnp.asarray(lengths + k)))
        for r in np.flatnonzero(~done):
            out[r].append(int(nxt[r]))
            done[r] = int(nxt[r]) in eos_ids
            buf[r, lengths[r] + k] = nxt[r]
        if done.all():
            break
    return out


def chat_completion(ckpt: str | Path, prompt: str, max_new_tokens: int = 48) -> str:
    """Apply the checkpoint's chat template to one user turn and return the greedy reply."""
    import zoo

    tok = load_tokenizer(ckpt)
    model = zoo.load(ckpt, dtype=np.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    new = greedy(model, list(ids), max_new_tokens, eos)
    return tok.decode(new, skip_special_tokens=True)
