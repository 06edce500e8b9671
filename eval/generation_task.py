"""`generation` tasks: greedy answers to each row's prompt, scored by exact match or a regex's pick.

Prompts are plain text (few-shot examples joined by the task's separator) or
a conversation under the tokenizer's chat template; answers are generated on
the KV cache (:mod:`eval.generate`) and compared by :mod:`eval.answers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from eval.answers import is_correct, scored_answer
from eval.generate import GenerationConfig, generate
from eval.image_prompts import Frames, RowImages
from eval.loglikelihood import encode
from eval.progress import progress_bar
from eval.task_files import Task, fewshot_pool, field_of, format_row, joined
from zoo.errors import UserError
from zoo.model.config import ModelConfig

# A batch of prompts (and, when they have images, each one's frames as a second argument) -> each one's new tokens.
Generator = Callable[..., list[list[int]]]


def generation_examples(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None,
                        chat_template: bool | None = None) -> list[tuple[list[int], str]]:
    """(prompt ids, reference answer) of each row."""
    return [(ids, ref) for ids, ref, _ in image_examples(tokenizer, task, rows, num_fewshot, chat_template)]


def image_examples(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None,
                   chat_template: bool | None = None, images: RowImages | None = None,
                   ) -> list[tuple[list[int], str, Frames]]:
    """(prompt ids, reference answer, frames) of each row: with ``images``, a row with images has them in its
    prompt (under the chat template where TRL puts them; in plain text at its ``<image>`` placeholders, else
    before it), expanded as the model's processor expands them, and their frames."""
    use_chat = task.opt("chat_template", bool(task.opt("messages"))) if chat_template is None else chat_template
    k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
    prefix, about = task.opt("gen_prefix", ""), task.opt("prompt_description", "")
    delim, sep = task.opt("target_delimiter", " "), task.opt("fewshot_separator", "\n\n")
    out = []
    for i, row in enumerate(rows):
        turns, ref = _turns(row, task)
        shots = [_turns(s, task) for s in fewshot_pool(task, rows, i, k)]
        frames: Frames = []
        if use_chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(f"task {task.name} ({task.source}) applies the chat template, but the tokenizer has "
                                "none; set chat_template: false in the task or pass --no-chat-template")
            conv = [m for st, sr in shots for m in st + [{"role": "assistant", "content": joined(prefix, sr)}]] + turns
            if about:  # lm-eval puts its description in the system turn
                conv = [{"role": "system", "content": about}] + conv
            if images is not None and images.wanted(row):
                text, frames = images.chat(i, tokenizer, conv, row)
                ids = encode(tokenizer, text + prefix, special=True)  # as the processor tokenizes: the text whole
            else:
                ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
                ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
                ids += encode(tokenizer, prefix) if prefix else []  # the answer starts with it
        else:
            text = sep.join([_plain(st) + delim + sr if not prefix else joined(joined(_plain(st), prefix, delim), sr)
                             for st, sr in shots] + [joined(_plain(turns), prefix, delim)])
            if images is not None and images.wanted(row, text):
                text, frames = images.text(i, text, row)
            ids = encode(tokenizer, about + text, special=True)
        if frames:
            assert images is not None
            images.check_length(i, len(ids), "prompt")
        out.append((ids, ref, frames))
    return out


def _turns(row: dict, task: Task) -> tuple[list[dict[str, str]], str]:
    """(the conversation before the answer, the reference answer) of one row."""
    if task.opt("messages"):
        msgs = field_of(row, task.opt("messages"), task)
        last = [i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"]
        if not last:
            raise UserError(f"task {task.name} ({task.source}): a row's {task.opt('messages')} has no assistant "
                            "turn to use as the reference")
        return msgs[:last[-1]], _text_of(msgs[last[-1]]["content"])
    prompt = format_row(task.opt("prompt"), row, task, "prompt")
    return [{"role": "user", "content": prompt}], format_row(task.opt("target"), row, task, "target")


def _plain(turns: list[dict[str, str]]) -> str:
    """A conversation as plain text (no chat template): its turns' contents, one per line."""
    return "\n".join(_text_of(m["content"]) for m in turns)


def _text_of(content: Any) -> str:
    """A message's text: its content, or the text of its content parts (TRL's ``{"type": "text"}``)."""
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def greedy_generator(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, max_new_tokens: int,
                     stop: Sequence[str] = ()) -> Generator:
    """(prompts, their frames or None) -> greedy new tokens (eval.generate on the KV cache, the images in the
    prefill; stops at EOS or a stop string)."""
    eos = (int(tokenizer.eos_token_id),) if tokenizer.eos_token_id is not None else ()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop=tuple(stop), eos_ids=eos)

    def run(prompts: list[list[int]], frames: list[Frames] | None = None) -> list[list[int]]:
        return generate(cfg, params, prompts, gen, tokenizer=tokenizer if stop else None, frames=frames)

    return run


def score_generation(tokenizer: Any, task: Task, rows: list[dict], generator: Generator, batch_size: int = 8,
                     num_fewshot: int | None = None, chat_template: bool | None = None, progress: bool = True,
                     images: RowImages | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(exact_match metric, one record per row: prompt, answer, the part scored, reference, correct) of a
    generation task, with ``generator`` producing the tokens; ``images`` (:func:`eval.image_prompts.row_images`)
    puts rows' images in their prompts, and the generator gets their frames."""
    examples = image_examples(tokenizer, task, rows, num_fewshot, chat_template, images)
    with_images = any(f for _, _, f in examples)
    answers: list[str] = [""] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i][0]))
    with progress_bar(len(examples), task.name, "ex", progress) as bar:
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            # A short last batch is filled up with copies of its first prompt: one batch shape, one compilation.
            fill = [idx[0]] * (batch_size - len(idx))
            prompts = [examples[i][0] for i in idx + fill]
            new_tokens = generator(prompts, [examples[i][2] for i in idx + fill]) if with_images else generator(prompts)
            for i, new in zip(idx, new_tokens):
                answers[i] = tokenizer.decode(new, skip_special_tokens=True)
            bar.update(len(idx))
    correct = [is_correct(a, ref, task) for a, (_, ref, _) in zip(answers, examples)]
    items = [{"index": i, "prompt": tokenizer.decode(ids), "answer": a, "scored": scored_answer(a, task),
              "reference": ref, "correct": c}
             for i, (a, (ids, ref, _), c) in enumerate(zip(answers, examples, correct))]
    return {"exact_match": float(np.mean(correct)) if correct else 0.0}, items
