"""A reward model as a GRPO reward function: ``grpo.rewards: ["rm:PATH"]`` (PATH: a reward model checkpoint,
from `reward train` or a converted ``*ForSequenceClassification``).

It scores completions in process, as TRL 1.16's GRPOTrainer scores them with a reward model
(``_calculate_rewards``): each prompt + completion is one text (a conversation rendered with the reward
model's own chat template, ``apply_chat_template`` of the messages; plain text joined as it is), tokenized by the
reward model's tokenizer without added special tokens, right-padded, and scored at its last token that is not
padding (zoo/model/pooling.py). The weights are loaded once, on the run's mesh, when the task prepares (a frozen input
of the rollout: no second process, nothing reloaded per step), and the scoring is one jitted program per padded
length (lengths are rounded up to a multiple of :data:`BUCKET`, so a run compiles it a few times at most).

A reward model trained with LoRA over the checkpoint a LoRA policy starts from shares the policy's frozen base
(:class:`SharedBase`): only its adapters and score head are loaded, and it scores as it trained, the adapters
beside the base weights; the base is not held twice. Any other reward model is loaded whole (an adapter
checkpoint merged), on the policy's mesh.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import UserError

PREFIX = "rm:"
BUCKET = 64  # padded lengths are multiples of it: few compilations


@dataclass(frozen=True)
class SharedBase:
    """A LoRA policy's frozen base, which a reward model with LoRA adapters over the same checkpoint reads instead
    of a copy: the checkpoint it was loaded from, its QLoRA quantization ({"kind", "double"} or None, as adapter
    checkpoints record it) and the params the run holds."""

    checkpoint: Path
    quant: dict | None
    params: dict


class RewardModelScorer:
    """The reward function of ``rm:PATH`` (module docstring); call :meth:`prepare` before scoring."""

    def __init__(self, path: str):
        from zoo.checkpoints.format import read_config
        from zoo.checkpoints.paths import checkpoint_dir

        self.path = checkpoint_dir(path, f"grpo.rewards entry '{PREFIX}{path}'")
        self.mcfg = read_config(self.path)
        if not self.mcfg.num_labels:
            raise UserError(f"grpo.rewards entry '{PREFIX}{path}' is a causal LM, not a reward model; train one with "
                            "`reward train` (or convert a *ForSequenceClassification)")
        name = self.path.parent.name if self.path.name == "final" else self.path.name
        self.__name__ = f"rm_{name}"  # its name in the logs: rewards/rm_NAME/mean
        # Set by prepare: the weights, the tokenizer, whether the base is the policy's, the jitted scorer.
        self.params: Any = None
        self.tokenizer: Any = None
        self.shares_base = False
        self._score: Any = None

    def prepare(self, mesh: Any, compute: Any, shared: SharedBase | None = None) -> None:
        """Load the weights on ``mesh`` and the tokenizer, once; only the adapters where the reward model's base is
        ``shared`` (module docstring)."""
        import jax

        from zoo.checkpoints.adapter import load_adapters
        from zoo.checkpoints.format import read_meta
        from zoo.checkpoints.loading import load_params
        from zoo.data.tokenizer import load_tokenizer
        from zoo.lora.weights import Weights
        from zoo.model.context import check_context
        from zoo.model.decoder import forward
        from zoo.model.pooling import last_positions

        try:  # it scores on the run's mesh, whose context axis set-up checked against the policy only
            check_context(self.mcfg, dict(mesh.shape).get("context", 1))
        except UserError as e:
            raise UserError(f"grpo.rewards entry '{PREFIX}{self.path}': {e}") from None
        self.tokenizer = load_tokenizer(self.path)
        meta = read_meta(self.path)
        self.shares_base = shared is not None and _same_base(self.path, meta, shared)
        if self.shares_base:
            assert shared is not None
            self.params = Weights(shared.params, load_adapters(self.path, meta, mesh), float(meta["lora"]["scale"]))
            print(f"reward model {self.__name__}: its LoRA adapters over the policy's frozen base (not loaded twice)",
                  file=sys.stderr)
        else:
            self.params = Weights(load_params(self.path, mesh))
        mcfg = self.mcfg

        def score(weights: Weights, tokens: Any, lengths: Any) -> Any:
            import jax.numpy as jnp

            w = weights.cast(compute)
            lora = w.adapters
            if lora is not None:  # the base a causal LM's: its LM head unused, the head the adapters'
                w = replace(w, base={**{k: v for k, v in w.base.items() if k != "lm_head"},
                                     "score": lora["score"].astype(compute)})
            n = tokens.shape[1]
            seg = (jnp.arange(n)[None] < lengths[:, None]).astype(jnp.int32)
            pos = jnp.where(seg > 0, jnp.arange(n)[None], 0)
            hidden = forward(mcfg, w, tokens, seg, pos, return_hidden=True)
            last = last_positions(seg, tokens, 1, mcfg.pad_token_id)
            head = w.base["score"].astype(jnp.float32)[:, 0]
            return hidden[jnp.arange(tokens.shape[0]), last].astype(jnp.float32) @ head

        self._score = jax.jit(score)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Each prompt + completion as the reward model reads it (TRL's rule)."""
        out = []
        for p, c in zip(prompts, completions):
            if isinstance(p, list):  # a conversation: the reward model's own template renders it whole
                out.append(self.tokenizer.apply_chat_template(p + c, tokenize=False))
            else:
                out.append(p + c)
        return out

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        """The reward model's score of each completion."""
        if self.params is None:
            raise RuntimeError("RewardModelScorer.prepare was not called")
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in self.texts(prompts, completions)]
        pad = self.mcfg.pad_token_id if self.mcfg.pad_token_id is not None else 0
        width = -(-max(len(x) for x in ids) // BUCKET) * BUCKET
        tokens = np.full((len(ids), width), pad, np.int32)
        for i, x in enumerate(ids):
            tokens[i, :len(x)] = x
        lengths = np.array([len(x) for x in ids], np.int32)
        return [float(v) for v in np.asarray(self._score(self.params, tokens, lengths))]


def _same_base(path: Path, meta: dict, shared: SharedBase) -> bool:
    """Whether the reward model at ``path`` is LoRA adapters trained beside exactly the ``shared`` base weights: the
    same base checkpoint, quantized alike."""
    from zoo.checkpoints.adapter import base_checkpoint, is_adapter

    if not is_adapter(meta) or meta["lora"].get("base_quant") != shared.quant:
        return False
    return base_checkpoint(path, meta).resolve() == Path(shared.checkpoint).resolve()


def is_reward_model(spec: str) -> bool:
    """Whether a grpo.rewards string names a reward model (``rm:PATH``)."""
    return spec.startswith(PREFIX)


def reward_model(spec: str) -> RewardModelScorer:
    """The scorer of ``rm:PATH``."""
    return RewardModelScorer(os.path.expanduser(spec[len(PREFIX):]))  # a string: a gs:// URL keeps its "//"
