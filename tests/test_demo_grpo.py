"""The main job's GRPO stage, without a model: its task data is held out as it says, and its run is the one the
README describes."""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "demo" / "data"


def _pairs(name: str) -> list[tuple[frozenset[int], int]]:
    out = []
    for line in (DATA / name).read_text().splitlines():
        row = json.loads(line)
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", row["prompt"][-1]["content"]).groups())
        out.append((frozenset((a, b)), int(row["answer"])))
        assert a + b == int(row["answer"]), row  # the verifier's answer is the sum
    return out


def test_held_out_sums_never_occur_in_training_in_either_order():
    train, held = _pairs("grpo_train.jsonl"), _pairs("grpo_eval.jsonl")
    assert len(held) == 64 and len(train) > 4 * len(held)
    assert not {p for p, _ in held} & {p for p, _ in train}


def test_the_stage_runs_lora_grpo_with_the_final_number_verifier(tmp_path):
    from demo.job import DemoOptions, grpo_config
    from grpo.task import GRPOTask

    cfg = grpo_config(DemoOptions(ckpt=tmp_path / "ckpt", out=tmp_path / "out"))
    assert cfg.max_steps == 6 and cfg.batch_size == 32 and cfg.grpo.num_generations == 4
    assert cfg.lora.rank == 16 and cfg.grpo.rewards == ["final_number"] and cfg.grpo.beta == 0
    task = GRPOTask(cfg)  # the reward loads (a shipped verifier)
    assert task.rewards.names == ["final_number"] and task.group_size == 4
