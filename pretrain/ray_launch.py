"""`zoo launch ray [FLAGS] -- COMMAND ...`: one process of a train command per host of a Ray cluster, joined by
jax.distributed.

Ray reserves one bundle of resources per process in a placement group (SPREAD by default; STRICT_SPREAD for
exactly one process per node), asks process 0's bundle for its node's address and a free port there, and runs
COMMAND once in every bundle with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set:
the variables every `train` command reads (pretrain/distributed.py), so COMMAND is the same on every host. Each
process is a subprocess of its Ray task (a fresh interpreter: JAX joins a run once per process), its output
streamed to the driver by Ray. The first process to fail cancels the others (each kills its command).

Ray Train's ``JaxTrainer`` (ray 2.60) is not used: it sets up ``jax.distributed`` for TPUs and GPUs only (on CPUs
its backend does nothing), and it runs a function inside Ray's long-lived workers rather than a command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from zoo.errors import UserError


def add_launch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`zoo launch ray ...` (its flags documented)."""
    p = sub.add_parser("launch", help="run a train command as one process per host of a cluster",
                       description="Run a train command as one process per host of a cluster, joined by "
                                   "jax.distributed (SLURM and TPU VMs need no launcher: docs/multi-host.md).")
    kinds = p.add_subparsers(dest="launcher", required=True, metavar="LAUNCHER")
    r = kinds.add_parser("ray", help="on a Ray cluster (needs the ray extra)",
                         description="Run COMMAND once in each bundle of a Ray placement group, with "
                                     "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set; e.g. "
                                     "`zoo launch ray --num-processes 4 --resources '{\"TPU\": 4}' -- "
                                     "pretrain train --config run.yaml`.")
    r.add_argument("--address", help="the Ray cluster to join (default: RAY_ADDRESS, as under `ray job submit`, "
                                     "else a new one-node cluster on this machine)")
    r.add_argument("--num-processes", type=int, required=True, metavar="N", help="processes (one per host)")
    r.add_argument("--cpus-per-process", type=float, default=1, metavar="C", help="CPUs each bundle reserves")
    r.add_argument("--gpus-per-process", type=float, default=0, metavar="G",
                   help="GPUs each bundle reserves (Ray sets CUDA_VISIBLE_DEVICES to them)")
    r.add_argument("--resources", default="{}", metavar="JSON",
                   help="other resources each bundle reserves, e.g. '{\"TPU\": 4}' for a TPU VM host")
    r.add_argument("--strategy", default="SPREAD", choices=("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"),
                   help="placement strategy (STRICT_SPREAD: exactly one process per node)")
    r.add_argument("--placement-timeout", type=float, default=300, metavar="S",
                   help="seconds to wait for the cluster to hold every bundle")
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the train command every process runs, e.g. pretrain train --config run.yaml")
    return p


def launch_command(args: argparse.Namespace) -> int:
    """Reserve the bundles, find process 0's address, run the command in each; the first failing exit code, or 0."""
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise UserError("zoo launch ray needs the command to run, after --, e.g. -- pretrain train --config run.yaml")
    if args.num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {args.num_processes}")
    bundle = _bundle(args.cpus_per_process, args.gpus_per_process, args.resources)
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        try:
            ray.init(address=args.address)
        except ConnectionError as e:
            raise UserError(f"could not join the Ray cluster at {args.address or os.environ.get('RAY_ADDRESS')} "
                            f"({str(e).splitlines()[0][:200]}); check --address or RAY_ADDRESS") from None
    group = placement_group([bundle] * args.num_processes, strategy=args.strategy)
    try:
        ready, _ = ray.wait([group.ready()], timeout=args.placement_timeout)
        if not ready:
            raise UserError(f"the Ray cluster did not hold {args.num_processes} bundles of {bundle} "
                            f"({args.strategy}) within {args.placement_timeout:g} s: fewer processes, smaller "
                            "bundles (--cpus-per-process, --gpus-per-process, --resources) or a larger cluster")

        def at(index: int) -> Any:
            # A task pinned to bundle ``index`` of the group.
            return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

        probe = ray.remote(num_cpus=0, scheduling_strategy=at(0))(coordinator_address)
        coordinator = str(ray.get(probe.remote()))
        runs = []
        for i in range(args.num_processes):
            env = {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(args.num_processes),
                   "JAX_PROCESS_ID": str(i)}
            task = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                              resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                              scheduling_strategy=at(i), max_retries=0)(run_process)
            runs.append(task.remote(command, env))
        return _wait_all(ray, runs)
    finally:
        remove_placement_group(group)


def _wait_all(ray: Any, runs: list[Any]) -> int:
    """Each process's exit code as it ends; at the first failure (or Ctrl-C here) the others are cancelled, and the
    failing code returned."""
    left = list(runs)
    try:
        while left:
            done, left = ray.wait(left, num_returns=1)
            try:
                code = int(ray.get(done[0]))
            except ray.exceptions.RayError as e:  # its worker died, or the task could not start
                print(f"error: process {runs.index(done[0])}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
                code = 1
            if code:
                print(f"error: process {runs.index(done[0])} exited with {code}; the others were stopped",
                      file=sys.stderr)
                return code
        return 0
    finally:
        for ref in left:
            ray.cancel(ref)  # raises KeyboardInterrupt in the task: run_process kills its command


def _bundle(cpus: float, gpus: float, resources: str) -> dict[str, float]:
    """One process's bundle of resources: CPUs, GPUs (if any) and the JSON object of other resources."""
    try:
        other = json.loads(resources)
    except json.JSONDecodeError as e:
        raise UserError(f"--resources {resources!r} is not JSON ({e.msg}); e.g. '{{\"TPU\": 4}}'") from None
    if not isinstance(other, dict) or not all(isinstance(v, int | float) for v in other.values()):
        raise UserError(f"--resources {resources!r} must be a JSON object of numbers, e.g. '{{\"TPU\": 4}}'")
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **{str(k): float(v) for k, v in other.items()}}


def _ray() -> Any:
    """The ray module, or a one-line error naming the extra."""
    try:
        import ray
    except ImportError:
        raise UserError("zoo launch ray needs Ray; pip install 'lmzoo[ray]'") from None
    return ray


def coordinator_address() -> str:
    """This node's address and a port free on it now: process 0's coordinator (run in process 0's bundle)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    return f"{_ray().util.get_node_ip_address()}:{port}"  # as Ray Train's JAX backend finds rank 0


def run_process(command: list[str], env: dict[str, str]) -> int:
    """Run one process of the launch (in its Ray task): ``command`` with the JAX variables ``env``; its exit code.
    A cancelled task kills its command."""
    found = shutil.which(command[0], path=os.path.dirname(sys.executable)) or shutil.which(command[0])
    if found is None:  # the console script beside this interpreter (the environment Ray's worker runs in), or PATH
        print(f"error: {command[0]}: not in {os.path.dirname(sys.executable)} nor on PATH", file=sys.stderr)
        return 127
    proc = subprocess.Popen([found, *command[1:]], env={**os.environ, **env})
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

