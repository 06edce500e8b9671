"""KTO's rows -> pair-layout documents: each completion under its prompt, with a mismatched completion for the KL.

Rows (TRL 1.16 ``KTOTrainer``'s dataset formats):

* unpaired: ``prompt``, ``completion``, ``label`` (true: desirable, false: undesirable); strings, or a
  message-list prompt with assistant answer turn(s) (a string completion is one assistant turn);
* paired: ``prompt`` (optional for whole conversations), ``chosen``, ``rejected``, unpacked into two rows,
  ``chosen`` labelled true and ``rejected`` false, in TRL's order (``unpair_preference_dataset``: for each
  block of 1000 rows, every chosen completion, then every rejected one).

Each row is tokenized as DPO tokenizes an answer (prefs/pairs.py: prompt + completion as one text, split at the
prompt's last whole token; a string completion ends with one EOS). The KL term (Ethayarajh et al. 2024, "KTO:
Model Alignment as Prospect Theoretic Optimization", arXiv:2402.01306, Eq. (7)) reads each prompt with a
completion of ANOTHER row: as TRL builds it, the completions are rotated by one within consecutive chunks of
rows of one micro-batch's size, in the data's order, ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``, token by
token (the other row's completion ids after this row's prompt ids). A row is then one pair-layout row
(prefs/pairs.py): its prompt once, its completion as segment 1 and the mismatched completion as segment 2, both
reading the prompt as a shared prefix, so one forward pass scores both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from chat.formats import BadRow, parse_messages
from chat.loss_masks import bos_head, special_affixes, split_whole, with_eos
from chat.templates import ChatTemplate, as_template
from chat.tool_rows import TOOL_COLUMN, check_tool_order, row_tools
from prefs.pairs import PairTokens, chat_texts, fit_pair, keeps_meaning, normalize_pair, pair_document, row_label
from zoo.errors import UserError

if TYPE_CHECKING:
    from prefs.image_pairs import ImagePairs

UNPAIR_BLOCK = 1000  # the rows datasets.map hands TRL's unpair_preference_dataset at once (its default batch)


def kto_columns(columns: list[str], path: str) -> str:
    """The format of a KTO file from its columns: "unpaired" (completion + label) or "paired" (chosen + rejected);
    one line naming what is missing otherwise."""
    if "completion" in columns:
        if "label" not in columns:
            raise UserError(f"data.path {path}: KTO rows with a 'completion' need a 'label' field (true for a "
                            f"desirable completion, false for an undesirable one); columns: {columns}")
        return "unpaired"
    if "chosen" in columns and "rejected" in columns:
        return "paired"
    raise UserError(f"data.path {path}: KTO rows need 'prompt', 'completion' and 'label' fields (or preference pairs: "
                    f"'chosen' and 'rejected'); columns: {columns}")


def unpaired_rows(ds: Any, fmt: str, image_column: str | None = None) -> list[dict[str, Any]]:
    """The rows as (prompt, completion, label) dicts, paired rows unpacked in TRL's order (the module docstring);
    each keeps ``line``, its row index in the file (for error messages), and its images (``image_column``)."""
    if fmt == "unpaired":
        return [{"prompt": r.get("prompt"), "completion": r.get("completion"), "label": r.get("label"), "line": i,
                 TOOL_COLUMN: r.get(TOOL_COLUMN), **({image_column: r.get(image_column)} if image_column else {})}
                for i, r in enumerate(ds)]
    rows = [dict(r) for r in ds]
    out = []
    for start in range(0, len(rows), UNPAIR_BLOCK):
        block = list(enumerate(rows[start:start + UNPAIR_BLOCK], start))
        for side, label in (("chosen", True), ("rejected", False)):
            for i, r in block:
                out.append({"prompt": r.get("prompt"), "completion": r.get(side), "label": label, "line": i,
                            "pair": r, TOOL_COLUMN: r.get(TOOL_COLUMN),
                            **({image_column: r.get(image_column)} if image_column else {})})
    return out


def tokenize_row(row: dict[str, Any], tokenizer: Any, template: ChatTemplate) -> tuple[list[int], list[int], bool]:
    """(prompt ids, completion ids, label) of one KTO row; raises BadRow when it is unusable."""
    label = row_label(row)
    prompt, completion = row.get("prompt"), row.get("completion")
    if "pair" in row and prompt is None:  # an implicit-prompt pair: its common first messages are the prompt
        p = normalize_pair(row["pair"])
        prompt, completion = p.prompt, p.chosen if label else p.rejected
    if completion is None:
        raise BadRow("field 'completion' is missing")
    if prompt is None:
        raise BadRow("field 'prompt' is missing")
    if isinstance(prompt, str):
        if not isinstance(completion, str) or not completion.strip():
            raise BadRow("field 'completion' must be non-empty text when 'prompt' is text")
        head = special_affixes(tokenizer)[0]
        prompt_text, answer_text = prompt, completion
    else:
        messages = parse_messages(prompt, "prompt")
        answer = [{"role": "assistant", "content": completion}] if isinstance(completion, str) \
            else parse_messages(completion, "completion")
        check_tool_order(messages + answer, "prompt + completion")
        prompt_text, answer_text = chat_texts(tokenizer, messages, answer, template, "completion", row_tools(row))
        head = bos_head(tokenizer, prompt_text + answer_text)
    ids, n, _ = split_whole(prompt_text, answer_text, tokenizer)
    if head and ids[:len(head)] == head:
        head = []
    prompt_ids, answer_ids = head + ids[:n], ids[n:]
    if isinstance(prompt, str):
        answer_ids = with_eos(answer_ids, tokenizer)
    if not prompt_ids:
        raise BadRow("the prompt renders to no token")
    if not answer_ids:
        raise BadRow("the completion renders to no token")
    return prompt_ids, answer_ids, label


def kto_documents(rows: list[dict[str, Any]], indices: list[int] | None, tokenizer: Any,
                  chat_template: ChatTemplate | str | None, path: str, skip_bad: bool, max_len: int, drop_long: bool,
                  shared_prompt: bool, chunk: int, images: ImagePairs | None = None
                  ) -> tuple[dict[int, dict[str, np.ndarray]], int, set[int]]:
    """(documents by row index, bad rows skipped, rows too long) of the rows at ``indices`` (default all), each
    with its ``label`` (1.0 or 0.0 on every token). ``chunk``: the micro-batch's rows, the size of the chunks the
    KL completions rotate within (over ALL rows, whatever ``indices``). ``images`` (prefs/image_pairs.py): rows
    with images on a vision-language model, each row's images in its prompt (the mismatched completion is another
    row's text, read after this row's prompt and images)."""
    from zoo.data.row_origin import bad_row

    template = as_template(chat_template)
    cache: dict[int, tuple[list[int], list[int], bool] | None] = {}
    skipped: list[int] = []

    def tokens(i: int) -> tuple[list[int], list[int], bool] | None:
        if i not in cache:
            try:
                cache[i] = (tokenize_row(rows[i], tokenizer, template) if images is None
                            else images.tokenize_unpaired(i, rows[i], tokenizer, template))
            except BadRow as e:
                if not skip_bad:
                    raise bad_row(path, int(rows[i]["line"]), e) from None
                cache[i] = None
        return cache[i]

    out: dict[int, dict[str, np.ndarray]] = {}
    too_long: set[int] = set()
    for i in range(len(rows)) if indices is None else indices:
        mine = tokens(i)
        start = i - i % chunk
        end = min(start + chunk, len(rows))
        other = tokens(start + (i - start - 1) % (end - start))  # the previous row of the chunk, cyclically
        if mine is None or other is None:
            skipped.append(i)
            continue
        prompt, completion, label = mine
        i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
        whole = PairTokens(i32(prompt), i32(completion), i32(other[1]))
        kept, cut = fit_pair(whole, max_len, shared_prompt)
        if cut:
            too_long.add(i)
            if drop_long:
                continue
        doc = pair_document(kept, shared_prompt)
        if images is not None:  # its images kept, its tokens tagged (or a UserError: a cut through its images)
            images.attach(i, whole, kept, doc, shared_prompt, int(rows[i]["line"]))
        if cut and not keeps_meaning(whole, kept):
            doc["loss_mask"][:] = False
        doc["label"] = np.full(len(doc["tokens"]), float(label), np.float32)
        out[i] = doc
    return out, len(skipped), too_long


def check_chunk(chunk: int) -> None:
    """KTO's KL pairs each prompt with another row's completion of the same micro-batch: it needs two rows."""
    if chunk < 2:
        raise UserError(f"dpo.loss_type kto needs at least 2 rows per micro-batch (batch_size / grad_accum is "
                        f"{chunk}): its KL term pairs each prompt with another row's completion")

