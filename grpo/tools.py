"""Tools and environments a GRPO policy acts with over several turns, with TRL 1.16's semantics.

- **Tools** (``grpo.tools: ["module.py:function", ...]``) are plain Python functions. Their type hints and
  Google-style docstrings become the JSON schemas the chat template renders (transformers' ``get_json_schema``,
  which TRL's ``tools=`` goes through too), so a tool without a docstring that documents its arguments is refused
  when the run starts, in one line.
- **Environments** (``grpo.environment: "module.py:factory"``, or ``{name: "module.py:factory", ...}`` to pick
  one per row by its ``environment`` column) are TRL's ``environment_factory``: the factory makes one instance
  per rollout (instances are pooled and reused across steps, as TRL pools them); ``reset(**row)`` starts an
  episode from the dataset row, and text it returns is appended to the prompt's last user message; the
  instance's public methods are the tools the model may call in that episode; an optional ``get_reward()``
  scores the finished episode as one more reward source, named after the class. Beyond TRL, an instance whose
  ``done`` attribute is true after its tools answer ends its episode there (grpo/episodes.py).

Calls run on the host, one thread each with ``grpo.tool_timeout`` seconds to answer. A call that raises, times
out, names no tool, or cannot be read becomes ``{'error': ...}`` as the tool's answer (TRL's text for a failed
call) and is counted, never crashing the run. A timed-out call's thread is abandoned (Python cannot stop it),
so a tool that may hang should not hold locks the next call needs. Nothing here executes model-written code:
the model only picks a function by name and gives its arguments as JSON.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from chat.tool_calls import ToolCall
from grpo.rewards import load_callable
from zoo.errors import UserError

ENVIRONMENT_FIELD = "environment"  # the row column that picks an environment in the dict form


def tool_schema(fn: Callable, where: str) -> dict[str, Any]:
    """The JSON schema transformers renders for ``fn`` (``get_json_schema``), or a one-line UserError."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' own errors: no docstring, an undocumented argument, ...
        raise UserError(f"{where}: {getattr(fn, '__name__', fn)!r} cannot be described to the model: "
                        f"{' '.join(str(e).split())}; give it type hints and a docstring with an Args: section "
                        "(transformers' get_json_schema)") from None


def load_tools(specs: Sequence[str] | str | None) -> list[Callable]:
    """The functions ``grpo.tools`` names (each checked to have a schema), in order; names must be unique."""
    if not specs:
        return []
    if isinstance(specs, str):
        specs = [s.strip() for s in specs.split(",") if s.strip()]
    tools: list[Callable] = []
    for spec in specs:
        where = f"grpo.tools entry {spec!r}"
        if not isinstance(spec, str) or ":" not in spec:
            raise UserError(f"{where}: give module:function or path/to/file.py:function")
        fn = load_callable(spec.strip(), where)
        tool_schema(fn, where)
        tools.append(fn)
    _unique([t.__name__ for t in tools], "grpo.tools")
    return tools


def _unique(names: list[str], where: str) -> None:
    seen = [n for i, n in enumerate(names) if n in names[:i]]
    if seen:
        raise UserError(f"{where}: two tools are named {seen[0]!r}; the model calls tools by name")


@dataclass
class _Kind:
    """One environment factory probed: its tool method names and whether it scores episodes (``get_reward``)."""

    factory: Callable[[], Any]
    cls: type
    methods: list[str]
    scores: bool
    pool: list[Any] = field(default_factory=list)


