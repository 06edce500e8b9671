"""GRPO's config schema: the ``grpo:`` section (sampling, rewards, loss, reference) and the prompt data keys.

Defaults are TRL 1.16's ``GRPOConfig`` where the two share a setting, so a
TRL config carries over key by key (``mask_truncated_completions`` is
``mask_truncated`` here, ``log_completions`` a cadence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo.losses import IMPORTANCE_LEVELS, LOSS_TYPES, SCALE_REWARDS
from pretrain.config import TrainConfig
from sft.config import ChatDataSection
from zoo.errors import UserError


@dataclass
class GrpoSection:
    """Group relative policy optimization (`grpo train`, grpo/): rollouts, rewards, the loss and the reference."""

    num_generations: int = 8  # G: completions sampled per prompt (a group); batch_size counts completions
    max_completion_length: int = 512  # new tokens per completion at most (decoding has this fixed shape)
    temperature: float = 1.0  # sampling temperature (> 0); the trainer's log-probabilities use it too
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = 0  # keep the k most likely tokens (0: off)
    # reward functions: a shipped verifier's name (exact_match, final_number, format, length_penalty), a
    # `module:function` or `path/to/file.py:function`; or a mapping {function: ..., name: ..., other keys are
    # keyword arguments of the function}
    rewards: list[Any] = field(default_factory=list)
    reward_weights: list[float] | None = None  # one weight per reward function (None: all 1)
    loss_type: str = field(default="dapo", metadata={"choices": LOSS_TYPES})
    scale_rewards: str = field(default="group", metadata={"choices": SCALE_REWARDS})
    epsilon: float = 0.2  # the ratio is clipped below at 1 - epsilon
    epsilon_high: float | None = None  # ... and above at 1 + epsilon_high (None: epsilon; DAPO's clip-higher)
    num_iterations: int = 1  # mu: optimizer updates per rollout batch (> 1 reuses it with its old log-probs)
    importance_sampling_level: str = field(default="token", metadata={"choices": IMPORTANCE_LEVELS})
    beta: float = 0.0  # weight of the k3 KL to the reference (0: no reference pass at all)
    # beta > 0: base, the model the run starts from (LoRA: the base, adapters off; full fine-tuning: a frozen copy of
    # the starting checkpoint, as TRL) | a zoo checkpoint path
    reference: str = "base"
    mask_truncated: bool = False  # completions that hit max_completion_length train nothing
    log_completions_every: int = 10  # write every completion of every Nth step to completions.jsonl (0: never)

    def check(self) -> None:
        """The settings in range and consistent."""
        if self.num_generations < 2:
            raise UserError(f"grpo.num_generations must be at least 2 (a group compares its completions), "
                            f"got {self.num_generations}")
        if self.max_completion_length < 1:
            raise UserError(f"grpo.max_completion_length must be at least 1, got {self.max_completion_length}")
        if not self.temperature > 0:
            raise UserError(f"grpo.temperature must be positive (greedy decoding makes a group's completions "
                            f"equal), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"grpo.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"grpo.top_k must be 0 (off) or positive, got {self.top_k}")
        if isinstance(self.rewards, str):  # `grpo.rewards=a:f,b:g` on the command line
            self.rewards = [r.strip() for r in self.rewards.split(",") if r.strip()]
        if not self.rewards:
            raise UserError("grpo.rewards is empty; name at least one reward function (e.g. grpo.rewards=[final_number] "
                            "or a module:function)")
        if self.reward_weights is not None:
            if isinstance(self.reward_weights, (int, float)):
                self.reward_weights = [self.reward_weights]
            if len(self.reward_weights) != len(self.rewards):
                raise UserError(f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                                f"{len(self.rewards)} reward functions; give one per function")
            try:
                self.reward_weights = [float(w) for w in self.reward_weights]
            except (TypeError, ValueError):
                raise UserError(f"grpo.reward_weights must be numbers, got {self.reward_weights!r}") from None
        if not self.epsilon > 0:
            raise UserError(f"grpo.epsilon must be positive, got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise UserError(f"grpo.epsilon_high must be positive (or null: epsilon), got {self.epsilon_high}")
        if self.num_iterations < 1:
            raise UserError(f"grpo.num_iterations must be at least 1, got {self.num_iterations}")
        if self.beta < 0:
            raise UserError(f"grpo.beta must be at least 0, got {self.beta}")
        if not self.reference.strip():
            raise UserError("grpo.reference must be base or a zoo checkpoint path, got ''")
        if self.log_completions_every < 0:
            raise UserError(f"grpo.log_completions_every must be 0 (never) or positive, got "
                            f"{self.log_completions_every}")


@dataclass
class PromptDataSection(ChatDataSection):
    """GRPO's data keys: rows with a prompt (text, or a message list rendered with the chat template)."""

    prompt_field: str = "prompt"  # the column holding each row's prompt; the other columns go to the rewards
    seq_len: int = 512  # the longest prompt, in tokens (longer ones: data.long_examples, truncate keeps the end)


@dataclass
class GRPOConfig(TrainConfig):
    """Everything a GRPO run needs (`grpo train`)."""

    data: PromptDataSection = field(default_factory=PromptDataSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)

    def check(self) -> None:
        """The shared checks, then the ``grpo:`` section's and the batch against the group size."""
        super().check()
        self.grpo.check()
        g = self.grpo.num_generations
        if self.batch_size % g:
            raise UserError(f"batch_size={self.batch_size} completions must be a multiple of grpo.num_generations="
                            f"{g} (each prompt's {g} completions form a group); e.g. batch_size="
                            f"{max(g, self.batch_size // g * g)}")
        if isinstance(self.data.path, list):
            raise UserError("grpo train reads one prompt dataset: data.path must be a single path, not a mixture")
        if self.data.eval_path or self.data.eval_fraction:
            raise UserError("grpo train has no eval loss: leave data.eval_path and data.eval_fraction unset (score "
                            "held-out prompts with `zoo eval`, or eval.tasks during training)")
