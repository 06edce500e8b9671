"""Multi-turn episodes: the policy's turns, the tool calls in them, and the tools' answers, on one token budget.

An episode starts from a rendered prompt. Each turn the policy decodes (:class:`TurnDecoder`, e.g.
:class:`eval.turns.CachedTurns`) until its end-of-turn token; the turn's text is read for tool calls by the
template family's parser (:mod:`chat.tool_calls`); each call runs (:func:`grpo.tools.run_call`) and its answer
becomes a ``tool`` message. The tokens that follow the turn (the answers and the next generation prompt) are the
chat template's own rendering of those messages (a family's training template where its own re-renders earlier
turns: chat/training_templates.py), found as TRL 1.16 finds them (``_get_tool_suffix_ids``): a
conversation rendered with and without them, cut at the end-of-turn token. They join the episode as tokens the
policy did not choose: they are masked out of the loss, the log-probabilities and the KL (TRL's ``tool_mask``).

The episode's tokens, the model's and the tools', share ``grpo.max_completion_length`` (TRL's rule). An episode
ends when a turn calls no tool, when a turn is cut by the budget (its calls are not run), when the tools' answer
would not fit (it is dropped, as TRL drops it), after ``grpo.max_turns`` turns (the last turn's calls are not
run, as TRL's ``max_tool_calling_iterations``), or when its environment says it is done (a truthy ``done``
attribute after its tools answer, beyond TRL: a game won, a task submitted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from chat.formats import BadRow
from chat.tool_calls import ParsedTurn, ToolCall
from chat.training_templates import COVERED
from grpo.tools import run_call
from zoo.errors import UserError


class TurnDecoder(Protocol):
    """What decodes the policy's turns (:class:`eval.turns.CachedTurns`; a scripted policy in tests)."""

    def start(self, prompts: list[list[int]], width: int) -> None:
        """Read each row's prompt."""

    def turn(self, active: np.ndarray, room: np.ndarray, index: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each active row's next turn (tokens, log-probabilities), at most ``room`` tokens."""

    def extend(self, rows: dict[int, list[int]]) -> None:
        """Feed row r its last drawn token and ``rows[r][1:]`` after it."""


@dataclass
class Turn:
    """One assistant turn, for the completions log: its tokens, text, calls and the answers they got."""

    tokens: list[int]
    text: str
    calls: list[dict[str, Any]]
    results: list[dict[str, Any]]
    truncated: bool  # cut by the budget (no end-of-turn token)


@dataclass
class Episode:
    """One rollout's conversation after its prompt: every token (the model's and the tools'), the sampler's
    log-probability of each (0 for the tools'), which are the model's, the messages (TRL's completion: the
    assistant and tool messages) and the turns."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    ended: bool = False  # the last turn ended with its end-of-turn token

    def add(self, tokens: list[int], logps: list[float], model: bool) -> None:
        """Append tokens (the model's, with their log-probabilities, or a tool's: log-probability 0)."""
        self.tokens += tokens
        self.logps += logps if model else [0.0] * len(tokens)
        self.model += [model] * len(tokens)


@dataclass
class EpisodeSettings:
    """What every episode of a rollout shares."""

    budget: int  # tokens per episode, the model's and the tools' (grpo.max_completion_length)
    max_turns: int | None  # assistant turns at most (None: until the budget)
    eos_ids: tuple[int, ...]
    timeout: float  # seconds per tool call
    parser: Callable[[str], ParsedTurn]
    decode: Callable[[list[int]], str]  # a turn's ids (its end-of-turn token removed) as text, special tokens kept
    suffix: Callable[[dict[str, Any], list[dict[str, Any]]], list[int]]  # (assistant message, tool messages) -> ids


def call_id(n: int) -> str:
    """The id of an episode's n-th call where the model wrote none: 9 characters, as Mistral's templates want."""
    return f"call{n:05d}"


def _parse(parser: Callable[[str], ParsedTurn], text: str) -> ParsedTurn:
    """A turn read by ``parser``; a parser that raises or returns something else is the config's error, in one
    line (a shipped parser never raises: what it cannot read is a malformed call)."""
    try:
        parsed = parser(text)
    except Exception as e:  # noqa: BLE001 - a user's parser (grpo.tool_parser: file.py:function)
        raise UserError(f"grpo.tool_parser {getattr(parser, '__name__', parser)} raised {type(e).__name__}: "
                        f"{' '.join(str(e).split())[:300]} on the turn {text[:80]!r}") from e
    if not isinstance(parsed, ParsedTurn):
        raise UserError(f"grpo.tool_parser {getattr(parser, '__name__', parser)} returned no ParsedTurn (got "
                        f"{type(parsed).__name__}); return chat.tool_calls.ParsedTurn(content, calls, errors)")
    return parsed


def _message(parsed: ParsedTurn, calls: list[ToolCall], ids: list[str]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "id": i, "function": {"name": c.name, "arguments": c.arguments}}
                             for c, i in zip(calls, ids)]
    return msg


def run_episodes(decoder: TurnDecoder, prompts: list[list[int]], width: int, tools: Sequence[Mapping[str, Callable]],
                 s: EpisodeSettings, finished: Sequence[Callable[[], bool]] | None = None) -> list[Episode]:
    """Each prompt's episode (``tools[r]``: the functions row r may call, by name), decoded turn by turn.
    ``finished[r]()``, asked after row r's tools answer: whether its environment has ended the episode (then the
    answers are recorded in its messages, and no turn follows)."""
    b = len(prompts)
    episodes = [Episode() for _ in range(b)]
    decoder.start(prompts, width)
    active = np.ones(b, bool)
    index = 0
    while active.any() and (s.max_turns is None or index < s.max_turns):
        room = np.array([s.budget - len(e.tokens) for e in episodes], np.int32)
        new, logps = decoder.turn(active, room, index)
        last_turn = s.max_turns is not None and index + 1 >= s.max_turns
        go_on: dict[int, list[int]] = {}
        for r in map(int, np.flatnonzero(active)):
            ep, toks = episodes[r], new[r]
            ep.add(toks, logps[r], True)
            ended = bool(toks) and toks[-1] in s.eos_ids
            ep.ended = ended
            parsed = _parse(s.parser, s.decode(toks[:-1] if ended else toks))
            calls = list(parsed.calls)
            ids = [c.id or call_id(ep.tool_calls + k + 1) for k, c in enumerate(calls)]
            message = _message(parsed, calls, ids)
            ep.messages.append(message)
            turn = Turn(toks, parsed.content, [{"name": c.name, "arguments": c.arguments} for c in calls], [],
                        not ended)
            ep.turns.append(turn)
            if not ended or last_turn or not (calls or parsed.errors):
                continue  # the episode ends here: no call, cut by the budget, or out of turns
            answers = [run_call(c, tools[r], s.timeout) for c in calls]
            answers += [run_call(err, tools[r], s.timeout) for err in parsed.errors]
            ids += [call_id(ep.tool_calls + len(ids) + k + 1) for k in range(len(parsed.errors))]
            tool_messages = [{"role": "tool", "name": a.name, "content": a.content, "tool_call_id": i}
                             for a, i in zip(answers, ids)]
            suffix = s.suffix(message, tool_messages)
            ep.tool_calls += len(answers)
            ep.tool_failures += sum(a.failed for a in answers)
            turn.results = [{"name": a.name, "content": a.content, "failed": a.failed} for a in answers]
            if finished is not None and finished[r]():  # the environment is done: nothing follows its answer
                ep.messages += tool_messages
                continue
            if len(ep.tokens) + len(suffix) >= s.budget:  # no room for the answers and one more token: dropped
                turn.results = [{**x, "dropped": True} for x in turn.results]
                continue
            ep.messages += tool_messages
            ep.add(suffix, [], False)
            go_on[r] = [toks[-1]] + suffix
        active = np.zeros(b, bool)
        active[list(go_on)] = True
        if go_on:
            decoder.extend(go_on)
        index += 1
    return episodes


# What a run whose template cannot serve tool episodes can do (chat/training_templates.py swaps the families it knows).
_FIX = ("set data.chat_template to a Jinja chat template that renders earlier turns the same whatever follows them "
        f"(lmzoo swaps in a prefix-preserving training template only for these families' own templates: {COVERED})")


def tool_suffix(tokenizer: Any, render: Callable[[list[dict[str, Any]], bool], str],
                eos_ids: tuple[int, ...]) -> Callable[[dict[str, Any], list[dict[str, Any]]], list[int]]:
    """The ids that follow an assistant turn with tool calls: its tools' messages and the next generation prompt,
    as the chat template renders them (TRL's ``_get_tool_suffix_ids``: a conversation rendered without and with
    them, the first cut after its last end-of-turn token). ``render(messages, generation_prompt)``: the
    template's text."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def suffix(assistant: dict[str, Any], tool_messages: list[dict[str, Any]]) -> list[int]:
        calls: list[Any] = assistant.get("tool_calls") or [
            {"type": "function", "id": m["tool_call_id"], "function": {"name": m["name"], "arguments": {}}}
            for m in tool_messages]
        dummy: list[dict[str, Any]] = [{"role": "user", "content": "dummy"},
                                       {"role": "assistant", "content": "", "tool_calls": calls}]
        try:
            prefix, full = ids(render(dummy, False)), ids(render(dummy + tool_messages, True))
        except BadRow as bad:  # e.g. Gemma's templates: roles must alternate user/assistant, no tool role
            why = " ".join(str(bad).split()).removeprefix("the chat template cannot render it ")  # render's words
            raise UserError(f"the chat template cannot render a tool's answer after the assistant's call: {why}; "
                            f"{_FIX}") from None
        ends = [i for i, t in enumerate(prefix) if t in eos_ids]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise UserError("the chat template does not render a tool's answer after the assistant's turn as a "
                            f"continuation of it (the conversation's tokens change); {_FIX}")
        return full[len(prefix):]

    return suffix
