"""GRPO's rollouts with tools and environments: each rollout an episode of several turns (grpo/episodes.py).

:class:`Agent` turns a step's dataset rows into episodes and back into what the step trains on:

- each rollout's prompt is rendered with the tools it may call (the chat template's ``tools``: ``grpo.tools``
  plus its environment's methods) after its environment's ``reset(**row)`` (whose text is appended to the last
  user message), and tokenized; a prompt longer than ``data.seq_len`` keeps its end, as GRPO's prompts do;
- the episodes run on the inference engine (:class:`eval.turns.CachedTurns`), turn after turn, each turn a request
  whose conversation so far the engine's prefix cache mostly holds already;
- :class:`Episodes` holds the arrays the update lays out (prompt rows, the episode's tokens and the sampler's
  log-probabilities, and which tokens are the model's), the messages the rewards read (TRL's completions: the
  assistant and tool messages), the metrics (per episode ``num_turns``, ``tool_calls`` and ``tool_failures``;
  TRL's ``tools/call_frequency``, calls per episode, and ``tools/failure_frequency``, failures per call; and
  ``turns/clipped_ratio``: the share of turns cut by the budget) and the completions log's records of whole
  episodes (each with its own counts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from chat.formats import BadRow
from chat.templates import ChatTemplate, render, template_text
from chat.tool_calls import Parser, parser_for
from chat.training_templates import for_tools
from eval.generate import Sampler
from eval.rollout import RolloutEngine
from eval.turns import CachedTurns
from grpo.config import GRPOConfig
from grpo.episodes import Episode, EpisodeSettings, call_id, run_episodes, tool_suffix
from grpo.rewards import load_callable
from grpo.tools import Environments
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig


@dataclass
class Episodes:
    """A step's episodes as arrays (rows x prompt width, rows x budget) and as what the rewards and the log read."""

    prompt_tokens: np.ndarray  # [B, P] int32, right-padded
    prompt_valid: np.ndarray  # [B, P] int32 (1 on the prompt)
    tokens: np.ndarray  # [B, T] int32: the episode after the prompt, the model's and the tools' tokens
    logps: np.ndarray  # [B, T] float32: the sampler's log-probability of each model token, 0 elsewhere
    model: np.ndarray  # [B, T] bool: the model's tokens
    lengths: np.ndarray  # [B] int32
    ended: np.ndarray  # [B] bool: the last turn ended with its end-of-turn token
    prompts: list[Any]  # each rollout's prompt messages, after its environment's reset
    episodes: list[Episode]

    @property
    def completions(self) -> list[list[dict[str, Any]]]:
        """TRL's completions: each episode's assistant and tool messages."""
        return [e.messages for e in self.episodes]

    def metrics(self) -> dict[str, float]:
        """The episodes' metrics (:func:`episode_metrics`)."""
        return episode_metrics(self.episodes)

    def records(self) -> list[dict[str, Any]]:
        """Each episode for ``completions.jsonl``: its messages and turns (tokens, text, calls, answers)."""
        return [{"messages": e.messages, "turns": [t.__dict__ for t in e.turns],
                 "tool_calls": e.tool_calls, "tool_failures": e.tool_failures} for e in self.episodes]


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Episodes' metrics (module docstring), each a mean that the batch size does not scale: ``num_turns``,
    ``tool_calls`` and ``tool_failures`` per episode (``tool_calls`` is TRL's ``tools/call_frequency``, logged
    under both names), ``tools/failure_frequency`` per call (TRL's), ``turns/clipped_ratio`` per turn."""
    n = len(episodes)
    calls = sum(e.tool_calls for e in episodes)
    failures = sum(e.tool_failures for e in episodes)
    turns = [t for e in episodes for t in e.turns]
    return {"num_turns": float(np.mean([len(e.turns) for e in episodes])),
            "tool_calls": calls / n, "tool_failures": failures / n,
            "tools/call_frequency": calls / n,
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "turns/clipped_ratio": float(np.mean([t.truncated for t in turns])) if turns else 0.0}


@dataclass
class Prepared:
    """What :meth:`Agent.prepare` set up for a run's tokenizer, template and model: the template's source, the
    tool-call parser and the tools' suffix, and the sampler's settings."""

    tokenizer: Any
    template: ChatTemplate
    source: str
    mcfg: ModelConfig
    sampler: Sampler
    compute: Any
    eos_ids: tuple[int, ...]
    parser: Parser
    suffix: Callable[[dict[str, Any], list[dict[str, Any]]], list[int]]


class Agent:
    """What a GRPO run with ``grpo.tools`` or ``grpo.environment`` needs to run episodes (module docstring)."""

    def __init__(self, cfg: GRPOConfig, tools: list[Callable], environments: Environments | None):
        self.cfg, self.g = cfg, cfg.grpo
        self.tools, self.environments = tools, environments
        if self.g.tool_parser != "auto":  # a name or a function: said before the model loads
            parser_for(self.g.tool_parser, "", load_callable)
        self.ready: Prepared | None = None  # set up by prepare
        self.engines: RolloutEngine | None = None  # the episodes' engines, kept across steps (set up by prepare)

    def prepare(self, tokenizer: Any, template: ChatTemplate, mcfg: ModelConfig, eos_ids: tuple[int, ...],
                sampler: Sampler, compute: Any) -> None:
        """The template the episodes train under (a family's training template where its own re-renders earlier
        turns, as TRL swaps: chat/training_templates.py; one log line names it), the parser and the tools' suffix
        for this tokenizer (one-line errors before step 1: the suffix is tried on a call)."""
        template, line = for_tools(tokenizer, template)
        print(line, flush=True)
        source = template_text(tokenizer, template)
        parser = parser_for(self.g.tool_parser, source, load_callable)
        suffix = tool_suffix(tokenizer, lambda msgs, gen: render(tokenizer, msgs, template, source, gen), eos_ids)
        suffix({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": call_id(1), "function": {"name": "dummy", "arguments": {}}}]},
            [{"role": "tool", "name": "dummy", "content": "dummy", "tool_call_id": call_id(1)}])
        self.ready = Prepared(tokenizer, template, source, mcfg, sampler, compute, eos_ids, parser, suffix)
        self.engines = RolloutEngine(mcfg, compute, None)

    def _ready(self) -> Prepared:
        assert self.ready is not None, "prepare first"
        return self.ready

    def tool_functions(self, instance: Any, name: str | None) -> list[Callable]:
        """The functions a rollout may call: ``grpo.tools`` and its environment instance's methods."""
        own = [getattr(instance, m) for m in self.environments.tool_names(name)] if self.environments else []
        return [*self.tools, *own]

    def prompt_of(self, row: dict[str, Any]) -> Any:
        """A row's prompt; with an environment it may be absent (TRL: an empty user message, which the
        environment's ``reset`` text fills)."""
        prompt = row.get(self.cfg.data.prompt_field)
        if prompt is None and self.environments is not None:
            prompt = [{"role": "user", "content": ""}]
        return prompt

    def document_ids(self, row: dict[str, Any], where: str) -> list[int]:
        """A row's prompt ids as its documents hold them (before any rollout): rendered with the tools of its
        environment's probed instance (an environment's ``reset`` text is added per rollout)."""
        name = self.environments.pick(row, where) if self.environments else None
        instance = self.environments.kinds[name].pool[0] if self.environments else None
        return self.prompt_ids(self.prompt_of(row), self.tool_functions(instance, name))

    def prompt_ids(self, prompt: Any, tools: list[Callable]) -> list[int]:
        """A prompt's ids, rendered with ``tools`` and its generation prompt, cut to its last ``data.seq_len``."""
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
            raise BadRow("episodes with tools need a conversational prompt (a list of messages), got "
                         f"{type(prompt).__name__}")
        p = self._ready()
        text = render(p.tokenizer, prompt, p.template, p.source, True, tools or None)
        ids = p.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.cfg.data.seq_len:]

    def run(self, weights: Weights, rows: list[dict[str, Any]], key: jax.Array,
            where: Callable[[int], str], sampler: Sampler | None = None) -> Episodes:
        """The episodes of a step's rollouts with the policy's ``weights`` (``rows``: each rollout's dataset row, G in
        a row per prompt);
        ``sampler``: another sampling than the run's (greedy, for held-out prompts)."""
        names = [self.environments.pick(r, where(i)) for i, r in enumerate(rows)] if self.environments else []
        instances = self.environments.draw(names) if self.environments else [None] * len(rows)
        prompts, ids, tool_maps = [], [], []
        for i, row in enumerate(rows):
            prompt = self.prompt_of(row)
            if self.environments is not None:
                try:
                    obs = self.environments.reset(instances[i], row)
                except UserError as err:
                    raise UserError(f"{err} on {where(i)}") from None
                if isinstance(obs, str) and isinstance(prompt, list) and prompt:
                    prompt = prompt[:-1] + [{**prompt[-1], "content": str(prompt[-1].get("content", "")) + obs}]
            fns = self.tool_functions(instances[i], names[i] if names else None)
            try:
                ids.append(self.prompt_ids(prompt, fns))
            except BadRow as bad:
                raise UserError(f"{where(i)}: {bad}") from None
            prompts.append(prompt)
            tool_maps.append({f.__name__: f for f in fns})
        width = self.cfg.data.seq_len + 1
        budget = self.g.max_completion_length
        ready = self._ready()
        decoder = CachedTurns(ready.mcfg, weights, sampler or ready.sampler, ready.eos_ids, budget, key,
                              ready.compute, self.engines)
        settings = EpisodeSettings(budget, self.g.max_turns, ready.eos_ids, float(self.g.tool_timeout), ready.parser,
                                   lambda t: ready.tokenizer.decode(t, skip_special_tokens=False), ready.suffix)
        finished = [lambda e=e: bool(getattr(e, "done", False)) for e in instances]  # an environment's own end
        try:
            episodes = run_episodes(decoder, ids, width, tool_maps, settings, finished)
        finally:
            decoder.close()
        b = len(rows)
        out = Episodes(np.zeros((b, width), np.int32), np.zeros((b, width), np.int32),
                       np.zeros((b, budget), np.int32), np.zeros((b, budget), np.float32),
                       np.zeros((b, budget), bool), np.zeros(b, np.int32), np.zeros(b, bool), prompts, episodes)
        for r, (p, e) in enumerate(zip(ids, episodes)):
            out.prompt_tokens[r, :len(p)], out.prompt_valid[r, :len(p)] = p, 1
            n = len(e.tokens)
            out.tokens[r, :n], out.logps[r, :n], out.model[r, :n] = e.tokens, e.logps, e.model
            out.lengths[r], out.ended[r] = n, e.ended
        return out
