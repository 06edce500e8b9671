"""lm-evaluation-harness on lmzoo's model: :class:`LmzooLM`, an ``lm_eval`` model (registered as ``lmzoo``).

lm-eval (the optional ``eval`` extra) builds the requests from its task library
and scores the answers; this module answers its three request kinds on our JAX
model, on whatever mesh :func:`zoo.load` put it:

- ``loglikelihood``: lm-eval's own tokenization (:class:`lm_eval.api.model.TemplateLM`:
  the context's trailing spaces move to the continuation, the continuation is the
  tail of the whole string's encoding). Requests that share a context (a
  multiple-choice question's choices) run that context once into the KV cache and
  every continuation extends it, continuations that differ only in their last
  token sharing one extension row (:func:`eval.multiple_choice.choice_scores`);
  the others are rows of batched fixed-shape forward passes, longest first
  (:func:`eval.loglikelihood.request_scores`). Each answer is (log-likelihood,
  whether every continuation token is the argmax), in the requests' order.
- ``loglikelihood_rolling``: lm-eval's rolling windows of ``max_length`` tokens
  (``get_rolling_token_windows`` with one token of context, made disjoint), as its
  ``hf`` backend scores them, so word/byte perplexity and bits per byte agree. A
  window longer than ``chunk`` tokens (``max_length`` defaults to the model's
  whole context, as in ``hf``) is read ``chunk`` tokens per forward pass, each
  pass attending to the earlier ones through the KV cache
  (:func:`eval.rolling.chunked_scores`): lm-eval's numbers, a chunk's memory.
- ``generate_until``: greedy (or sampled) KV-cache generation of prompts of
  different lengths in one batch (:func:`eval.generate.generate`), stopping at
  the request's stop strings and EOS, the text cut at the first stop string.

Usage: ``zoo eval CKPT --harness mmlu,arc_easy`` or, from Python,
``lm_eval.simple_evaluate(model=LmzooLM("CKPT"), tasks=[...])``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from eval.generate import GenerationConfig, generate
from eval.loglikelihood import bucket
from eval.multiple_choice import choice_scores
from eval.progress import progress_bar
from eval.rolling import DEFAULT_CHUNK, window_scores

TokenRequest = tuple[tuple[str, str], list[int], list[int]]  # ((context, continuation), context ids, continuation ids)


@register_model("lmzoo")
class LmzooLM(TemplateLM):
    """An lm-eval model answering on a zoo checkpoint (converted, a training run's ``final``, a run folder).

    ``pretrained``: the checkpoint path (or give a loaded ``model``, a
    :class:`zoo.model.decoder.Decoder`, and its ``tokenizer``). ``batch_size``: rows per
    forward pass (questions per pass for shared contexts, prompts per generation
    batch). ``max_length``: the context in tokens (default the model's
    ``max_position_embeddings``, as lm-eval's ``hf`` backend reads it).
    ``chunk``: tokens per forward pass of a longer row (a long rolling window), which is
    read through the KV cache chunk by chunk (default 2048).
    ``max_gen_toks``: the default generation length (256, as ``hf``).
    ``add_bos_token``: as ``hf``'s (None: the tokenizer's own default).
    ``dtype``: float32 (default) or bfloat16 weights when loading ``pretrained``. ``cfg`` and ``params``:
    a model config and parameter tree instead (a training run's live weights).
    """

    def __init__(self, pretrained: str | None = None, model: Any = None, tokenizer: Any = None,
                 batch_size: int | str = 8, max_length: int | str | None = None, max_gen_toks: int | str = 256,
                 add_bos_token: bool | str | None = None, dtype: str = "float32", progress: bool = True,
                 chunk: int | str = DEFAULT_CHUNK, cfg: Any = None, params: dict | None = None, **kwargs: Any) -> None:
        super().__init__()
        if params is not None:  # live weights (training's eval.tasks): a config and a parameter tree
            from types import SimpleNamespace

            model = SimpleNamespace(cfg=cfg, param_dict=lambda: params)
        if model is None:
            if pretrained is None:
                raise ValueError("LmzooLM needs pretrained=CKPT or a loaded model and tokenizer")
            import ml_dtypes

            import zoo
            from zoo.checkpoints.paths import checkpoint_dir
            from zoo.data.tokenizer import load_tokenizer

            ckpt = str(checkpoint_dir(pretrained))
            model = zoo.load(ckpt, dtype=np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
            tokenizer = tokenizer or load_tokenizer(ckpt)
        if tokenizer is None:
            raise ValueError("LmzooLM: a loaded model needs its tokenizer")
        self.cfg, self.params = model.cfg, model.param_dict()
        self.tokenizer = tokenizer
        self.name = str(pretrained) if pretrained is not None else "lmzoo"
        self.batch_size = int(batch_size)
        self.max_length = int(max_length) if max_length not in (None, "") else int(self.cfg.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self.chunk = int(chunk)
        if self.batch_size < 1 or self.max_length < 2 or self.chunk < 1:
            raise ValueError(f"LmzooLM: batch_size {self.batch_size} and chunk {self.chunk} must be at least 1, "
                             f"max_length {self.max_length} at least 2")
        self.add_bos_token = _bool_or_none(add_bos_token)
        self.progress = progress

    # ------------------------------------------------------------------ tokens, as lm-eval's hf backend
    @property
    def eot_token_id(self) -> int:
        """End of text: the tokenizer's EOS."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and a document's first window) is predicted from: BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name (lm-eval keys its chat-template cache by it)."""
        return getattr(self.tokenizer, "name_or_path", "lmzoo").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of ``string`` with the tokenizer's special tokens unless told (or it already starts with BOS)."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        bos = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
        if add_special_tokens is None and bos and string.startswith(bos):
            special["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``tokens``."""
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as the checkpoint's chat template renders it (``--apply_chat_template``)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ requests
    def _loglikelihood_tokens(self, requests: Sequence[TokenRequest], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each tokenized request, in order (see the module's docstring)."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, _cont) in enumerate(requests):
            groups.setdefault(tuple(ctx), []).append(i)
        # A shared context goes through the cache once when its continuations are short beside the window;
        # long continuations are rows of their own (read in chunks through the cache when longer than `chunk`).
        shared = [(ctx, idx) for ctx, idx in groups.items()
                  if len(idx) > 1 and bucket(max(len(requests[i][2]) for i in idx), 1) <= self.max_length // 2]
        in_shared = {i for _, idx in shared for i in idx}
        single = [i for i in range(len(requests)) if i not in in_shared]
        with progress_bar(len(requests), "loglikelihood", "request", self.progress and not disable_tqdm) as bar:
            if shared:
                got = choice_scores(self.cfg, self.params, [(list(ctx), [requests[i][2] for i in idx])
                                                            for ctx, idx in shared],
                                    self.batch_size, bar, max_length=self.max_length)
                for (_, idx), scores in zip(shared, got):
                    for i, s in zip(idx, scores):
                        out[i] = s
            if single:
                rows = [(requests[i][1] + requests[i][2], len(requests[i][2])) for i in single]
                for i, s in zip(single, window_scores(self.cfg, self.params, rows, self.batch_size,
                                                      self.max_length, self.chunk, bar)):
                    out[i] = s
        for i, (strings, _, _) in enumerate(requests):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, out[i])
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's summed log-likelihood over lm-eval's rolling windows of ``max_length`` tokens."""
        windows: list[TokenRequest] = []
        counts: list[int] = []
        for (text,) in (r.args for r in requests):
            pairs = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows.extend((None, ctx, cont) for ctx, cont in pairs)  # type: ignore[misc]
            counts.append(len(pairs))
        # Windows are rows of their own, never a shared context's extensions: every document's first window
        # has the same one-token context (the prefix token), and its continuation is the window.
        with progress_bar(len(windows), "loglikelihood_rolling", "window", self.progress and not disable_tqdm) as bar:
            scores = window_scores(self.cfg, self.params, [(ctx + cont, len(cont)) for _, ctx, cont in windows],
                                   self.batch_size, self.max_length, self.chunk, bar)
        out, at = [], 0
        for r, n in zip(requests, counts):
            total = float(sum(ll for ll, _ in scores[at:at + n]))
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's generation, cut at its first stop string; prompts of one generation setting are
        batched longest first (each batch's rows differ in length) and answered in the requests' order."""
        out: list[str | None] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        by_kwargs: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_kwargs.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        with progress_bar(len(requests), "generate_until", "request", self.progress and not disable_tqdm) as bar:
            for idx in by_kwargs.values():
                kw = normalize_gen_kwargs(dict(requests[idx[0]].args[1]), self.max_gen_toks)
                until = handle_stop_sequences(kw.pop("until", None), eos=eos)
                new = int(kw.pop("max_gen_toks"))
                if new >= self.max_length:
                    raise ValueError(f"max_gen_toks {new} must be below the context of {self.max_length} tokens")
                prompts = {i: self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - new)
                           for i in idx}
                order = sorted(idx, key=lambda i: -len(prompts[i]))
                sample = bool(kw.get("do_sample")) and float(kw.get("temperature") or 0.0) > 0
                gen = GenerationConfig(max_new_tokens=new, temperature=float(kw["temperature"]) if sample else 0.0,
                                       top_k=int(kw.get("top_k") or 0), top_p=float(kw.get("top_p") or 1.0),
                                       seed=int(kw.get("seed") or 0), stop=tuple(s for s in until if s),
                                       eos_ids=(self.eot_token_id,))
                for start in range(0, len(order), self.batch_size):
                    batch = order[start:start + self.batch_size]
                    got = generate(self.cfg, self.params, [prompts[i] for i in batch], gen, tokenizer=self.tokenizer)
                    for i, toks in zip(batch, got):
                        text = postprocess_generated_text(self.tok_decode(toks), until, None)
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        return out  # type: ignore[return-value]


def _bool_or_none(value: bool | str | None) -> bool | None:
    """``add_bos_token`` from Python or from a ``--model_args`` string."""
    if value is None or isinstance(value, bool):
        return value
    return str(value).lower() in ("1", "true", "yes")
