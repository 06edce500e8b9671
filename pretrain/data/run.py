"""The run's data, read in one place: :func:`read_run_data` (the loop's entry point) and :class:`RunData`.

:func:`data_reads` lists the files a run reads (a task that scores its data
before training reads them through :class:`pretrain.task.ReadContext`).
A plain ``data.path`` is one source (pretrain/data/source.py ``read_source``); a
list is a mixture (pretrain/data/mixture.py). Packing, lanes and the cross-process
plumbing are pretrain/data/pipeline.py's and pretrain/data/lanes.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import NamedSharding

from pretrain.config import DataSource, TrainConfig, data_sources
from pretrain.data.lanes import owned_rows
from pretrain.data.mixture import mixture_data, mixture_report, source_config
from pretrain.data.pipeline import LaneBatches, lane_dataset
from pretrain.data.source import epoch_unit, read_source
from pretrain.task import DataRead, RowSource, Task, Tokenizer
from zoo.data.batching import Document


@dataclasses.dataclass
class RunData:
    """This process's view of the run's data."""

    batches: LaneBatches  # this process's rows of every global batch
    rows: list[int]  # the flat global-batch rows (lanes) this process feeds, in its local order
    packing: str  # how documents become rows (pretrain.data.pipeline.PACKING)
    too_long: int  # training documents longer than seq_len + 1 (truncated or dropped, data.long_examples)
    eval_docs: list[Document]
    total_steps: int
    skipped: int  # bad rows skipped over the whole run (all processes)
    sources: list[DataSource] = dataclasses.field(default_factory=list)  # a mixture's sources; [] for one data.path
    # A mixture's eval documents by source name (and "eval" for data.eval_path); eval_docs holds them all.
    eval_sets: dict[str, list[Document]] = dataclasses.field(default_factory=dict)
    source: RowSource | None = None  # the rows of one data.path (an online task's rollout reads them); None: mixture

    def mixture_report(self) -> dict[str, dict[str, Any]]:
        """{source name: {path, weight, documents, tokens, realized_fraction, token_fraction}}: what the batches
        drawn so far took from each source of a mixture ({} for one data.path). In a multi-process run every
        process must call it (it sums the processes' counts)."""
        if not self.sources:
            return {}
        return mixture_report(self.sources, *self.batches.mixture_counts())


def data_reads(cfg: TrainConfig) -> list[DataRead]:
    """Every data file the run reads, in order: each source's training path then its eval_path, then a
    mixture's data.eval_path; each with the config it is read with (:func:`source_config` for a mixture)."""
    mixture = isinstance(cfg.data.path, list)
    reads = []
    for src in data_sources(cfg):  # one source for a plain data.path
        scfg = source_config(cfg, src) if mixture else cfg
        reads.append(DataRead(src.path, scfg, True))
        if scfg.data.eval_path:
            reads.append(DataRead(scfg.data.eval_path, scfg, False))
    if mixture and cfg.data.eval_path:
        reads.append(DataRead(cfg.data.eval_path, cfg, False))
    return reads


def read_run_data(cfg: TrainConfig, task: Task[Any], tokenizer: Tokenizer, vocab: int, sharding: NamedSharding,
                  micro: int) -> RunData:
    """Read, tokenize and lane-pack this process's share of the data (and the whole, small, eval set).

    A list ``data.path`` is a mixture (pretrain/data/mixture.py): each source is read, split into lanes and held out
    like a single path, and lane ``r`` mixes the sources' lane-``r`` documents with grain before packing.
    """
    d = cfg.data
    mine, counted = owned_rows(sharding, (cfg.grad_accum, micro, d.seq_len))
    packing = task.packing if d.packing else "none"
    if isinstance(d.path, list):
        m = mixture_data(cfg, task, tokenizer, vocab, mine, counted, packing)
        return RunData(m.batches, mine, packing, m.n_long, m.eval_docs, m.total_steps, m.skipped, m.sources,
                       m.eval_sets)
    share = read_source(cfg, task, tokenizer, vocab, mine, counted, packing, "data.path", d.eval_fraction)
    g = task.group_size
    total = cfg.max_steps or max(1, share.per_epoch // epoch_unit(cfg, packing, g)) * (cfg.epochs or 1)
    # The rows of one group (task.group_size) read the same lane with the same seed: the same documents.
    batches = LaneBatches([lane_dataset(share.lane_docs[r], d.seq_len, cfg.seed * 1_000_003 + r // g, packing,
                                        d.max_segments, task.row_budgets())
                           for r in mine], finish=task.finish_rows)
    return RunData(batches, mine, packing, share.n_long, share.eval_docs, total, share.skipped, source=share.rows)
