"""Evaluation tasks for `zoo eval`: a small YAML file beside a data file (JSONL, or text for perplexity).

``--tasks`` takes names of shipped tasks (the YAML files in ``eval/tasks/``,
see ``zoo eval --list-tasks``) or paths to YAML files of your own. A task
file is a mapping (loaded with ``yaml.safe_load``); relative paths in it are
relative to the YAML file. Keys every task has::

    name: my_task            # default: the file's stem
    version: 1               # recorded in the results; bump it when you change the task
    kind: multiple_choice    # perplexity | multiple_choice | generation
    data: my_task.jsonl      # the rows (see each kind below)
    description: one line    # optional

``kind: perplexity`` -- word/byte/token perplexity and bits per byte of documents::

    data: text.txt           # a .txt/.json/.jsonl/.parquet file or folder, or a Hub dataset name
                             # (read with zoo.data.files.load_dataset_rows; .txt: one document per line,
                             # blank lines dropped)
    split: train             # Hub datasets only
    text_field: text         # the documents' field
    window: 512              # tokens per window (lm-eval's max_length); long documents are cut into windows
    chunk: 2048              # optional: a longer window is read this many tokens per forward pass through
                             # the KV cache (the same scores, a chunk's memory; zoo eval --chunk overrides)
    overlap: 4               # optional: tokens of the previous window re-read before each window
                             # (default: lm-eval's rolling windows, the last one filled up with context)

Every token of a document (encoded with the tokenizer's special tokens, as lm-evaluation-harness encodes it)
is scored exactly once, the first one given the tokenizer's BOS token (EOS when it has none). Metrics as
lm-eval's: ``word_perplexity = exp(nll / words)`` (words split on whitespace), ``byte_perplexity =
exp(nll / utf8_bytes)``, ``bits_per_byte = nll / (ln 2 * utf8_bytes)``; also ``ppl = exp(nll / tokens)``
and ``bpb`` (= bits_per_byte), summed over all documents.

``kind: multiple_choice`` -- lm-evaluation-harness style log-likelihood
ranking. Each row gives a context, its choices and the gold index::

    data: questions.jsonl    # rows like {"question": "2 + 2 =", "choices": ["3", "4", "5", "6"], "answer": 1}
    context: "Question: {question}\\nAnswer:"   # str.format over the row's fields (default "{context}")
    choices: choices         # the field holding the list of choice strings, or a fixed list ([A, B, C, D])
    gold: answer             # the field holding the gold index (0-based), a list of them, or the choice's text
    target_delimiter: " "    # put between context and each choice (default one space)
    num_fewshot: 0           # solved examples put before each question (from fewshot_data, else
                             # from the other rows of data)
    fewshot_data: train.jsonl
    fewshot_separator: "\\n\\n"
    fewshot_sampler: first_n # or random: a draw seeded by fewshot_seed (default 1234) and the row
    prompt_description: ""   # text before the examples and the question (lm-eval's description)
    gen_prefix: ""           # text after the question that the answer continues (lm-eval's gen_prefix)

``acc`` is the argmax of the choices' summed continuation log-likelihood;
``acc_norm`` divides each by the choice's length in characters first (as
lm-evaluation-harness), ``acc_bytes`` by its UTF-8 length in bytes.

``kind: generation`` -- greedy answers scored by exact match or a regex::

    data: qa.jsonl
    messages: messages       # EITHER a field holding a chat (list of {role, content}): the prompt is the
                             # turns before the last assistant turn, the reference is that turn's content
    prompt: "Q: {question}\\nA:"  # OR a prompt template and a reference template over the row's fields
    target: "{answer}"
    chat_template: true      # wrap the prompt as one user turn (default: true with messages, else false)
    max_new_tokens: 32
    stop: ["\\n"]             # the answer is cut at the first of these (default: none)
    scorer: exact_match      # or regex: compare what `regex` extracts from the answer
    regex: "(-?[0-9.,]+)"    # with scorer: regex; the LAST match counts (its group 1 if it has one)
    ignore_case: false
    strip_whitespace: false  # true: compare without surrounding whitespace (lm-eval compares as is)
    num_fewshot: 0           # as above: each shot is prompt + target_delimiter + target (default " "),
                             # joined by fewshot_separator; with chat_template, earlier user/assistant turns
                             # (fewshot_sampler, prompt_description and gen_prefix as above)

Without the chat template, a ``messages`` prompt is its turns' contents, one
per line.

Rows with images (a vision-language model; ``zoo eval`` only, not ``eval.tasks`` during training): a row's
``images`` column (a list of paths relative to the data file, bytes or ``{"bytes", "path"}``), or ``image`` (one),
or the column ``image_column:`` names, and, in a ``messages`` chat, TRL's content parts (``{"type": "image"}``,
``{"type": "text", "text": ...}``). Under the chat template the images go where TRL puts them (the image parts,
else before the first user turn's text); in a plain-text prompt or a multiple-choice context, at each
``<image>`` placeholder of the text, else all before it. Each image is expanded as the model's processor expands
it and its pixels reach the prefill (generation) or the forward (multiple choice). Not with few-shot examples::

    image_column: images     # optional (default: images, else image)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.data.files import load_dataset_rows
from zoo.errors import UserError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
KINDS = ("perplexity", "multiple_choice", "generation")
SCORERS = ("exact_match", "regex")

# Keys each kind accepts (beyond the common ones), so that a typo is an error, not a silent default.
_COMMON = {"name", "version", "kind", "data", "description"}
_FEWSHOT = {"num_fewshot", "fewshot_data", "fewshot_separator", "fewshot_sampler", "fewshot_seed", "target_delimiter",
            "gen_prefix", "prompt_description"}
_KEYS = {
    "perplexity": {"split", "text_field", "window", "overlap", "chunk"},
    "multiple_choice": {"context", "choices", "gold", "image_column"} | _FEWSHOT,
    "generation": {"messages", "prompt", "target", "chat_template", "max_new_tokens", "stop", "scorer", "regex",
                   "ignore_case", "strip_whitespace", "image_column"} | _FEWSHOT,
}
IMAGE_COLUMNS = ("images", "image")  # TRL's: a list of images, or one image
SAMPLERS = ("first_n", "random")


@dataclass
class Task:
    """One evaluation task: its settings (from the YAML file) and where its data lives."""

    name: str
    kind: str
    data: str
    version: int | str = 1
    description: str = ""
    source: str = ""  # the YAML file (or "<memory>")
    options: dict[str, Any] = field(default_factory=dict)
    _fewshot: list[dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    def opt(self, key: str, default: Any = None) -> Any:
        """A kind-specific setting, or ``default`` when the YAML file leaves it out."""
        value = self.options.get(key)
        return default if value is None else value

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The task's examples (JSONL rows; for perplexity, ``{text_field: document}`` rows), first ``limit``."""
        if self.kind == "perplexity":
            rows = _text_rows(self.data, self.opt("text_field", "text"), self.opt("split", "train"), self.source)
        else:
            rows = read_jsonl(self.data, self.source)
        return rows[:limit] if limit else rows

    def row_where(self, i: int) -> str:
        """Row ``i`` of the task's data as a person finds it: ``"qa.jsonl, line 3"``."""
        from zoo.data.row_origin import row_where

        return row_where(self.data, i)

    def row_images(self, row: dict[str, Any]) -> list[Any]:
        """The images of ``row``: its ``image_column``, else ``images``, else ``image`` (one); none: []."""
        column = self.opt("image_column")
        for name in (column,) if column else IMAGE_COLUMNS:
            value = row.get(name)
            if value is not None:
                if name == "image" and not column:
                    return [value]
                return list(value) if isinstance(value, list | tuple) else [value]
        return []

    def has_images(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` has images: an images column, or image parts in its ``messages`` chat."""
        msgs = row.get(self.opt("messages")) if self.opt("messages") else None
        parts = [p for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list)
                 for p in m["content"]] if isinstance(msgs, list) else []
        return bool(self.row_images(row)) or any(isinstance(p, dict) and p.get("type") == "image" for p in parts)

    def fewshot_rows(self) -> list[dict[str, Any]] | None:
        """Rows of ``fewshot_data`` (None: shots come from the task's own rows), read once."""
        path = self.opt("fewshot_data")
        if not path:
            return None
        if self._fewshot is None:
            self._fewshot = read_jsonl(path, self.source)
        return self._fewshot


def fewshot_pool(task: Task, rows: list[dict[str, Any]], i: int, k: int) -> list[dict[str, Any]]:
    """The ``k`` solved examples put before row ``i``: from ``fewshot_data``, else the task's other rows.

    ``fewshot_sampler: first_n`` (the default) takes the first ones; ``random`` draws ``k`` without replacement,
    seeded by ``fewshot_seed`` (default 1234, lm-evaluation-harness's) and the row's index, so a run is
    repeatable and each row gets its own draw."""
    if k <= 0:
        return []
    shots = task.fewshot_rows()
    pool = shots if shots is not None else [r for j, r in enumerate(rows) if j != i]
    if task.opt("fewshot_sampler", "first_n") == "random":
        import random

        return random.Random(f"{task.opt('fewshot_seed', 1234)}:{i}").sample(pool, min(k, len(pool)))
    return pool[:k]


def joined(prefix: str, suffix: str, delimiter: str = " ") -> str:
    """``prefix + delimiter + suffix``, the delimiter only where neither side has whitespace at the join
    (lm-evaluation-harness's rule for a ``gen_prefix``); either side may be empty."""
    if not prefix or not suffix:
        return prefix + suffix
    return prefix + suffix if prefix[-1].isspace() or suffix[0].isspace() else prefix + delimiter + suffix


def shipped_tasks() -> dict[str, Path]:
    """Name -> YAML file of the tasks that ship with lmzoo."""
    return {p.stem: p for p in sorted(TASKS_DIR.glob("*.yaml"))}


def resolve_tasks(spec: str | list[str]) -> list[Task]:
    """Tasks from ``--tasks`` (comma-separated names of shipped tasks and/or paths of YAML files)."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s and s.strip()]
    if not items:
        raise UserError("--tasks is empty; give task names (see `zoo eval --list-tasks`) or YAML file paths")
    shipped = shipped_tasks()
    out = []
    for item in items:
        if item in shipped:
            out.append(load_task(shipped[item]))
        elif item.endswith((".yaml", ".yml")) or "/" in item or Path(item).exists():
            out.append(load_task(item))
        else:
            raise UserError(f"--tasks {item}: no shipped task of that name and not a .yaml path; "
                            f"shipped tasks: {', '.join(shipped) or 'none'}")
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"--tasks names {', '.join(dup)} more than once; give each task once (or rename one)")
    return out


def load_task(path: str | Path) -> Task:
    """Read and check one task YAML file (errors are one-line UserErrors naming the file and the fix)."""
    import yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"task file {path}: no such file; give a shipped task name or the path of a .yaml task file")
    try:
        spec = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).replace("\n", " ")[:200]
        raise UserError(f"task file {path}: not valid YAML ({first}); fix the syntax") from None
    return task_from_dict(spec, path)


def task_from_dict(spec: Any, path: str | Path | None = None) -> Task:
    """A :class:`Task` from a parsed YAML mapping; relative data paths are taken from ``path``'s folder."""
    where = f"task file {path}" if path else "task"
    if not isinstance(spec, dict):
        raise UserError(f"{where}: must be a YAML mapping (name:, kind:, data:, ...); see eval/tasks/README.md")
    kind = spec.get("kind")
    if kind not in KINDS:
        raise UserError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}; set kind:")
    unknown = sorted(set(spec) - _COMMON - _KEYS[kind])
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} for kind {kind}; "
                        f"allowed: {', '.join(sorted(_COMMON | _KEYS[kind]))}")
    if not isinstance(spec.get("data"), str) or not spec["data"]:
        raise UserError(f"{where}: needs data: (the path of the task's data file, relative to the YAML file)")
    base = Path(path).parent if path else Path(".")
    data = spec["data"]
    local = (base / data).expanduser()
    if kind != "perplexity" or local.exists() or not _hub_like(data):
        data = os.path.normpath(local.absolute())  # a Hub dataset name stays a name
    name = str(spec.get("name") or (Path(path).stem if path else "task"))
    options = {k: v for k, v in spec.items() if k not in _COMMON}
    if options.get("fewshot_data"):
        options["fewshot_data"] = os.path.normpath((base / options["fewshot_data"]).expanduser().absolute())
    task = Task(name=name, kind=kind, data=data, version=spec.get("version", 1),
                description=str(spec.get("description") or ""), source=str(path or "<memory>"), options=options)
    _check(task, where)
    return task


def _hub_like(data: str) -> bool:
    parts = data.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and Path(data).suffix == "" and not data.startswith((".", "~"))


def _check(task: Task, where: str) -> None:
    """Type checks of the kind-specific settings (cheap; the data is checked when it is read)."""
    o = task.options
    for key in ("window", "overlap", "chunk", "num_fewshot", "max_new_tokens"):
        if key in o and (not isinstance(o[key], int) or isinstance(o[key], bool) or o[key] < 0):
            raise UserError(f"{where}: {key} must be a non-negative integer, not {o[key]!r}")
    if task.kind == "perplexity" and o.get("chunk") == 0:
        raise UserError(f"{where}: chunk must be at least 1")
    if task.kind == "perplexity" and task.opt("overlap", 0) >= task.opt("window", 512):
        raise UserError(f"{where}: overlap must be smaller than window")
    if task.kind == "generation":
        if bool(o.get("messages")) == bool(o.get("prompt")):
            raise UserError(f"{where}: a generation task needs either messages: (a chat field) or prompt: "
                            "and target: (templates over the row's fields)")
        if o.get("prompt") and not o.get("target"):
            raise UserError(f"{where}: prompt: needs a target: template (e.g. target: \"{{answer}}\")")
        scorer = o.get("scorer", "exact_match")
        if scorer not in SCORERS:
            raise UserError(f"{where}: scorer {scorer!r} is not one of {', '.join(SCORERS)}")
        if scorer == "regex":
            import re

            if not isinstance(o.get("regex"), str):
                raise UserError(f"{where}: scorer: regex needs regex: (a pattern; its last match is compared)")
            try:
                re.compile(o["regex"])
            except re.error as e:
                raise UserError(f"{where}: regex {o['regex']!r} does not compile ({e}); fix the pattern") from None
    if task.opt("fewshot_sampler", "first_n") not in SAMPLERS:
        raise UserError(f"{where}: fewshot_sampler {o['fewshot_sampler']!r} is not one of {', '.join(SAMPLERS)}")
    for key in ("description", "prompt_description", "gen_prefix", "target_delimiter", "fewshot_separator"):
        if key in o and not isinstance(o[key], str):
            raise UserError(f"{where}: {key} must be a string, not {o[key]!r}")
    if task.kind == "multiple_choice" and isinstance(o.get("choices"), list):
        if not (o["choices"] and all(isinstance(c, str) and c for c in o["choices"])):
            raise UserError(f"{where}: choices must name a field or be a list of non-empty strings")
    if task.kind == "generation":
        stop = o.get("stop")
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise UserError(f"{where}: stop must be a list of non-empty strings, e.g. stop: [\"\\n\"]")


def read_jsonl(path: str | Path, source: str = "") -> list[dict[str, Any]]:
    """Rows of a JSONL file (one JSON object a line; blank lines skipped)."""
    p = Path(path)
    where = f" (named in {source})" if source else ""
    if not p.is_file():
        raise UserError(f"task data {p}{where}: no such file; fix data: in the task file (relative to it)")
    rows = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"task data {p}:{i}: not valid JSON ({e.msg}); one JSON object per line") from None
        if not isinstance(row, dict):
            raise UserError(f"task data {p}:{i}: each line must be a JSON object")
        rows.append(row)
    if not rows:
        raise UserError(f"task data {p}{where}: no rows")
    from zoo.data.row_origin import remember_origin

    remember_origin(str(p), [p], "json")  # a bad row is then named by its line (Task.row_where)
    return rows


def _text_rows(data: str, text_field: str, split: str, source: str) -> list[dict[str, Any]]:
    """Documents for a perplexity task: ``{text_field: text}`` rows."""
    p = Path(data)
    if p.suffix == ".txt" and p.is_file():
        # One document a line, like `datasets`' text loader, without its cache and progress bars.
        docs = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not docs:
            raise UserError(f"task data {p} (named in {source}): no text")
        return [{text_field: d} for d in docs]

    ds, _ = load_dataset_rows(data, split)
    if text_field not in ds.column_names:
        raise UserError(f"task data {data} (named in {source}): no '{text_field}' field (columns: "
                        f"{ds.column_names}); set text_field: in the task file")
    return [{text_field: t} for t in ds[text_field] if isinstance(t, str) and t.strip()]


def format_row(template: str, row: dict[str, Any], task: Task, key: str) -> str:
    """``template.format(**row)`` with a one-line error naming the task and the missing field."""
    try:
        return template.format_map(row)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise UserError(f"task {task.name} ({task.source}): {key}: {template!r} cannot be filled from the row "
                        f"(fields: {', '.join(row)}): {e}; fix the template or the data") from None


def field_of(row: dict[str, Any], key: str, task: Task) -> Any:
    """A row's field, or a one-line error naming the task and the field."""
    if key not in row:
        raise UserError(f"task {task.name} ({task.source}): a row has no '{key}' field (fields: {', '.join(row)}); "
                        "fix the task file or the data")
    return row[key]
