"""The configuration reference as Markdown: every key of each command's config schema, read from the dataclasses.

A key's type and default come from the dataclass (``dataclasses.fields``, ``typing.get_type_hints``); its choices
and range from the field's ``metadata`` (``choices``, ``range``: what :func:`pretrain.config.load_config` checks)
or a ``Literal[...]`` type; its doc line from the source, as the config modules write it: the comment lines right
above the field and the comment at the end of its line (an attribute docstring under it too, should one appear).
A section's intro is its class docstring. Nothing is written by hand, so the page follows the code.

Schema-agnostic: :func:`render_page` takes the commands and their schemas (``demo/config_reference.py`` names
them: it stands above every task). Keys that every schema shares are listed once; each command then lists the
keys its schema adds or declares differently.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import tokenize
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pretrain.config import DataSection, TrainConfig
from pretrain.config_unread import Unread

NONE = "—"  # a cell with nothing to say (no choices, no range, no doc line)
REQUIRED = "required"  # the default of a key without one (a mixture source's path)
# Tool directives at the end of a line are not documentation.
_DIRECTIVE = re.compile(r"^(noqa|type:|pragma|fmt:|ruff:|mypy:)")


@dataclass(frozen=True)
class KeyDoc:
    """One config key as the reference shows it (every text already plain; the table escapes it)."""

    key: str  # dotted: grpo.num_generations, data.path[N].weight
    type: tuple[str, ...]  # the alternatives: ("str", "null")
    default: str
    choices: tuple[str, ...]  # the allowed values as YAML writes them; () when any value of the type goes
    range: str  # an interval, "[0, 1)", or NONE
    why: str  # why the range is what it is ('' when the field's metadata does not say)
    doc: str  # NONE when the source has no doc line for it
    section: str  # the top-level key it sits under ("" for a top-level scalar)


@dataclass(frozen=True)
class SectionDoc:
    """A config section (``model``, ``dpo``, ...) and its class's docstring."""

    name: str
    cls: type
    doc: str


