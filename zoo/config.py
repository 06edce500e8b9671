"""One model configuration for every family; family differences are fields."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    ``kind`` is the Hugging Face ``rope_type``: ``default``, ``linear`` or
    ``llama3``. The scaling fields are only read by the kinds that use them.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a zoo decoder; everything the forward pass depends on."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def attn_scale(self) -> float:
        """Softmax scale applied to q·k."""
        return self.head_dim**-0.5

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (nested dataclasses become dicts)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError(f"model config: unknown fields {sorted(unknown)}")
        rope = d.pop("rope", {}) or {}
        return cls(rope=RopeConfig(**rope), **d)

    def to_json(self) -> str:
        """Pretty JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
