"""`zoo eval`'s entry point: :func:`evaluate` scores a model on tasks, each by the scorer of its kind.

The scorers live one per kind: :mod:`eval.perplexity`,
:mod:`eval.multiple_choice` and :mod:`eval.generation_task` (answers compared
by :mod:`eval.answers`), over the batched log-likelihoods of
:mod:`eval.loglikelihood`. Everything runs on a config and a parameter tree
(not a checkpoint path), so the training loop can call :func:`evaluate` on its
live parameters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from eval.generation_task import greedy_generator, image_examples, score_generation
from eval.image_prompts import Expander, row_images
from eval.multiple_choice import mc_image_questions, score_multiple_choice
from eval.perplexity import score_perplexity
from eval.rolling import DEFAULT_CHUNK
from eval.task_files import Task, resolve_tasks
from zoo.errors import UserError
from zoo.model.config import ModelConfig


def evaluate(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, tasks: str | Sequence[str | Task],
             limit: int | None = None, batch_size: int = 8, num_fewshot: int | None = None,
             chat_template: bool | None = None, progress: bool = True, log_samples: bool = False,
             chunk: int | None = None, expander: Expander | None = None) -> dict[str, Any]:
    """Score ``params`` on ``tasks`` (Task objects, shipped task names or YAML paths; a comma-separated string works).

    ``limit`` caps each task's examples; ``num_fewshot`` and ``chat_template``
    (None: each task's own setting) override the tasks', and so does ``chunk``
    (perplexity windows longer than it are read that many tokens at a time
    through the KV cache: :mod:`eval.rolling`). Returns
    ``{"tasks": {name: {name, version, kind, source, data, examples, metrics, settings, seconds}}}`` (generation
    tasks also give their first three ``samples``); with ``log_samples`` each task also has ``log``: one record
    per item (its inputs, per-choice log-likelihoods or answer, prediction and target). ``expander``: a
    vision-language model's image processor (chat/images.py's ImageExpander), which rows with images need
    (:mod:`eval.image_prompts`).
    """
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be at least 1")
    if chunk is not None and chunk < 1:
        raise UserError(f"--chunk {chunk}: must be at least 1")
    if isinstance(tasks, str):
        resolved = resolve_tasks(tasks)
    else:
        resolved = [t if isinstance(t, Task) else resolve_tasks([t])[0] for t in tasks]
    results: dict[str, Any] = {}
    for task in resolved:
        t0 = time.perf_counter()
        rows = task.rows(limit)
        settings: dict[str, Any] = {"limit": limit, "batch_size": batch_size}
        samples = None
        if task.kind == "perplexity":
            ppl_chunk = task.opt("chunk", DEFAULT_CHUNK) if chunk is None else chunk
            metrics, items = score_perplexity(cfg, params, tokenizer, task, rows, batch_size, progress, ppl_chunk)
            settings.update(window=min(task.opt("window", 512), cfg.max_position_embeddings),
                            overlap=task.options.get("overlap", "rolling"), chunk=ppl_chunk)
        elif task.kind == "multiple_choice":
            metrics, items = score_multiple_choice(cfg, params, tokenizer, task, rows, batch_size, num_fewshot,
                                                   progress, expander)
            settings.update(num_fewshot=task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot,
                            kv_cache=True)
        else:
            max_new = task.opt("max_new_tokens", 32)
            gen = greedy_generator(cfg, params, tokenizer, max_new, task.opt("stop", []))
            k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
            metrics, items = score_generation(tokenizer, task, rows, gen, batch_size, num_fewshot, chat_template,
                                              progress, row_images(task, expander, cfg, rows, k))
            samples = items[:3]
            use_chat = task.opt("chat_template", bool(task.opt("messages"))) if chat_template is None else chat_template
            settings.update(num_fewshot=task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot,
                            chat_template=use_chat, max_new_tokens=max_new, greedy=True,
                            scorer=task.opt("scorer", "exact_match"), regex=task.opt("regex"),
                            stop=task.opt("stop", []))
        results[task.name] = {"name": task.name, "version": task.version, "kind": task.kind, "source": task.source,
                              "data": task.data, "examples": len(rows), "metrics": metrics, "settings": settings,
                              "seconds": round(time.perf_counter() - t0, 3)}
        if samples is not None:
            results[task.name]["samples"] = samples
        if log_samples:
            results[task.name]["log"] = items
    return {"tasks": results}


def image_tasks(tasks: Sequence[Task], limit: int | None) -> list[Task]:
    """The tasks (multiple choice and generation) of which a row, or a few-shot example's row, has images."""
    return [t for t in tasks if t.kind != "perplexity"
            and any(t.has_images(r) for r in [*t.rows(limit), *(t.fewshot_rows() or [])])]


def check_image_rows(cfg: ModelConfig, tokenizer: Any, tasks: Sequence[Task], limit: int | None,
                     num_fewshot: int | None, chat_template: bool | None, expander: Expander | None) -> None:
    """Every row of ``tasks`` with images read, processed and expanded as the scorers will (nothing computed):
    a row that cannot be scored (an image missing or unreadable, images that do not match their placeholders,
    a prompt with its images longer than the model's context, images on a text model) is its one-line
    UserError before the weights load."""
    for task in tasks:
        rows = task.rows(limit)
        k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
        images = row_images(task, expander, cfg, rows, k)
        if task.kind == "multiple_choice":
            mc_image_questions(tokenizer, task, rows, num_fewshot, images)
        elif task.kind == "generation":
            image_examples(tokenizer, task, rows, num_fewshot, chat_template, images)
