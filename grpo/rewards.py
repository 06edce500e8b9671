"""Reward functions for GRPO: loaded from ``grpo.rewards`` (:func:`load_rewards`), scored and weighted per batch
(:meth:`RewardSet.compute`).

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float |
None]`` (the shipped ones: :mod:`grpo.verifiers`), so a TRL reward function carries over as it is. The batch's
total reward is TRL's too: the weighted sum over functions, a None ("does not apply") dropping out of it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from grpo import verifiers
from zoo.errors import UserError

# The arguments the trainer passes every reward function by name (TRL's); a data column or a grpo.rewards key of
# the same name would collide with them.
CALL_ARGS = ("prompts", "completions", "completion_ids")


@dataclass
class RewardFunction:
    """One reward function as configured: its name (in logs and errors), the function, and the keyword
    arguments its grpo.rewards mapping gave it."""

    name: str
    fn: Callable[..., Sequence[Any]]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Signature:
    """What a function accepts by name, read once: whether it takes ``**kwargs``, its named parameters, and the
    ones without a default (None where the signature cannot be read: pass everything, as TRL does)."""

    var_keyword: bool = True
    names: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()

    @classmethod
    def of(cls, fn: Callable) -> _Signature:
        """``fn``'s signature, or one that accepts anything when Python cannot tell (some builtins)."""
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return cls()
        named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return cls(var_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
                   names=frozenset(p.name for p in named if p.kind is not p.POSITIONAL_ONLY),
                   required=frozenset(p.name for p in named if p.default is p.empty))


