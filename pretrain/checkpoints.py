"""The checkpointing hook: the train state and each process's data position, saved and restored with orbax."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax

from pretrain.config import TrainConfig
from pretrain.data.lanes import check_same_processes
from pretrain.hooks import Hook, StepInfo
from zoo.errors import UserError
from zoo.storage import RunPath


class Checkpoints(Hook):
    """``output_dir/checkpoints``: every ``checkpoint.every`` steps and always the last, the newest
    ``checkpoint.keep`` kept. Each holds the state, the data iterator's position and the config. On ``gs://``
    Orbax writes through TensorStore's own GCS driver and marks a finished step with its commit file."""

    def __init__(self, out: RunPath, cfg: TrainConfig, batches: Any):
        import orbax.checkpoint as ocp

        self.dir, self.cfg, self.batches = out / "checkpoints", cfg, batches
        self.manager = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep, save_interval_steps=cfg.checkpoint.every))

    def restore(self, state: dict[str, Any]) -> tuple[dict[str, Any], int, RunPath | None]:
        """(state, step, checkpoint folder) of the newest readable checkpoint, or (``state``, 0, None)."""
        import grain
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        for saved in sorted(self.manager.all_steps(), reverse=True):
            check_same_processes(self.dir / str(saved) / "data")
            try:
                restored = self.manager.restore(saved, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(self.batches)))
            except UserError:
                raise
            except Exception as e:  # a damaged checkpoint fails in many ways; fall back to the one before
                print(f"warning: checkpoint {saved} in {self.dir} is unreadable "
                      f"({type(e).__name__}); falling back to the previous one", file=sys.stderr)
                continue
            return restored["state"], saved, self.dir / str(saved)
        return state, 0, None

    def save(self, step: int, state: dict[str, Any], force: bool = False) -> None:
        """Checkpoint ``state`` as step ``step`` (when the interval says so, or ``force``)."""
        import grain
        import orbax.checkpoint as ocp

        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(self.batches),
            config=ocp.args.JsonSave(dataclasses.asdict(self.cfg))), force=force)

    def save_now(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint step ``step`` now (if it is not saved already) and wait until it is written."""
        if self.manager.latest_step() != step:
            self.save(step, state, force=True)
        self.manager.wait_until_finished()

    def on_step(self, info: StepInfo) -> None:
        # The last step is always checkpointed: a rerun of the finished run then has nothing to redo.
        self.save(info.step, info.state, force=info.last)

    def close(self) -> None:
        self.manager.wait_until_finished()
