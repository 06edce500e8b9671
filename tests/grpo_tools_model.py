"""The GRPO tools tests' shared pieces: the tools, parsers and environments they load from a file (TOOLS, written
as tools.py beside the model), and a model that ends its turns as told (ending_model)."""

from __future__ import annotations

from pathlib import Path

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def always_add(text):
    """A parser that reads every turn as a call of add(2, 3), whatever the model wrote."""
    from chat.tool_calls import ParsedTurn, ToolCall

    return ParsedTurn(text, [ToolCall("add", {"a": 2, "b": 3})])


class Counter:
    """An environment: a counter the model raises; its reward is the count."""

    def __init__(self):
        self.count = 0

    def reset(self, **row):
        self.count = row["start"]
        return f" (the counter is at {self.count})"

    def bump(self, by: int) -> str:
        """Raise the counter.

        Args:
            by: How much.
        """
        self.count += by
        return str(self.count)

    def get_reward(self):
        return float(self.count)


def counter():
    return Counter()


def bump_parser(text):
    from chat.tool_calls import ParsedTurn, ToolCall

    return ParsedTurn(text, [ToolCall("bump", {"by": 1})])


class Door:
    """An environment that ends its episode when the door opens."""

    def reset(self, **row):
        self.done, self.knocks = False, 0

    def knock(self) -> str:
        """Knock on the door; it opens at the second knock."""
        self.knocks += 1
        self.done = self.knocks >= 2
        return "open" if self.done else "closed"

    def get_reward(self):
        return float(self.knocks)


def door():
    return Door()


def knock_parser(text):
    from chat.tool_calls import ParsedTurn, ToolCall

    return ParsedTurn(text, [ToolCall("knock", {})])


def one(completions, **kw):
    return [1.0] * len(completions)
'''


def ending_model(tiny_lm, root: Path, strength: float) -> Path:
    """tiny_lm's model with a head that reads one residual component and writes the end-of-turn token from it
    (``strength``: its logit over the other tokens' 0, times about 5.7), saved and converted at ``root/zoo``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo.cli import main

    tok = AutoTokenizer.from_pretrained(str(tiny_lm / "tok"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_lm / "hf"))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # a residual component the layers barely move
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos, 0] = strength
    model.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    (root / "tools.py").write_text(TOOLS)
    return root
