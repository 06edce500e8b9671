"""Exact-match scoring of chat examples: greedy answers to held-out prompts against their reference answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from eval.generate import greedy_batch


@dataclass
class Scored:
    """One scored example."""

    prompt: str
    reference: str
    answer: str

    @property
    def correct(self) -> bool:
        """Whether the answer's first line is the reference (surrounding whitespace ignored)."""
        return self.answer.strip().split("\n")[0].strip() == self.reference.strip()


def chat_prompts(rows: list[dict[str, Any]]) -> list[tuple[list[dict[str, str]], str]]:
    """(conversation up to the last assistant turn, that turn's content) of each ``messages`` row."""
    out = []
    for row in rows:
        msgs = row["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        out.append((msgs[:last], msgs[last]["content"]))
    return out


def score_exact_match(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int = 24,
                      batch_size: int = 16, desc: str = "score") -> list[Scored]:
    """Greedy answers to each row's conversation (chat template applied), checked against its reference."""
    pairs = chat_prompts(rows)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    scored: list[Scored] = []
    with tqdm(total=len(pairs), desc=desc, unit="ex", disable=None) as bar:
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            ids = [tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for conv, _ in chunk]
            ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "input_ids") else list(x) for x in ids]
            for (conv, ref), new in zip(chunk, greedy_batch(model, ids, max_new_tokens, eos)):
                answer = tokenizer.decode(new, skip_special_tokens=True)
                scored.append(Scored(conv[-1]["content"], ref, answer))
            bar.update(len(chunk))
    return scored


def accuracy(scored: list[Scored]) -> float:
    """Fraction of correct answers."""
    return sum(s.correct for s in scored) / max(1, len(scored))