class Environments:
    """``grpo.environment``: the factories, each probed once (its instance seeds the pool, as TRL's does)."""

    def __init__(self, spec: str | Mapping[str, str]):
        self.multi = isinstance(spec, Mapping)
        named = dict(spec) if isinstance(spec, Mapping) else {None: spec}
        if not named:
            raise UserError("grpo.environment is an empty mapping; give module.py:factory or {name: "
                            "module.py:factory}")
        self.kinds: dict[str | None, _Kind] = {}
        for name, target in named.items():
            where = f"grpo.environment {'entry ' + repr(name) if self.multi else repr(target)}"
            if not isinstance(target, str) or ":" not in target:
                raise UserError(f"{where}: give module:factory or path/to/file.py:factory")
            factory = load_callable(target.strip(), where)
            try:
                instance = factory()
            except Exception as e:  # noqa: BLE001 - the user's factory
                raise UserError(f"{where}: the factory raised {type(e).__name__}: {e}") from None
            cls = type(instance)
            members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))  # the class's: no properties run
            if "reset" not in members:
                raise UserError(f"{where}: {cls.__name__} has no reset method; an environment starts each episode "
                                "with reset(**row)")
            methods = [m for m in members if m not in ("reset", "get_reward") and not m.startswith("_")]
            for m in methods:
                tool_schema(getattr(instance, m), f"{where}: method")
            self.kinds[name] = _Kind(factory, cls, methods, "get_reward" in members, [instance])
        self.batch: list[Any] = []  # this rollout's instances, one per completion

    @property
    def reward_classes(self) -> list[type]:
        """The environment classes that score episodes (``get_reward``), each once."""
        out: list[type] = []
        for k in self.kinds.values():
            if k.scores and k.cls not in out:
                out.append(k.cls)
        return out

    def tool_names(self, name: str | None) -> list[str]:
        """The tool methods of environment ``name`` (None: the single one)."""
        return self.kinds[name].methods

    def pick(self, row: Mapping[str, Any], where: str) -> str | None:
        """The environment a data row uses: its ``environment`` column in the dict form."""
        if not self.multi:
            return None
        name = row.get(ENVIRONMENT_FIELD)
        if name not in self.kinds:
            raise UserError(f"{where}: environment {name!r} is none of grpo.environment's "
                            f"({', '.join(str(k) for k in self.kinds)}); each row names one in its "
                            f"'{ENVIRONMENT_FIELD}' column")
        return name

    def draw(self, names: list[str | None]) -> list[Any]:
        """One instance per rollout (``names``: each rollout's environment), reused from the pools, made only
        when a batch needs more at once than were ever made."""
        cursor: dict[str | None, int] = {}
        out = []
        for name in names:
            kind = self.kinds[name]
            i = cursor.get(name, 0)
            if i == len(kind.pool):
                kind.pool.append(kind.factory())
            cursor[name] = i + 1
            out.append(kind.pool[i])
        self.batch = out
        return out

    def reset(self, instance: Any, row: Mapping[str, Any]) -> Any:
        """``instance.reset(**row)`` (the dict form leaves out the ``environment`` column); its observation."""
        args = {k: v for k, v in row.items() if not (self.multi and k == ENVIRONMENT_FIELD)}
        try:
            return instance.reset(**args)
        except Exception as e:  # noqa: BLE001 - the user's environment: one line, naming it
            raise UserError(f"grpo.environment: {type(instance).__name__}.reset raised {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]}") from e


class EnvironmentReward:
    """A reward source per environment class with ``get_reward``, named after it: the episode's score where the
    rollout's environment is exactly that class, None elsewhere (TRL's rule)."""

    def __init__(self, environments: Environments, cls: type):
        self.environments, self.cls = environments, cls
        self.__name__ = cls.__name__

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[Any]:
        """Each completion's ``get_reward()``, or None where its environment is another class."""
        envs = self.environments.batch
        if len(envs) != len(completions):
            raise RuntimeError("EnvironmentReward: the rollout's environments are not this batch's")
        try:
            return [cast(Any, e).get_reward() if type(e) is self.cls else None for e in envs]
        except Exception as e:  # noqa: BLE001 - the user's environment: one line, naming it
            raise UserError(f"grpo.environment: {self.cls.__name__}.get_reward raised {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]}") from e


@dataclass
class ToolResult:
    """One call's answer as the ``tool`` message's content, and whether it failed."""

    name: str
    content: str
    failed: bool


def run_call(call: ToolCall | str, tools: Mapping[str, Callable], timeout: float) -> ToolResult:
    """Run one parsed call (or answer a malformed one, ``call`` its error) with ``timeout`` seconds, on a thread
    of its own; errors, unknown names and timeouts are answered ``{'error': ...}`` and marked failed."""
    if isinstance(call, str):
        return ToolResult("unknown", str({"error": call}), True)
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(call.name, str({"error": f"Tool {call.name} not found."}), True)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the tool's failure is the model's feedback
            box["error"] = e

    thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return ToolResult(call.name, str({"error": f"Tool {call.name} timed out after {timeout:g} s."}), True)
    if "error" in box:
        return ToolResult(call.name, str({"error": str(box["error"])}), True)
    result = box.get("result")
    return ToolResult(call.name, result if isinstance(result, str) else str(result), False)
