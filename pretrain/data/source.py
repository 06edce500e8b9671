"""One data source read into this process's lanes (a plain ``data.path``, or one source of a mixture).

:func:`read_source` reads a ``data.path``, tokenizes the rows of this
process's lanes and the eval rows, and checks before step 1 that the data can
train. The run's data as a whole is pretrain/data/run.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pretrain import distributed
from pretrain.config import TrainConfig
from pretrain.data.pipeline import fit_documents, lane_rows, split_rows, tokens_of
from pretrain.preflight import check_untrainable
from pretrain.task import RowSource, Task
from zoo.data.batching import Document
from zoo.errors import UserError


def epoch_unit(cfg: TrainConfig, packing: str, group_size: int = 1) -> int:
    """What one step consumes of ``SourceShare.per_epoch``: tokens (packed rows) or documents (one per row, or
    one per group of ``group_size`` rows)."""
    return cfg.batch_size * (cfg.data.seq_len + 1) if packing != "none" else cfg.batch_size // group_size


@dataclasses.dataclass
class SourceShare:
    """One source's share of this process's lanes, and its eval documents."""

    lane_docs: dict[int, list[Document]]  # lane -> its training documents, in the source's shuffled order
    n_long: int  # training documents longer than seq_len + 1 (all processes)
    skipped: int  # bad rows skipped, training and eval (all processes)
    per_epoch: int  # training tokens (packed rows) or documents (one per row) of all lanes (all processes)
    eval_docs: list[Document]
    rows: RowSource  # the source's rows, as the task loaded them


def read_source(cfg: TrainConfig, task: Task[Any], tokenizer: Any, vocab: int, mine: list[int], counted: list[int],
                packing: str, where: str, eval_fraction: float, seed: int | None = None) -> SourceShare:
    """Read ``cfg.data.path`` (one source; ``where`` names it in errors), tokenize this process's lanes' rows
    and the eval rows (``cfg.data.eval_path``, else ``eval_fraction`` held out, split with ``seed``)."""
    d = cfg.data
    assert isinstance(d.path, str)  # one source: a mixture reads each of its own (pretrain/data/mixture.py)
    rows = task.load(d.path, cfg)
    order, eval_rows = split_rows(len(rows), 0.0 if d.eval_path else eval_fraction,
                                  cfg.seed if seed is None else seed)
    lanes = _lanes(cfg, task, order, mine, where)
    counted = [r for r in counted if r % task.group_size == 0]  # only a group's first row counts its document
    docs, cut = _lane_documents(cfg, task, rows, tokenizer, [i for r in mine for i in lanes[r]])
    too_long: set[int] = set(cut)  # tasks that fit their own rows cut some already
    whole = docs  # before cutting (the lengths an error names)
    if packing == "best_fit":  # whole documents only: a longer one must be cut or left out first
        docs, too_long = fit_documents(docs, d.seq_len + 1, d.long_examples)
    lane_docs = {r: [docs[i] for i in lanes[r] if i in docs] for r in mine}
    # Before step 1: a seq_len that cuts most examples down to nothing trained is an error, not a silent no-op;
    # below the limit, an example that trains nothing is left out (it would only fill a row with padding).
    trainable = task.trainable
    counted_docs = [i for r in counted for i in lanes[r] if i in docs]
    bad = [i for i in counted_docs if not trainable(docs[i], d.seq_len)]
    n_cut = distributed.total(len(bad))
    check_untrainable(distributed.total(len(counted_docs)), n_cut, [len(tokens_of(whole[i])) for i in bad], cfg,
                      f"{where} {d.path}")
    if n_cut:
        lane_docs = {r: [x for x in v if trainable(x, d.seq_len)] for r, v in lane_docs.items()}
    empty = distributed.any_process(any(not v for v in lane_docs.values()))
    too_big = distributed.any_process(any(int(tokens_of(x).max()) >= vocab for x in docs.values()))
    n_long = distributed.total(sum(i in too_long for r in counted for i in lanes[r]))
    _check_enough(cfg, where, len(order), vocab, empty, too_big, n_long, n_cut)
    skipped = distributed.total(sum(len(lanes[r]) - len(lane_docs[r]) for r in counted))
    skipped -= n_cut  # cut to nothing: counted as too long (truncated), not as bad
    if d.long_examples == "drop":
        skipped -= n_long  # counted as too long, not as bad
    if packing != "none":
        per_epoch = distributed.total(sum(len(tokens_of(x)) for r in counted for x in lane_docs[r]))
    else:
        per_epoch = distributed.total(sum(len(lane_docs[r]) for r in counted))
    eval_docs, eval_bad = _eval_documents(cfg, task, tokenizer, rows, list(eval_rows), packing)
    return SourceShare(lane_docs, n_long, skipped + eval_bad, per_epoch, eval_docs, rows)


def _lanes(cfg: TrainConfig, task: Task[Any], order: Any, mine: list[int], where: str) -> dict[int, list[int]]:
    """The rows (indices in ``order``, the source's shuffled training rows) each of this process's batch rows
    ``mine`` reads."""
    # A task whose groups of `g` consecutive batch rows read one document each (task.group_size) has
    # batch_size / g lanes of documents; row r reads lane r // g.
    g = task.group_size
    n_lanes = cfg.batch_size // g
    if len(order) < n_lanes:
        per = f"batch_size / {g} = {n_lanes}" if g > 1 else f"batch_size={cfg.batch_size}"
        raise UserError(f"{where} {cfg.data.path}: {len(order)} training rows, fewer than {per} "
                        "(each row of a batch reads its own share of the documents); add data or lower batch_size")
    return {r: lane_rows(order, n_lanes, r // g) for r in mine}


def _lane_documents(cfg: TrainConfig, task: Task[Any], rows: RowSource, tokenizer: Any,
                    indices: list[int]) -> tuple[dict[int, Document], set[int]]:
    """(documents by row, rows the task cut to fit) of this process's rows ``indices``; a bad row stops every
    process, not just the one that read it."""
    d = cfg.data
    failed: UserError | None = None
    docs: dict[int, Document] = {}
    cut: set[int] = set()
    try:
        made = task.documents(rows, tokenizer, str(d.path), d.skip_bad_rows, indices)
        docs, cut = dict(made.docs), made.too_long
    except UserError as e:  # a bad row in this process's share: every process must stop, not just this one
        failed = e
    if distributed.any_process(failed is not None):
        raise failed or UserError(f"{d.path}: another process found a bad row (its error names it)")
    return docs, cut


def _check_enough(cfg: TrainConfig, where: str, n_rows: int, vocab: int, empty: bool, too_big: bool, n_long: int,
                  n_cut: int) -> None:
    """Before step 1: a lane left ``empty`` (said with what emptied it: ``n_long`` dropped as too long, ``n_cut``
    cut to nothing trained) or token ids ``too_big`` for the model's ``vocab`` is an error."""
    d = cfg.data
    if empty and d.long_examples == "drop" and n_long:
        raise UserError(f"{where} {d.path}: data.long_examples: drop left out {n_long} of {n_rows} training "
                        f"examples, longer than data.seq_len + 1 = {d.seq_len + 1} tokens, and too few remain for "
                        f"batch_size={cfg.batch_size} (each row of a batch reads its own share); raise data.seq_len "
                        f"or set data.long_examples: truncate")
    if empty and n_cut:
        raise UserError(f"{where} {d.path}: {n_cut} of {n_rows} training examples keep no trained token once cut "
                        f"to data.seq_len + 1 = {d.seq_len + 1} tokens and are left out, and too few remain for "
                        f"batch_size={cfg.batch_size} (each row of a batch reads its own share); raise data.seq_len")
    if empty:
        raise UserError(f"{where} {d.path}: too few usable rows for batch_size={cfg.batch_size}; add data")
    if too_big:
        raise UserError(f"the tokenizer at {cfg.model.tokenizer or 'the checkpoint'} produces ids beyond the "
                        f"model's vocab_size {vocab}")


def _eval_documents(cfg: TrainConfig, task: Task[Any], tokenizer: Any, rows: RowSource, eval_rows: list[int],
                    packing: str) -> tuple[list[Document], int]:
    """(the eval documents, bad eval rows skipped): ``data.eval_path``'s, else the held-out ``eval_rows``."""
    d = cfg.data
    eval_docs: list[Document] = []
    bad = 0
    if d.eval_path:
        made = task.documents(task.load(d.eval_path, cfg), tokenizer, d.eval_path, d.skip_bad_rows)
        eval_docs = list(made.docs.values())
        bad = made.bad
    elif len(eval_rows):
        made = task.documents(rows, tokenizer, str(d.path), d.skip_bad_rows, eval_rows)
        eval_docs = [made.docs[i] for i in sorted(made.docs)]
        bad = made.bad
    if packing == "best_fit":
        eval_docs = list(fit_documents(dict(enumerate(eval_docs)), d.seq_len + 1, d.long_examples)[0].values())
    return eval_docs, bad
