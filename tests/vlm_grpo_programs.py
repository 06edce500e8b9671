"""GRPO's device programs (grpo/programs.py) on a tiny vision-language model, outside a run: TRL's VLM prompt rows
read as `grpo train` reads them (grpo/vision.py's ``ImagePrompts``: the ids, the patch budget, each step's patches),
completed by the run's sampler (the inference engine) and scored by the update's pass (one compiled program); and
transformers' per-token log-probabilities of a completion, the oracle both are checked against.

A helper like tests/vlm_models.py; no test module imports another."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

G, T = 2, 4  # completions a prompt, tokens a completion


def grpo_draws(ckpt: Path, rows: list[dict[str, Any]], path: Path, seq_len: int = 64,
               layouts: tuple[bool, ...] = (True, False)) -> SimpleNamespace:
    """The prompts of ``rows`` (read from the data file ``path``) completed G times each by `grpo train`'s sampler
    (step 1, temperature 1) on the checkpoint ``ckpt``, and the completions scored by the update's pass in each of
    ``layouts`` (grouped: a group's prompt once in its row, grpo.share_prompt; else one row a completion). Returns
    ``ids`` (each prompt's token ids), ``completions`` (per completion row, cut at its length), ``sampler`` and
    ``update`` ({grouped: ...}) per-token log-probabilities of each completion row's tokens."""
    import jax
    import jax.numpy as jnp

    import zoo
    from grpo.batch import UpdateRows
    from grpo.config import GRPOConfig
    from grpo.programs import Programs
    from grpo.vision import ImagePrompts
    from pretrain.batch import VisionBatch
    from pretrain.config import load_config
    from pretrain.setup import run_mesh
    from zoo.data.tokenizer import load_tokenizer

    mcfg, params, tok = zoo.read_config(ckpt), zoo.load_params(ckpt), load_tokenizer(ckpt)
    assert mcfg.vision is not None
    images = ImagePrompts(mcfg.vision, mcfg.family, lambda: ckpt / "tokenizer", "prompt", None, 1)
    render = lambda messages: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # noqa: E731
    ids = [images.prompt_ids(row, tok, render, str(path), i) for i, row in enumerate(rows)]
    order = [i for i in range(len(rows)) for _ in range(G)]  # a group's rows: one prompt
    b, p = len(order), seq_len + 1
    tokens, seg = np.zeros((1, b, p), np.int32), np.zeros((1, b, p), np.int32)
    for r, i in enumerate(order):
        tokens[0, r, :len(ids[i])], seg[0, r, :len(ids[i])] = ids[i], 1
    laid = images.patches(str(path), dict(enumerate(rows)), order, tok)
    assert laid is not None
    vision = VisionBatch(**{k: jnp.asarray(a.reshape((1,) + a.shape)) for k, a in laid.items()})
    cfg = load_config(None, [f"model.path={ckpt}", f"data.path={path}", f"data.seq_len={seq_len}", f"batch_size={b}",
                             f"grpo.num_generations={G}", f"grpo.max_completion_length={T}", "max_steps=1",
                             "grpo.rewards=[final_number]", f"output_dir={path.parent}"],
                      GRPOConfig)
    mesh = run_mesh(cfg, jax.devices()[:1])
    programs = {grouped: Programs(cfg, mcfg, mesh, jnp.float32, (tok.eos_token_id,), UpdateRows(grouped, G, p, T))
                for grouped in layouts}
    first = programs[layouts[0]]

    # The sampler runs on the inference engine (its own programs); the update's passes in one compiled program.
    drawn = first.sample(params, (np.int32(1), np.bool_(False)), tokens, seg, vision=vision)

    def score(params, tokens, seg, vision, completions, sampler, lengths):
        update = {}
        for grouped, q in programs.items():
            batch = q.layout(tokens, seg, completions, lengths, sampler, jnp.zeros(b), jnp.ones(b, bool), None,
                             vision)
            update[grouped] = (q.logps(params, batch), batch.weights)
        return update

    update = jax.device_get(jax.jit(score)(params, tokens, seg, vision, *drawn))
    completions, sampler, lengths = jax.device_get(drawn)
    comps = [completions[r, :n].tolist() for r, n in enumerate(lengths)]
    scored = {}
    for grouped, (lp, w) in update.items():
        lp, w = lp.reshape(b, -1), w.reshape(b, -1) > 0  # one row a completion's tokens, or its whole row's
        scored[grouped] = [lp[r][w[r]] for r in range(b)]
    return SimpleNamespace(ids=[ids[i] for i in order], completions=comps, order=order,
                           sampler=[sampler[r, :n] for r, n in enumerate(lengths)], update=scored)


def hf_completion_logps(hf, prompt: list[int], completion: list[int], **inputs: Any) -> np.ndarray:
    """transformers' log-probabilities of ``completion``'s tokens after ``prompt`` (token ids) in one forward
    with the model inputs ``inputs`` (pixel values and what else the family reads: ``ids`` is the whole row's
    ids, for the inputs that depend on them)."""
    ids = torch.tensor([prompt + completion])
    kwargs = {k: (v(ids) if callable(v) else v) for k, v in inputs.items()}
    with torch.no_grad():
        logits = hf(input_ids=ids, **kwargs).logits
    logp = torch.log_softmax(logits[0].double(), -1).numpy()
    n = len(prompt)
    return np.array([logp[n - 1 + k, t] for k, t in enumerate(completion)])