@functools.cache
def _module_source(path: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    """A source file parsed: its syntax tree, the comment of each line that has one, and its lines."""
    text = Path(path).read_text()
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    return ast.parse(text), comments, text.splitlines()


def _comment_text(comment: str) -> str:
    """``# the text`` -> ``the text``; a tool directive (``# noqa: F401``) -> ''."""
    text = comment.lstrip("#").strip()
    return "" if _DIRECTIVE.match(text) else text


def _class_node(cls: type) -> ast.ClassDef | None:
    """The ``class`` statement of ``cls`` in its module's source (a top-level or nested class)."""
    tree = _module_source(inspect.getsourcefile(cls) or "")[0]
    node: ast.AST = tree
    for part in cls.__qualname__.split("."):
        body = getattr(node, "body", [])
        found = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if found is None:
            return None
        node = found
    return cast(ast.ClassDef, node)


def own_field_docs(cls: type) -> dict[str, str]:
    """The doc line of each field that ``cls`` itself declares (not its bases'), read from its source: the
    comment-only lines right above the field, the comment at the end of its statement's lines, and a string
    right under it (an attribute docstring), joined in that order. A field without any is left out."""
    node = _class_node(cls)
    if node is None:
        return {}
    _, comments, lines = _module_source(inspect.getsourcefile(cls) or "")
    out: dict[str, str] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        parts: list[str] = []
        above = stmt.lineno - 1
        while above >= 1 and lines[above - 1].strip().startswith("#"):
            above -= 1
        parts += [_comment_text(comments[n]) for n in range(above + 1, stmt.lineno)]
        end = stmt.end_lineno or stmt.lineno
        parts += [_comment_text(comments[n]) for n in range(stmt.lineno, end + 1) if n in comments]
        nxt = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            parts.append(inspect.cleandoc(nxt.value.value))
        text = " ".join(" ".join(p.split()) for p in parts if p)
        if text:
            out[stmt.target.id] = text
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The doc line of each field of dataclass ``cls``: where a subclass redeclares a field, its own line (or
    none) replaces its base's."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs = own_field_docs(base)
            for name in inspect.get_annotations(base):
                out.pop(name, None)
                if name in docs:
                    out[name] = docs[name]
    return out


def class_doc(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring, on one line ('' if it has none)."""
    doc = inspect.getdoc(cls) if "__doc__" in cls.__dict__ else None
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature is not a docstring
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def type_text(t: Any) -> str:
    """A type as a config user reads it: ``str or null``, ``list[str] or str``, ``any``."""
    if t is type(None):
        return "null"
    if t is Any:
        return "any"
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return " or ".join(sorted({type(a).__name__ for a in typing.get_args(t)}))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in typing.get_args(t))
    if origin is not None:
        args = ", ".join(type_text(a) for a in typing.get_args(t))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(t, "__name__", str(t))


def value_text(value: Any) -> str:
    """A default as YAML writes it: null, true, 0.0003, [], {}, a string as it is ('' for an empty one)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (its factory's product)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _choices(f: dataclasses.Field[Any], t: Any) -> tuple[Any, ...]:
    """A field's allowed values: its metadata's ``choices``, or the values of a ``Literal[...]`` type."""
    if f.metadata.get("choices"):
        return tuple(f.metadata["choices"])
    args = [a for a in typing.get_args(t) if a is not type(None)] if typing.get_origin(t) is not typing.Literal \
        else [t]
    for a in args:
        if typing.get_origin(a) is typing.Literal:
            return typing.get_args(a)
    return ()


def _field_key(prefix: str, section: str, f: dataclasses.Field[Any], t: Any, doc: str) -> KeyDoc:
    """The reference row of field ``f`` (type ``t``) at ``prefix``."""
    default = _default(f)
    interval = f.metadata.get("range")
    why = f.metadata.get("why")
    alternatives = typing.get_args(t) if typing.get_origin(t) in (typing.Union, types.UnionType) else (t,)
    return KeyDoc(key=prefix + f.name, type=tuple(type_text(a) for a in alternatives),
                  default=REQUIRED if default is dataclasses.MISSING else value_text(default),
                  choices=tuple(value_text(c) for c in _choices(f, t)),
                  range=interval or NONE, why=why or "",
                  doc=doc or NONE, section=section)


def schema_keys(schema: type, prefix: str = "", section: str = "") -> list[KeyDoc]:
    """Every key of dataclass ``schema``, in declaration order, its sections' keys flattened (dotted); after
    ``data.path``, the keys each source of a mixture may set (``data.path[N].weight``, the section's
    ``source_class``)."""
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    out: list[KeyDoc] = []
    for f in dataclasses.fields(schema):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += schema_keys(cast(type, t), f"{prefix}{f.name}.", section or f.name)
            continue
        out.append(_field_key(prefix, section, f, t, docs.get(f.name, "")))
        source = getattr(schema, "source_class", None)
        if f.name == "path" and isinstance(schema, type) and issubclass(schema, DataSection) and source:
            out += schema_keys(source, f"{prefix}path[N].", section)
    return out


def sections(schema: type) -> list[SectionDoc]:
    """The sections (nested dataclasses) of ``schema``, in declaration order, with their docstrings."""
    hints = typing.get_type_hints(schema)
    return [SectionDoc(f.name, cast(type, hints[f.name]), class_doc(cast(type, hints[f.name])))
            for f in dataclasses.fields(schema) if dataclasses.is_dataclass(hints[f.name])]


def undocumented(schemas: Sequence[type]) -> list[str]:
    """The keys of ``schemas`` that have no doc line in the source (each once, in order)."""
    seen: dict[str, None] = {}
    for schema in schemas:
        for k in schema_keys(schema):
            if k.doc == NONE:
                seen.setdefault(k.key, None)
    return list(seen)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _plain(text: str) -> str:
    """Text outside code spans, safe in a table cell: pipes escaped (they would split the cell), angle brackets as
    entities (they would read as HTML), asterisks escaped (a pair would turn the text between into italics), opening
    brackets escaped (``[a](b)`` would be a link, one that ``mkdocs build --strict`` checks)."""
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            .replace("*", "\\*").replace("[", "\\["))


def cell(text: str) -> str:
    """``text`` safe in a Markdown table cell. Code spans stay as they are (Markdown reads them literally), unless
    one holds a pipe: renderers differ on a pipe inside code in a table, so that span becomes plain text."""
    out, at = [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_plain(text[at:m.start()]))
        out.append(_plain(m[2]) if "|" in m[2] else m[0])
        at = m.end()
    out.append(_plain(text[at:]))
    return "".join(out)


def code(text: str) -> str:
    """``text`` as inline code in a table cell (NONE, or text that holds a backtick or a pipe, as plain text)."""
    return NONE if text == NONE else cell(text) if "`" in text or "|" in text else f"`{text}`"


def _table(keys: Sequence[KeyDoc]) -> list[str]:
    rows = ["| Key | Type | Default | Choices | Range | Description |", "|---|---|---|---|---|---|"]
    for k in keys:
        choices = ", ".join(code(c) for c in k.choices) or NONE
        interval = code(k.range) + (f" ({cell(k.why)})" if k.why else "")
        kinds = " or ".join(code(t) for t in k.type)
        default = k.default if k.default == REQUIRED else code(k.default)
        rows.append(f"| `{k.key}` | {kinds} | {default} | {choices} | {interval} | {cell(k.doc)} |")
    return rows


def _grouped(keys: Sequence[KeyDoc], schema: type, heading: str) -> list[str]:
    """``keys`` as one table per section, the top-level keys first, each section under its heading and intro."""
    out: list[str] = []
    top = [k for k in keys if not k.section]
    if top:
        out += [f"{heading} Top-level keys", "", *_table(top), ""]
    for s in sections(schema):
        rows = [k for k in keys if k.section == s.name]
        if rows:
            out += [f"{heading} `{s.name}`", ""]
            if s.doc:
                out += [cell(s.doc), ""]
            out += [*_table(rows), ""]
    return out


INTRO = """\
# Configuration reference

<!-- Generated by `{command}` from the config dataclasses: do not edit by hand. -->

Every key a `train` command reads. Set keys in the YAML file given with `--config`, nested by section
(`grpo:` then `num_generations: 4`), or on the command line as `key.sub=value` overrides
(`grpo.num_generations=4`), which win over the file; `'~key.sub'` (quoted: the shell expands `~`) removes a
key or a whole section the file sets (`'~lora'` trains a LoRA config's run in full).
`<command> train --config run.yaml --print-config` prints the fully resolved config, defaults included, and exits.

- **Type**: `or null` means the key may be left unset (`null`, or not written).
- **Choices**: the values the key accepts; any other is an error naming them.
- **Range**: the interval a number must lie in (`[` and `]` include the bound, `(` and `)` exclude it;
  `inf` is no bound).
- **Read only when**: a key set to other than its default that the run will not read (an RLOO run's
  `grpo.loss_type`, `distill.*` without a teacher, LoRA's keys without `lora.rank`) is an error that names why
  (one line, exit 2, nothing written); each section ends with its keys that are read only under a condition.
  A key at its default passes, so a config printed by `--print-config` reads back.
- `model: PATH` is short for `model.path: PATH`.
- `data.path` is a file, a folder or a Hub dataset name, or a list of sources (a mixture); the
  `data.path[N].*` keys are what each source of the list may set (`data.path[1].weight=0.5` on the command line).

The keys every command shares are listed once, under [Common keys](#common-keys); each command's section lists
only the keys it adds or declares differently (another default, type, range or meaning).
"""


def _placeholders(why: str) -> str:
    """A reason as the reference shows it: its config-value placeholders (``{cfg.dpo.loss_type}``) written
    ``<dpo.loss_type>``."""
    return re.sub(r"\{cfg\.([\w.]+)\}", r"<\1>", why)


def _unread_list(rules: Sequence[Unread], heading: str) -> list[str]:
    """The keys read only under a condition (a schema's ``UNREAD`` rules), each with its error's reason, the
    config values it names written ``<key>``."""
    if not rules:
        return []
    items = [f"- {code(r.key)} {cell(_placeholders(r.why))}" for r in rules]
    return [f"{heading} Keys read only under a condition", "",
            "Each, set to other than its default where the run will not read it, is an error:", "", *items, ""]


def render_page(commands: Sequence[tuple[str, type[TrainConfig]]], command: str) -> str:
    """The whole reference page: the intro (naming ``command``, the one that regenerates it), the keys
    :class:`TrainConfig` declares, then per command (``("sft train", SFTConfig)``, ...) the keys its schema adds
    or declares differently."""
    common = schema_keys(TrainConfig)
    out = [INTRO.format(command=command), "## Common keys", "",
           "Read by every command: " + ", ".join(f"`{name}`" for name, _ in commands) + ".", "",
           *_grouped(common, TrainConfig, "###"), *_unread_list(TrainConfig.UNREAD, "###")]
    by_key = {k.key: k for k in common}
    for name, schema in commands:
        own = [k for k in schema_keys(schema) if by_key.get(k.key) != k]
        what = cell(class_doc(schema))
        out += [f"## {name}", "", f"{what} Schema: `{schema.__module__}.{schema.__qualname__}`.", ""]
        rules = [r for r in schema.UNREAD if r not in TrainConfig.UNREAD]
        if not own:
            out += ["Only the [common keys](#common-keys).", "", *_unread_list(rules, "###")]
            continue
        out += ["The [common keys](#common-keys), and:", "", *_grouped(own, schema, "###"),
                *_unread_list(rules, "###")]
    return "\n".join(out).rstrip("\n") + "\n"
