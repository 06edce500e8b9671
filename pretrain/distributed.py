"""Multi-process (multi-host) runs: JAX's own distributed runtime, set up from flags or the environment.

Every trainer command accepts ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or the environment variables ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; what `zoo launch ray` sets), or
``--distributed`` to let JAX detect the cluster (SLURM, Open MPI, Kubernetes,
TPU pods). With none of these the run is one process. On CPU the processes
talk over gloo. The launch recipes: docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, cast

import numpy as np

from zoo.errors import UserError

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The multi-process flags every `train` command shares."""
    g = parser.add_argument_group("multi-process runs (one process per host; all processes run the same command)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help=f"address of process 0's coordinator service (env {ENV['coordinator']})")
    g.add_argument("--num-processes", type=int, metavar="N", help=f"number of processes (env {ENV['num_processes']})")
    g.add_argument("--process-id", type=int, metavar="I", help=f"this process's index, 0..N-1 (env {ENV['process_id']})")
    g.add_argument("--distributed", action="store_true",
                   help="detect the cluster with JAX (SLURM, Open MPI, Kubernetes, TPU pods) and join it")


def settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The distributed settings from flags, else the environment; None for a single-process run."""
    got = {}
    for key, env in ENV.items():
        value = getattr(args, key, None)
        if value is None and os.environ.get(env):
            value = os.environ[env]
            if key != "coordinator":
                try:
                    value = int(value)
                except ValueError:
                    raise UserError(f"{env}={value!r} must be an integer") from None
        got[key] = value
    if getattr(args, "distributed", False):
        return {k: v for k, v in got.items() if v is not None}
    if all(v is None for v in got.values()):
        return None
    missing = [f"--{k.replace('_', '-')}" for k, v in got.items() if v is None]
    if missing:
        raise UserError(f"a multi-process run needs {', '.join(missing)} as well (or their JAX_* environment "
                        "variables), or --distributed to detect the cluster")
    if not 0 <= int(cast(Any, got["process_id"])) < int(cast(Any, got["num_processes"])):
        raise UserError(f"--process-id {got['process_id']} must be in 0..{int(cast(Any, got['num_processes'])) - 1}")
    return got


def initialize(args: argparse.Namespace) -> None:
    """Join the run's processes before JAX touches a device (no-op for a single process)."""
    conf = settings(args)
    if conf is None:
        return
    import jax

    platforms = os.environ.get("JAX_PLATFORMS", "") or str(getattr(jax.config, "jax_platforms", None) or "")
    if platforms in ("", "cpu") or "cpu" in platforms.split(","):
        # CPU collectives across processes need gloo (the default has none).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=conf.get("coordinator"),
            num_processes=conf.get("num_processes"),
            process_id=conf.get("process_id"),
        )
    except (ValueError, RuntimeError) as e:
        if conf.get("coordinator") is None and "coordinator_address should be defined" in str(e):
            # --distributed where JAX detects no cluster: JAX's own message names no way out.
            raise UserError("--distributed found no cluster to join (no SLURM, Open MPI, Kubernetes or TPU VM "
                            "settings): start the command with srun, mpirun or on every host of a TPU slice, or "
                            "give --coordinator, --num-processes and --process-id (docs/multi-host.md)") from None
        raise UserError(f"could not join the multi-process run ({str(e).splitlines()[0][:200]})") from None


def is_primary() -> bool:
    """True on the process that writes shared files (metrics, configs, the final model)."""
    import jax

    index: int = jax.process_index()
    return index == 0


def sync(name: str) -> None:
    """Wait until every process reaches this point (no-op for one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """True when ``flag`` is true on any process (so all processes take the same branch)."""
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def total(value: int) -> int:
    """The sum of an integer over all processes."""
    import jax

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.asarray(multihost_utils.process_allgather(np.int64(value))).sum())