class RewardSet:
    """The configured reward functions and their weights; :meth:`compute` scores a batch of completions."""

    def __init__(self, functions: list[RewardFunction], weights: Sequence[float] | None = None):
        """``functions`` with one weight each (None: 1.0 each)."""
        if weights is None:
            weights = [1.0] * len(functions)
        if len(weights) != len(functions):
            raise UserError(f"grpo.reward_weights has {len(weights)} weights for {len(functions)} reward functions; "
                            f"give one per function")
        self.functions = list(functions)
        self.weights = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(self.weights)):
            raise UserError(f"grpo.reward_weights must be finite numbers, got {list(weights)!r}")
        self._signatures = [_Signature.of(f.fn) for f in self.functions]

    @property
    def names(self) -> list[str]:
        """The functions' names, in order (the columns of :meth:`compute`'s ``per_function``)."""
        return [f.name for f in self.functions]

    def __len__(self) -> int:
        return len(self.functions)

    def __repr__(self) -> str:
        return f"RewardSet({', '.join(f'{n}*{w:g}' for n, w in zip(self.names, self.weights))})"

    def prepare(self, mesh: Any, compute: Any, shared: Any = None) -> None:
        """Load what a reward function holds on the devices (a reward model's weights, on the run's ``mesh``);
        ``shared``: a LoRA policy's frozen base (:class:`grpo.reward_model.SharedBase`), which a reward model's
        adapters over the same checkpoint read instead of a copy."""
        for rf in self.functions:
            if hasattr(rf.fn, "prepare"):
                rf.fn.prepare(mesh, compute, shared)

    def check_columns(self, columns: Sequence[str], label: str) -> None:
        """A UserError when a shipped verifier's data column (:func:`grpo.verifiers.needed_columns`) is not among
        ``columns`` (the data columns the reward functions get, the prompt's aside; ``label`` names the data):
        it would score None on every row, and the run would learn nothing while exiting 0. A user's function
        reads whatever columns it likes (None where absent is its own convention), so it is not checked."""
        for rf in self.functions:
            shipped = verifiers.shipped_name(rf.fn)
            missing = [c for c in verifiers.needed_columns(shipped, rf.kwargs) if c not in columns] if shipped else []
            if missing:
                hint = columns[0] if len(columns) == 1 else "COLUMN"
                raise UserError(f"{label}: reward function {rf.name} needs the column '{missing[0]}' (each row's "
                                f"reference answer), and the rows' columns besides the prompt are "
                                f"{', '.join(columns) or 'none'}; name the column that holds the answers: "
                                f"grpo.rewards: [{{function: {shipped}, answer_field: {hint}}}]")

    def compute(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                columns: Mapping[str, Sequence[Any]], where: Callable[[int], str]) -> tuple[np.ndarray, np.ndarray]:
        """Score B completions: ``(per_function, total)``.

        ``per_function`` is float64 [B, F], NaN where a function returned None; ``total`` float64 [B] is the sum
        over functions of weight * reward with the NaNs left out, as TRL sums (``nansum``), so a row where no
        function applies gets 0.0. Each function is called once with the whole batch, by keyword: ``prompts``,
        ``completions``, ``completion_ids``, every column of ``columns`` (one value per completion) and its
        grpo.rewards keyword arguments (a function without ``**kwargs`` gets only the ones it names).

        ``where(i)`` names completion i's data row (e.g. "data/train.jsonl, line 7") in errors, which are
        UserErrors of one line: a function that raises (the first row that raises alone is named), a result of
        the wrong length, a reward that is not a finite number or None.
        """
        b = len(completions)
        if len(prompts) != b or len(completion_ids) != b or any(len(v) != b for v in columns.values()):
            lengths = {"prompts": len(prompts), "completion_ids": len(completion_ids),
                       **{k: len(v) for k, v in columns.items()}}
            raise ValueError(f"RewardSet.compute: {b} completions but lengths {lengths}")
        clash = sorted(set(columns) & set(CALL_ARGS))
        if clash:
            raise UserError(f"the data has a column named {clash[0]!r}, which is an argument the trainer passes "
                            f"every reward function; rename the column")
        per_function = np.full((b, len(self.functions)), np.nan, dtype=np.float64)
        for j, (rf, sig) in enumerate(zip(self.functions, self._signatures)):
            kwargs = self._arguments(rf, sig, columns)
            batch = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
            try:
                out = rf.fn(**_only(sig, batch), **kwargs)
            except UserError:
                raise  # already says what to fix (a shipped verifier's bad option)
            except Exception as e:  # noqa: BLE001 - the user's code: any failure becomes a one-line error
                raise self._blame(rf, sig, e, batch, kwargs, columns, where) from e
            per_function[:, j] = _rewards(rf.name, out, b, where)
        # TRL: (rewards_per_func * weights).nansum(dim=1); a row of NaNs sums to 0
        total = np.nansum(per_function * self.weights, axis=1)
        return per_function, total

    def _arguments(self, rf: RewardFunction, sig: _Signature, columns: Mapping[str, Sequence[Any]]) -> dict:
        """The keyword arguments besides the batch: the data columns and the configured ones, each once."""
        clash = sorted(set(columns) & set(rf.kwargs))
        if clash:
            raise UserError(f"reward function {rf.name}: its grpo.rewards key {clash[0]!r} is also a data column; "
                            f"rename the column (or the function's argument)")
        if not sig.var_keyword:
            # TRL would pass every column and crash on the first the function does not name; pass those it does.
            # A required argument nobody supplies is a clear error here rather than a TypeError per row later.
            given = set(CALL_ARGS) | set(columns) | set(rf.kwargs)
            missing = sorted(sig.required - given)
            if missing:
                raise UserError(f"reward function {rf.name} needs argument {missing[0]!r}, which is none of "
                                f"{', '.join(CALL_ARGS)}, a data column ({', '.join(sorted(columns)) or 'none'}) "
                                f"or a key of its grpo.rewards entry; add **kwargs or give it a default")
            columns = {k: v for k, v in columns.items() if k in sig.names}
        return {**columns, **rf.kwargs}

    def _blame(self, rf: RewardFunction, sig: _Signature, error: Exception, batch: dict, kwargs: dict,
               columns: Mapping[str, Sequence[Any]], where: Callable[[int], str]) -> UserError:
        """The error for a function that raised on the batch: rerun it on each completion alone, name the first
        row that raises (its own exception); none does (it fails on the batch as a whole): say so."""
        b = len(batch["completions"])
        for i in range(b):
            one = {k: v[i:i + 1] for k, v in batch.items()}
            one_kwargs = {k: (v[i:i + 1] if k in columns else v) for k, v in kwargs.items()}
            try:
                rf.fn(**_only(sig, one), **one_kwargs)
            except Exception as e:  # noqa: BLE001
                return UserError(f"reward function {rf.name} raised {type(e).__name__}: {_one_line(e)} on {where(i)}")
        return UserError(f"reward function {rf.name} raised {type(error).__name__}: {_one_line(error)} on the batch "
                         f"of {b} completions (each completion alone scores)")


