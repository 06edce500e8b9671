"""The rules of the weight-name tables (convert/tables.py, convert/gguf_tables.py): a :class:`Rule` maps one zoo
parameter to the Hugging Face (or GGUF) tensor(s) it is made of, a :class:`BoundRule` is a rule placed in a model's
layer stacks."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from zoo.model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """zoo parameter <- HF tensor name, through a named transform."""

    zoo: str
    hf: str
    transform: str = "identity"
    when: str | None = None
    kind: str | None = None  # stacked over the layers of this kind only (Gemma 4's kind-split attention weights)

    def applies(self, cfg: ModelConfig, moe: bool = False) -> bool:
        """Whether this rule is part of a model with config ``cfg`` (in a MoE stack when ``moe``)."""
        if self.when is None:
            return True
        for cond in self.when.split("&"):
            neg = cond.startswith("!")
            name = cond.lstrip("!")
            value = moe if name == "moe" else bool(getattr(cfg, name))
            if value == neg:
                return False
        return True

    @property
    def stacked(self) -> bool:
        """True for per-layer tensors stacked on the leading ``layers`` axis."""
        return "{i}" in self.hf


@dataclass(frozen=True)
class BoundRule:
    """A rule placed in a model: the zoo path, and which HF layers (and experts) it stacks."""

    zoo: str
    hf: str
    transform: str
    layers: tuple[int, ...] | None = None  # global layer index of each entry of the leading axis
    experts: int = 0  # > 0: a second stacked axis over the {j} experts

    @property
    def stacked(self) -> bool:
        """Whether the zoo parameter stacks several HF tensors."""
        return self.layers is not None

    @property
    def slice_axes(self) -> int:
        """How many leading axes index HF tensors (0, 1 = layers, 2 = layers x experts)."""
        return 0 if self.layers is None else 2 if self.experts else 1

    def indices(self) -> Iterator[tuple[int, ...]]:
        """Every index into the leading stacked axes, in HF order."""
        if self.layers is None:
            yield ()
        elif self.experts:
            yield from itertools.product(range(len(self.layers)), range(self.experts))
        else:
            yield from ((i,) for i in range(len(self.layers)))

    def hf_name(self, index: tuple[int, ...]) -> str:
        """The HF tensor at ``index`` of the stacked axes."""
        if not index:
            return self.hf
        assert self.layers is not None, f"{self.zoo} is not stacked: it has no index {index}"
        return self.hf.format(i=self.layers[index[0]], j=index[1] if len(index) > 1 else 0)

    def hf_names(self) -> list[str]:
        """All HF tensors this parameter is made of."""
        return [self.hf_name(ix) for ix in self.indices()]


def full_width_qk_norms(rules: list[Rule]) -> list[Rule]:
    """``rules`` with q/k norms that span all heads (OLMo 2/3, MiniMax-M2): [heads * head_dim] <-> [heads,
    head_dim], as the q/k biases are split."""
    full_width = {"layers.q_norm": "q_bias", "layers.k_norm": "kv_bias"}
    return [dataclasses.replace(r, transform=full_width.get(r.zoo, r.transform)) for r in rules]
