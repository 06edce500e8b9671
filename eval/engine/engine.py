"""The inference engine: continuous batching over a paged KV cache with shared prefixes.

(API first; the body lands next.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from eval.engine.api import Event, SamplingParams
from zoo.model.config import ModelConfig


class Engine:
    """One model's decoder serving many requests at once.

    ``params``: the model's weights (as :func:`zoo.load` gives them); ``adapters``: LoRA adapters a request may name
    (name -> (adapter tree keyed like the params, as :func:`zoo.checkpoints.adapter.load_adapters` gives it, its
    scale)); ``tokenizer``: decodes for stop strings. At most ``max_seqs`` requests decode at once, each of at most
    ``max_len`` tokens (prompt and new ones); their keys and values live in pages of ``page_size`` tokens
    (``num_pages`` of them; None: enough for max_seqs requests of max_len tokens). Driven from one thread.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, Any], *, tokenizer: Any = None, max_seqs: int = 16,
                 max_len: int = 2048, page_size: int = 16, num_pages: int | None = None,
                 adapters: Mapping[str, tuple[dict, float]] | None = None, prefix_caching: bool = True):
        raise NotImplementedError

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name."""
        raise NotImplementedError

    def submit(self, prompt: Sequence[int], params: SamplingParams, vision: Any = None) -> int:
        """Queue a request (its prompt's token ids); returns its id. Raises :class:`zoo.errors.UserError` for an
        empty prompt, one whose prompt + max_tokens exceeds ``max_len``, or an unknown adapter."""
        raise NotImplementedError

    def cancel(self, request_id: int) -> None:
        """End a request (queued or decoding): its pages are freed and the next step reports it "cancelled"."""
        raise NotImplementedError

    @property
    def busy(self) -> bool:
        """Whether any request is queued, decoding, or has an event still to report."""
        raise NotImplementedError

    def step(self) -> list[Event]:
        """Admit queued requests into free rows (prefilling their prompts), decode one token for every running
        request, and report what happened to each."""
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Each prompt's new tokens, run to their ends (a stop string's tokens kept, as :class:`Event` s give them)."""
        raise NotImplementedError