def _only(sig: _Signature, batch: dict) -> dict:
    """The batch arguments a function takes (all of them when it has ``**kwargs``)."""
    return batch if sig.var_keyword else {k: v for k, v in batch.items() if k in sig.names}


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return text if len(text) <= limit else text[:limit] + "..."


def _rewards(name: str, out: Any, b: int, where: Callable[[int], str]) -> np.ndarray:
    """A function's result as float64 [B] with NaN for None, or a UserError naming what is wrong with it."""
    if not isinstance(out, (Sequence, np.ndarray)) and hasattr(out, "__array__"):
        out = np.asarray(out)  # a JAX or torch vector
    if isinstance(out, np.ndarray) and out.ndim == 1 and out.dtype.kind in "biuf":
        values = out.astype(np.float64)  # the fast path: a numeric array (it has no None)
        if len(values) != b:
            raise UserError(f"reward function {name} returned {len(values)} rewards for {b} completions; return one "
                            f"per completion (None where it does not apply)")
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise UserError(f"reward function {name} returned {values[bad[0]]} on {where(int(bad[0]))}; return a "
                            f"finite number, or None where the reward does not apply")
        return values
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, (Sequence, np.ndarray)) \
            or (isinstance(out, np.ndarray) and out.ndim != 1):
        what = f"an array of shape {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise UserError(f"reward function {name} returned no list of {b} rewards (got {what}); return one per "
                        f"completion, None where it does not apply")
    if len(out) != b:
        raise UserError(f"reward function {name} returned {len(out)} rewards for {b} completions; return one per "
                        f"completion (None where it does not apply)")
    values = np.empty(b, dtype=np.float64)
    for i, v in enumerate(out):
        try:
            x = _as_float(v)
        except TypeError:
            x = math.nan  # reported below, with the value as the function returned it
        if x is not None and not math.isfinite(x):
            shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."
            raise UserError(f"reward function {name} returned {shown} on {where(i)}; return a finite number, or "
                            f"None where the reward does not apply")
        values[i] = np.nan if x is None else x
    return values


