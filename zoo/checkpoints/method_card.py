"""What a model card says of the method a checkpoint was trained with, as its task declares it.

A task (pretrain/task.py ``Task.card``) names its method, its Hub tags and its key hyperparameters; the loop
records them in the final checkpoint's training record (model.json's ``training.card``), and the exporter's
card (convert/) reads them back from there, so it names no task.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MethodCard:
    """A trained checkpoint's method as its card states it: ``name``, one line on what the method is; ``tags``,
    its Hub tags; ``hyperparameters``, (config key, value) of its key settings in the order the card lists them."""

    name: str
    tags: tuple[str, ...] = ()
    hyperparameters: tuple[tuple[str, Any], ...] = ()

    def record(self) -> dict[str, Any]:
        """The card as model.json's training record keeps it (JSON)."""
        return {"name": self.name, "tags": list(self.tags),
                "hyperparameters": [[key, value] for key, value in self.hyperparameters]}

    @classmethod
    def of_record(cls, record: Any) -> MethodCard | None:
        """The card a training record keeps (its ``card``), or None: a checkpoint written before cards were
        recorded, or a record damaged by hand."""
        card = record.get("card") if isinstance(record, Mapping) else None
        if not isinstance(card, Mapping) or not isinstance(card.get("name"), str):
            return None
        pairs = [p for p in card.get("hyperparameters") or () if isinstance(p, list | tuple) and len(p) == 2]
        return cls(card["name"], tuple(str(t) for t in card.get("tags") or ()),
                   tuple((str(k), v) for k, v in pairs))


def settings(tree: Mapping[str, Any], keys: Iterable[str], off_when_falsy: Iterable[str] = ()
             ) -> tuple[tuple[str, Any], ...]:
    """(dotted key, value) of each of ``keys`` in a config tree (``dataclasses.asdict`` of a run's config, what
    its config.yaml holds) that has a value: an unset one (None, or absent from this task's schema) is left out,
    and so is one of ``off_when_falsy`` whose 0 / false / [] means "off"."""
    off = set(off_when_falsy)
    out = []
    for key in keys:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is None or (key in off and not node):
            continue
        out.append((key, node))
    return tuple(out)


def adapter_settings(lora: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The LoRA settings a card lists, from model.json's ``lora`` entry (an adapter checkpoint's)."""
    rows = (("lora.rank", lora.get("rank")), ("lora.alpha", lora.get("alpha")),
            ("lora.targets", lora.get("target_modules")), ("lora.rslora", lora.get("rslora")))
    return tuple((k, v) for k, v in rows if v is not None)
