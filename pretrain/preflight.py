"""Checks that a run can train, made before step 1 and before anything is written into ``output_dir``.

A ``seq_len`` too short for the data used to train on nothing and exit 0
(every example cut to its prompt: loss 0, grad_norm 0, a ``final`` written).
Now it is an error naming the cause and the numbers: when more examples than
``data.max_untrainable_fraction`` keep no trained token once cut to a row,
when the first global batch trains no token, and when the eval set cannot
fill one batch. A data file that is not there is said before the model loads
(:func:`check_data_files`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from pretrain import distributed
from pretrain.config import TrainConfig, data_sources
from pretrain.data.pipeline import packed_batches, tokens_of
from zoo.data.batching import Document, to_model_batch
from zoo.data.files import SUFFIX_FORMATS, looks_like_hub_name
from zoo.errors import UserError
from zoo.storage import local_copy


def data_files(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(config key, path) of every data file or folder a run reads: ``data.path`` and ``data.eval_path``, or a
    mixture's ``data.path[N]`` and ``data.path[N].eval_path`` and its ``data.eval_path``."""
    mixture = isinstance(cfg.data.path, list)
    out = []
    for i, src in enumerate(data_sources(cfg)):  # one source for a plain data.path
        key = f"data.path[{i}]" if mixture else "data.path"
        out.append((key, src.path))
        if src.eval_path:  # a mixture source's own
            out.append((f"{key}.eval_path", src.eval_path))
    if cfg.data.eval_path:
        out.append(("data.eval_path", cfg.data.eval_path))
    return out


def check_data_files(cfg: TrainConfig) -> None:
    """A UserError naming the first data file the run reads (:func:`data_files`) that is not there: neither a
    local file, nor a folder holding .jsonl/.json/.parquet/.txt files, nor a name that reads as a Hub dataset
    (which is looked up when it is read). Called before the model loads, so that a typo costs no load; a file
    on object storage is fetched here (into lmzoo's cache, where it is read from)."""
    for key, path in data_files(cfg):
        p = local_copy(path, key)
        if p.is_file() or (not p.exists() and looks_like_hub_name(path)):
            continue
        if not p.exists():
            raise UserError(f"{key} {path}: no such file or folder")
        if not any(f.suffix in SUFFIX_FORMATS for f in p.rglob("*")):
            raise UserError(f"{key} {path}: a folder with no {', '.join(SUFFIX_FORMATS)} file in it")


def trained_targets(doc: Document, seq_len: int) -> int:
    """The targets ``doc`` trains once cut to a row of ``seq_len + 1`` tokens (plain ids: every target)."""
    n = min(len(tokens_of(doc)), seq_len + 1)
    if not isinstance(doc, dict) or "loss_mask" not in doc:
        return max(0, n - 1)
    return int(np.asarray(doc["loss_mask"][1:n]).sum())


def keeps_a_target(doc: Document, seq_len: int) -> bool:
    """The default test of a trainable example: it keeps a trained target once cut to a row."""
    return trained_targets(doc, seq_len) > 0


def untrainable(docs: Iterable[Document], seq_len: int,
                trainable: Callable[[Document, int], bool] | None = None) -> tuple[int, int, list[int]]:
    """(examples, examples that train nothing once cut to a row, the full lengths of those) among ``docs``.

    ``trainable(doc, seq_len)`` is the task's own test (a pair: both answers keep a token); by default an example is
    trainable when it keeps a trained target.
    """
    trainable = trainable or keeps_a_target
    n, lengths = 0, []
    for d in docs:
        n += 1
        if not trainable(d, seq_len):
            lengths.append(len(tokens_of(d)))
    return n, len(lengths), lengths