def _as_float(v: Any) -> float | None:
    """A reward as a float (bools are numbers: True is 1.0; a 0-d numpy/JAX/torch scalar too), None for None;
    a TypeError for anything else (a string, a list...)."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_, numbers.Real)):
        return float(v)
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        item = v.item()
        if isinstance(item, (bool, numbers.Real)):
            return float(item)
    raise TypeError(f"not a number: {v!r}")


# ----------------------------------------------------------------------------------------------------- loading


def load_rewards(specs: Sequence[Any] | str, weights: Sequence[float] | None = None) -> RewardSet:
    """The reward functions ``grpo.rewards`` names, with ``grpo.reward_weights`` (None: 1.0 each).

    Each spec is a string or a mapping ``{function: SPEC, name: NAME, other keys: keyword arguments}``; a SPEC
    is a shipped verifier's name (exact_match, final_number, format, length_penalty; see
    :mod:`grpo.verifiers`), ``package.module:function`` (importable: installed, or its folder on PYTHONPATH), or
    ``path/to/file.py:function`` (a file, relative to the current directory). A function's name is the
    mapping's ``name``, else its ``__name__``; repeated names get ``_2``, ``_3``... From Python a spec may also
    be a function itself. Every problem is a UserError of one line naming the spec.
    """
    if isinstance(specs, (str, Mapping)) or callable(specs):
        specs = [specs]
    functions, seen = [], set()
    for spec in specs:
        rf = _load_one(spec)
        name, k = rf.name, 2
        while name in seen:
            name, k = f"{rf.name}_{k}", k + 1
        seen.add(name)
        rf.name = name
        functions.append(rf)
    if not functions:
        raise UserError("grpo.rewards is empty; name at least one reward function (e.g. grpo.rewards=[final_number] "
                        "or a module:function)")
    if weights is not None:
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            weights = [cast(Any, weights)]
        try:
            weights = [float(w) for w in weights]
        except (TypeError, ValueError):
            raise UserError(f"grpo.reward_weights must be numbers, got {weights!r}") from None
    return RewardSet(functions, weights)


def _load_one(spec: Any) -> RewardFunction:
    """One grpo.rewards entry as a RewardFunction (its name not yet made unique)."""
    if isinstance(spec, str):
        fn = _resolve(spec.strip(), spec)
        _check_kwargs(spec, fn, {})  # a bare `format` lacks its pattern: say so now, not at step 1
        return RewardFunction(_name_of(fn), fn, {})
    if callable(spec) and not isinstance(spec, Mapping):
        return RewardFunction(_name_of(spec), spec, {})
    if not isinstance(spec, Mapping):
        raise UserError(f"grpo.rewards entry {spec!r} is not a function (got {type(spec).__name__}); give one (a shipped "
                        f"verifier's name, module:function or path/to/file.py:function) or a mapping "
                        f"{{function: ..., name: ..., other keys: its keyword arguments}}")
    if "function" not in spec:
        hint = ""
        if len(spec) == 1:  # `- exact_match: {ignore_case: true}`: a YAML shape that reads naturally but is not ours
            (key, value), = spec.items()
            if isinstance(value, Mapping):
                flat = ", ".join([f"function: {key}"] + [f"{k}: {v!r}" for k, v in value.items()])
                hint = f" (write {{{flat}}})"
        raise UserError(f"grpo.rewards entry {dict(spec)!r} has no 'function' key; give {{function: NAME or "
                        f"module:function, name: ..., other keys: its keyword arguments}}{hint}")
    target, name = spec["function"], spec.get("name")
    kwargs = {str(k): v for k, v in spec.items() if k not in ("function", "name")}
    if isinstance(target, str):
        fn = _resolve(target.strip(), target)
    elif callable(target):
        fn = target
    else:
        raise UserError(f"grpo.rewards entry {dict(spec)!r}: 'function' must be a string (a shipped verifier's "
                        f"name, module:function or path/to/file.py:function), got {target!r}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise UserError(f"grpo.rewards entry {dict(spec)!r}: 'name' must be a non-empty string, got {name!r}")
    _check_kwargs(target if isinstance(target, str) else _name_of(fn), fn, kwargs)
    return RewardFunction(name.strip() if name else _name_of(fn), fn, kwargs)


def _check_kwargs(label: str, fn: Callable, kwargs: dict[str, Any]) -> None:
    """A UserError for keyword arguments the function cannot take (or that collide with the batch's)."""
    clash = sorted(set(kwargs) & set(CALL_ARGS))
    if clash:
        raise UserError(f"grpo.rewards entry {label!r}: {clash[0]!r} is an argument the trainer passes every reward "
                        f"function; remove the key")
    shipped = verifiers.shipped_name(fn)
    if shipped:
        verifiers.check_options(shipped, kwargs)  # they take **columns, so a misspelt option must be caught here
        return
    sig = _Signature.of(fn)
    unknown = sorted(set(kwargs) - sig.names)
    if unknown and not sig.var_keyword:
        raise UserError(f"grpo.rewards entry {label!r}: {_name_of(fn)} takes no argument {unknown[0]!r} (its "
                        f"arguments: {', '.join(sorted(sig.names)) or 'none'}); remove the key or add it to the "
                        f"function")


def _name_of(fn: Callable) -> str:
    """A function's own name: ``__name__``, a partial's function's, or a callable object's class name."""
    while hasattr(fn, "func") and not hasattr(fn, "__name__"):  # functools.partial
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _resolve(text: str, spec: Any) -> Callable:
    """A SPEC string as the function it names."""
    where = f"grpo.rewards entry {spec!r}"
    from grpo.reward_model import is_reward_model, reward_model

    if is_reward_model(text):  # rm:PATH, a reward model scored in process (grpo/reward_model.py)
        return reward_model(text)
    if ":" not in text:
        if text in verifiers.SHIPPED:
            return verifiers.SHIPPED[text]
        hint = ""
        if text.endswith(".py"):
            hint = f"; to use a function in that file, name it: {text}:FUNCTION"
        elif "." in text:
            module, _, attr = text.rpartition(".")
            hint = f"; for a function in a module, separate them with a colon: {module}:{attr}"
        raise UserError(f"{where}: no shipped reward function {text!r} (shipped: {', '.join(verifiers.SHIPPED)}); "
                        f"or give module:function or path/to/file.py:function{hint}")
    return load_callable(text, where)


def load_callable(text: str, where: str) -> Callable:
    """The function ``module:function`` or ``path/to/file.py:function`` names (``module:Class.method`` reaches
    inside); one-line UserErrors that start with ``where`` (the setting that named it)."""
    source, _, attr = text.rpartition(":")  # the last colon: a Windows drive letter may hold another
    if not source or not attr:
        raise UserError(f"{where}: give module:function or path/to/file.py:function (both sides of the colon)")
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    module = _load_file(source, where) if is_file else _import(source, where)
    obj: Any = module
    for part in attr.split("."):  # module:Class.method reaches inside
        if not hasattr(obj, part):
            found = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
            listing = f" (its functions: {', '.join(found[:20])})" if found else ""
            raise UserError(f"{where}: {source} has no function {attr!r}{listing}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{where}: {source}'s {attr} is not a function (got {type(obj).__name__})")
    return obj


def _import(module: str, where: str) -> Any:
    """An importable module, or a UserError that tells a missing module from one that fails to import."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise UserError(f"{where}: no module named {module!r} can be imported; install it, run from the folder "
                            f"that holds it with PYTHONPATH=. , or give its file: path/to/{module.split('.')[-1]}.py"
                            f":FUNCTION") from None
        raise UserError(f"{where}: importing module {module} failed: {type(e).__name__}: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001 - the user's module: any failure at import is theirs to fix
        raise UserError(f"{where}: importing module {module} failed: {type(e).__name__}: {_one_line(e)}") from e


def _load_file(source: str, where: str) -> Any:
    """The module of a Python file, loaded once per file per process under a name of its own."""
    path = Path(source).expanduser()
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise UserError(f"{where}: {source} {what} (relative paths start at the current directory, {Path.cwd()})")
    resolved = path.resolve()
    # A name of its own per file: two files called rewards.py must not replace each other, and none may shadow
    # an installed module. It is registered in sys.modules (as importlib's recipe does) so that dataclasses and
    # pickling by reference inside the file work; a second spec naming the same file shares the module.
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"_zoo_rewards_{stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UserError(f"{where}: {source} cannot be loaded as Python; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if not isinstance(e, Exception):
            raise
        raise UserError(f"{where}: loading {source} failed: {type(e).__name__}: {_one_line(e)}") from e
    return module


def reward_metrics(names: list[str], per_fn: np.ndarray) -> dict[str, float]:
    """Each reward function's mean and std over the batch's completions it scored, under TRL's names
    ``rewards/{name}/mean`` and ``rewards/{name}/std`` (``per_fn`` [B, F], NaN where a function returned None).
    A function that scored none has NaN for both (TRL's nanmean and nanstd; the metrics log writes null)."""
    m = {}
    for j, name in enumerate(names):
        col = per_fn[:, j]
        seen = col[~np.isnan(col)]
        m[f"rewards/{name}/mean"] = float(seen.mean()) if len(seen) else float("nan")
        m[f"rewards/{name}/std"] = float(seen.std(ddof=1)) if len(seen) > 1 else 0.0 if len(seen) else float("nan")
    return m
