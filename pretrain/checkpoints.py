"""The checkpointing hook: the train state and each process's data position, saved and restored with orbax.

Saves are asynchronous (Orbax's default): :meth:`Checkpoints.save` blocks only while the state is copied off the
devices and the data position is read, then the next steps run while a background thread writes the step and
commits it (a local step folder is renamed into place, a bucket's gets Orbax's commit file). Only committed steps
are listed or restored. The run waits for a save in flight only before the next save, at a signal's checkpoint
and at the end of the run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from pretrain.config import TrainConfig
from pretrain.data.lanes import check_same_processes
from pretrain.hooks import Hook, StepInfo
from zoo.errors import UserError
from zoo.orbax_s3 import BUCKET_ATOMICITY
from zoo.storage import RunPath, is_remote


class DataPositionHandler(grain.checkpoint.CheckpointHandler, ocp.AsyncCheckpointHandler):  # type: ignore[misc]
    """grain's handler for a data iterator's position (one JSON file a process, restored by grain), its file
    written in the background with the rest of the step: grain's own handler writes it while the save blocks
    the run (a request to the bucket for every checkpoint)."""

    async def async_save(self, directory: epath.Path, args: DataPosition) -> list[Any]:
        """Read the iterator's position now (the next step moves it), write it when the step's folder is made."""
        state = json.dumps(args.item.get_state(), indent=4)
        path = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

        async def write() -> None:
            path.write_text(state)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="data_position_save")]

    def save(self, directory: epath.Path, item: Any = None, args: Any = None) -> None:
        """Write the position now (Orbax's synchronous path)."""
        (directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json").write_text(
            json.dumps((item or args.item).get_state(), indent=4))


@ocp.args.register_with_handler(DataPositionHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class DataPosition(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """The data iterator whose position a checkpoint saves, or restores into."""

    item: Any


class Checkpoints(Hook):
    """``output_dir/checkpoints``: every ``checkpoint.every`` steps and always the last, the newest
    ``checkpoint.keep`` kept. Each holds the state, the data iterator's position and the config. On a bucket
    (``gs://``, ``s3://``) Orbax writes through TensorStore's own GCS or S3 driver and marks a finished step with
    its commit file."""

    def __init__(self, out: RunPath, cfg: TrainConfig, batches: Any):
        self.dir, self.cfg, self.batches = out / "checkpoints", cfg, batches
        self.manager = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep, save_interval_steps=cfg.checkpoint.every,
            atomicity_options=BUCKET_ATOMICITY if is_remote(out) else None))

    def restore(self, state: dict[str, Any]) -> tuple[dict[str, Any], int, RunPath | None]:
        """(state, step, checkpoint folder) of the newest readable checkpoint, or (``state``, 0, None).

        The arrays are read into ``state``'s layout: its shapes, dtypes and shardings on this run's mesh, which
        may differ from the mesh that wrote them (another device count, FSDP onto tensor parallelism)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        for saved in sorted(self.manager.all_steps(), reverse=True):
            check_same_processes(self.dir / str(saved) / "data")
            try:
                restored = self.manager.restore(saved, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=DataPosition(self.batches)))
            except UserError:
                raise
            except Exception as e:  # a damaged checkpoint fails in many ways; fall back to the one before
                print(f"warning: checkpoint {saved} in {self.dir} is unreadable "
                      f"({type(e).__name__}); falling back to the previous one", file=sys.stderr)
                continue
            return restored["state"], saved, self.dir / str(saved)
        return state, 0, None

    def save(self, step: int, state: dict[str, Any], force: bool = False) -> None:
        """Start checkpointing ``state`` as step ``step`` (when the interval says so, or ``force``); it is written
        while the next steps run."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=DataPosition(self.batches),
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
