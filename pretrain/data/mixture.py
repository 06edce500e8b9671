"""Data mixtures: ``data.path`` as a list of weighted sources, each read in its own format, mixed per lane by grain.

Each source is read like a single ``data.path`` (pretrain/data/source.py ``read_source``): loaded by the task with
the source's own ``format``/``text_field``/``split``, tokenized for this process's lanes only, split into the
same lanes (every batch_size-th row of its own seeded order) and held out for eval (its ``eval_path``, else
``data.eval_fraction`` of it unless ``data.eval_path`` is set). Lane ``r`` is then grain's
``MapDataset.mix`` of the sources' endless, per-pass reshuffled lane-``r`` streams, weighted, followed by the
packing (pretrain/data/pipeline.py ``mixed_lane_dataset``). The mix is a fixed interleave by weight, so the batches
depend only on the data, the seed and the config, and a lane's checkpointed state is still one index: a
resumed run draws exactly what the uninterrupted run draws.

The realized proportions are counted, not estimated: every token carries its source through packing, and
``LaneBatches`` counts per source the documents that start and the tokens that lie in the rows it hands out,
in its checkpointed state (exact across a resume). :func:`mixture_report` sums them over processes.

An epoch of a mixture (``epochs: N``) is as many steps as one pass over the training tokens of all sources
together takes (their sum / tokens per batch; one document per row without packing), as for one data.path;
the weights decide what fills those steps, so within an epoch a heavily weighted small source repeats and a
lightly weighted large one is only partly seen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pretrain import distributed
from pretrain.config import DataSource, TrainConfig, data_sources
from pretrain.data.pipeline import LaneBatches, fit_documents, mixed_lane_dataset
from pretrain.data.source import SourceShare, epoch_unit, read_source
from pretrain.task import Task
from zoo.data.batching import Document

GLOBAL_EVAL = "eval"  # the name of data.eval_path's eval set in Mixed.eval_sets


def source_config(cfg: TrainConfig, src: DataSource) -> TrainConfig:
    """``cfg`` as the task reads one source: its path and eval_path, and each other data key the source sets
    (text_field, split, a task's own such as a format; unset ones keep their ``data.*`` value)."""
    keys = {f.name for f in dataclasses.fields(src)} - {"path", "weight", "name", "eval_path"}
    own = {k: getattr(src, k) for k in keys if getattr(src, k) is not None}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=src.path, eval_path=src.eval_path, **own))


@dataclasses.dataclass
class Mixed:
    """A mixture read for this process: its lanes' batches, and what pretrain/data/run.py's RunData reports."""

    batches: LaneBatches
    n_long: int
    eval_docs: list[Document]
    total_steps: int
    skipped: int
    sources: list[DataSource]
    eval_sets: dict[str, list[Document]]


def mixture_data(cfg: TrainConfig, task: Task[Any], tokenizer: Any, vocab: int, mine: list[int], counted: list[int],
                 packing: str) -> Mixed:
    """A mixture: the sources' lanes mixed per lane, their eval sets, and the counts per source."""
    d = cfg.data
    sources = data_sources(cfg)
    weights = [s.weight for s in sources]
    shares: list[SourceShare] = []
    for i, src in enumerate(sources):
        scfg = source_config(cfg, src)
        shares.append(read_source(scfg, task, tokenizer, vocab, mine, counted, packing, f"data.path[{i}]",
                                  0.0 if d.eval_path else d.eval_fraction, seed=cfg.seed + i))
    # One epoch: a pass over all sources' training tokens (documents without packing); see the module docstring.
    per_epoch = sum(s.per_epoch for s in shares) // epoch_unit(cfg, packing)
    total = cfg.max_steps or max(1, per_epoch) * (cfg.epochs or 1)
    # The budgets and the rows' finish after every source is read: a source's images count in every row's budget.
    mixed = [mixed_lane_dataset([s.lane_docs[r] for s in shares], weights, d.seq_len, cfg.seed * 1_000_003 + r,
                                packing, d.max_segments, task.row_budgets()) for r in mine]
    first = set(counted)
    batches = LaneBatches(mixed, len(sources), [r in first for r in mine], finish=task.finish_rows)
    eval_sets = {str(src.name): s.eval_docs for src, s in zip(sources, shares) if s.eval_docs}
    skipped = sum(s.skipped for s in shares)
    if d.eval_path:  # one more eval set, read with the data.* keys
        made = task.documents(task.load(d.eval_path, cfg), tokenizer, d.eval_path, d.skip_bad_rows)
        docs: list[Document] = list(made.docs.values())
        ebad = made.bad
        if packing == "best_fit":
            docs = list(fit_documents(dict(enumerate(docs)), d.seq_len + 1, d.long_examples)[0].values())
        skipped += ebad
        if docs:
            eval_sets[GLOBAL_EVAL if GLOBAL_EVAL not in eval_sets else f"{GLOBAL_EVAL}-all"] = docs
    eval_docs = [x for docs in eval_sets.values() for x in docs]
    return Mixed(batches, sum(s.n_long for s in shares), eval_docs, total, skipped, sources, eval_sets)


def mixture_report(sources: list[DataSource], documents: list[int], tokens: list[int]) -> dict[str, dict[str, Any]]:
    """{source name: {path, weight (normalized), documents, tokens, realized_fraction (of the documents),
    token_fraction}} from this process's counts, summed over all processes (every process must call it)."""
    documents = [distributed.total(int(x)) for x in documents]
    tokens = [distributed.total(int(x)) for x in tokens]
    wsum, dsum, tsum = sum(s.weight for s in sources), sum(documents), sum(tokens)
    return {str(s.name): {"path": s.path, "weight": s.weight / wsum, "documents": n, "tokens": t,
                     "realized_fraction": n / dsum if dsum else 0.0, "token_fraction": t / tsum if tsum else 0.0}
            for s, n, t in zip(sources, documents, tokens)}


def describe(report: dict[str, dict[str, Any]]) -> str:
    """One line for the log: each source's realized share of the documents (and tokens) against its weight."""
    return "data mixture: " + ", ".join(
        f"{name} {r['realized_fraction']:.3f} of documents (weight {r['weight']:.3f}; {r['documents']} documents, "
        f"{r['tokens']} tokens, {r['token_fraction']:.3f} of tokens)" for name, r in report.items())