def check_untrainable(n: int, bad: int, lengths: list[int], cfg: TrainConfig, label: str) -> None:
    """A UserError when more than ``data.max_untrainable_fraction`` of the ``n`` examples of the data ``label``
    names (``"data.path train.jsonl"``) train nothing (``n``, ``bad``: totals over every process; ``lengths``:
    this process's untrainable examples' lengths)."""
    d = cfg.data
    if not n or bad / n <= d.max_untrainable_fraction:
        return
    median = int(np.median(lengths)) if lengths else 0
    hint = f" (their median length before cutting is {median} tokens)" if median > d.seq_len + 1 else ""
    raise UserError(f"{label}: {bad} of {n} examples ({bad / n:.0%}) keep no trained token once cut to "
                    f"data.seq_len + 1 = {d.seq_len + 1} tokens{hint}, more than data.max_untrainable_fraction = "
                    f"{d.max_untrainable_fraction}; raise data.seq_len")


def data_label(cfg: TrainConfig) -> str:
    """The run's data as an error names it: ``data.path FILE``, or the mixture's source paths."""
    p = cfg.data.path
    if isinstance(p, list):
        return "the data mixture (" + ", ".join(str(x["path"] if isinstance(x, dict) else x) for x in p) + ")"
    return f"data.path {p}"


def check_first_batch(batches: Any, cfg: TrainConfig) -> None:
    """A UserError when the first global batch trains no token. The iterator is put back where it was."""
    state = batches.get_state()
    try:
        b = to_model_batch(next(batches))
    finally:
        batches.set_state(state)
    trained = distributed.total(int(b["weights"].sum()))
    if trained == 0:
        raise UserError(f"the first batch of {data_label(cfg)} trains no token: its examples are cut to "
                        f"data.seq_len + 1 = {cfg.data.seq_len + 1} tokens before their first trained token; "
                        f"raise data.seq_len")


def fills_batch(docs: list[Document], cfg: TrainConfig, micro: int, packing: str,
                budgets: dict[str, int] | None = None) -> bool:
    """Whether ``docs`` fill at least one eval batch of ``micro`` rows (packed within the task's ``budgets``)."""
    try:
        next(packed_batches(docs, cfg.data.seq_len, micro, cfg.seed, 1, packing, cfg.data.max_segments, budgets))
    except StopIteration:
        return False
    return True


def check_eval(docs: list[Document], cfg: TrainConfig, micro: int, packing: str,
               budgets: dict[str, int] | None = None) -> None:
    """A UserError when the eval set cannot fill one batch of ``micro`` rows (packed within the task's
    ``budgets``), or trains no token."""
    d = cfg.data
    if isinstance(d.path, list):
        where = "the eval sets of data.path's sources" + (f" and data.eval_path {d.eval_path}" if d.eval_path else "")
    elif d.eval_path:
        where = f"data.eval_path {d.eval_path}"
    else:
        where = f"data.eval_fraction {d.eval_fraction} of data.path {d.path}"
    size = f"{len(docs)} examples, {sum(len(tokens_of(x)) for x in docs)} tokens"
    if not docs:
        cut = (f"none fits data.seq_len + 1 = {d.seq_len + 1} tokens (data.long_examples: drop); raise data.seq_len"
                if d.long_examples == "drop" else "add eval examples")
        raise UserError(f"the eval set ({where}) has no usable example: {cut}")
    row = "examples" if packing == "none" else f"rows of data.seq_len + 1 = {d.seq_len + 1} tokens"
    if not fills_batch(docs, cfg, micro, packing, budgets):
        raise UserError(f"the eval set ({where}: {size}) cannot fill one eval batch of batch_size / grad_accum = "
                        f"{micro} {row}; add eval examples (data.eval_path), raise data.eval_fraction, or raise "
                        f"grad_accum (an eval batch is batch_size / grad_accum rows)")
    if sum(trained_targets(x, d.seq_len) for x in docs) == 0:
        raise UserError(f"the eval set ({where}: {size}) keeps no trained token once cut to data.seq_len + 1 = "
                        f"{d.seq_len + 1} tokens; raise data.seq_len")
