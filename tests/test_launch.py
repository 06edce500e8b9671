"""Launch recipes (docs/multi-host.md, issue 61 item 8): 2 processes given the variables `srun` sets join through
JAX's own SLURM detection (`--distributed`), `zoo launch ray` runs 2 processes on a Ray cluster on loopback (both
follow the 1-process trajectory), and the TPU recipes in docs/recipes/ agree with each other."""

import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import zoo
from pretrain.config import load_config
from pretrain.loop import train
from tests.processes import REPO, devices_env, ended
from tests.run_files import read_metrics, write_word_texts
from tests.tiny_lm import copy_tiny_lm
from zoo.cli import main as zoo_main

WORDS = "the a cat dog sat ran on under mat log red blue big small quickly slowly and then".split()
STEPS = 2  # the trajectory of 2 steps: the second's update from the first's gradients


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    root = tmp_path_factory.mktemp("launch")
    copy_tiny_lm(tiny_lm, root, names=("tok", "zoo"))
    write_word_texts(root / "data.jsonl", WORDS[:8], 300)
    return root


def _args(setup, out, *more):
    # Plain SGD (the update proportional to the gradient: equal trajectories compare the gradients themselves).
    return [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=8", "optimizer.name=sgd", "optimizer.learning_rate=0.5",
            "schedule.name=constant", "log_every=1", "checkpoint.every=2", f"output_dir={out}", f"max_steps={STEPS}",
            *more]


@pytest.fixture(scope="module")
def one_process(setup, tmp_path_factory):
    """The reference: STEPS steps on one device, one process. Returns (run folder, final checkpoint)."""
    out = tmp_path_factory.mktemp("one") / "run"
    return out, train(load_config(None, _args(setup, out)), progress=False)


def _follows(one_process, out):
    """The 2-process run in ``out`` (2 x 2 CPU devices) trained like the 1-process reference."""
    import jax

    ref, final = one_process
    np.testing.assert_allclose([r["loss"] for r in read_metrics(out)], [r["loss"] for r in read_metrics(ref)],
                               rtol=1e-5)
    meta = zoo.checkpoints.format.read_meta(out / "final")
    assert meta["training"]["processes"] == 2 and meta["training"]["devices"] == 4
    for x, y in zip(jax.tree.leaves(zoo.load_params(final)), jax.tree.leaves(zoo.load_params(out / "final"))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


def _srun_env(job_id: int, index: int) -> dict[str, str]:
    """What `srun --ntasks=2` sets for task ``index`` of job ``job_id`` on one node named localhost (a subset; JAX
    reads SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID)."""
    env = {k: v for k, v in devices_env(2).items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM", "JAX_PROCESS"))}
    return {**env, "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": str(index), "SLURM_LOCALID": str(index),
            "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost"}


def _slurm_job_id() -> int:
    """A job id whose coordinator port is free here: JAX takes port 61440 + SLURM_JOB_ID % 4096 on the nodelist's
    first host (jax._src.clusters.slurm_cluster)."""
    import socket

    for port in range(61440 + os.getpid() % 4000, 65536):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
        return 4096 * 1000 + port - 61440
    raise RuntimeError("no free port in 61440..65535")


@pytest.mark.slow
def test_srun_variables_and_distributed_join_two_processes_like_one(setup, one_process, tmp_path, trackio_dir):
    """`srun ... pretrain train ... --distributed` on one node: each task finds the coordinator (the nodelist's
    first host, a port from the job id), the process count and its index through JAX's SLURM detection alone.
    Of the two, process 0 alone reports: to the console and to the trackers (report_to, each process with a trackio
    folder of its own: process 0's holds the run, with every step; process 1 wrote none).
    Slow: two `pretrain train` processes each import, compile and train."""
    from trackio.sqlite_storage import SQLiteStorage

    from pretrain.trackers import STATE_FILE

    out = tmp_path / "run"
    job = _slurm_job_id()
    trackio = {"TRACKIO_PROJECT": "two"}
    procs = [subprocess.Popen([sys.executable, "-m", "pretrain.cli", "train",
                               *_args(setup, out, "grad_accum=2", "report_to=[tensorboard,trackio]"), "--distributed"],
                              cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**_srun_env(job, i), **trackio,
                                   "TRACKIO_DIR": str(trackio_dir if i == 0 else tmp_path / "trackio1")})
             for i in range(2)]
    results = ended(procs)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert "final model:" in results[0][1] and "final model:" not in results[1][1]  # process 0 reports
    _follows(one_process, out)
    assert not (tmp_path / "trackio1").exists()
    name = json.loads((out / STATE_FILE).read_text())["trackio"]["id"]
    assert [r["step"] for r in SQLiteStorage.get_logs("two", name)] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster on loopback with 2 CPUs, its workers (and so the launched processes) simulating 2 CPU
    devices each; shut down after the module."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in devices_env(2).items():
            mp.setenv(key, value)  # the raylet's environment is its workers'
        ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=10**8,
                 configure_logging=False)
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.mark.slow
def test_zoo_launch_ray_runs_two_processes_like_one(setup, one_process, ray_cluster, tmp_path, capsys):
    """`zoo launch ray --num-processes 2 -- pretrain train ...`: one task per bundle of a placement group, process
    0's address passed to both, the same command in each; then a command failing in one process stops the other
    at once and is the launch's exit code. Slow: a Ray cluster and two `pretrain train` processes."""
    out = tmp_path / "run"
    assert zoo_main(["launch", "ray", "--num-processes", "2", "--", "pretrain", "train",
                     *_args(setup, out, "grad_accum=2")]) == 0
    _follows(one_process, out)

    # Process 1 fails once both have written the JAX variables they were given; process 0 would sleep for minutes.
    seen = tmp_path / "seen"
    script = tmp_path / "fail.py"
    script.write_text(f"""import json, os, pathlib, sys, time
seen = pathlib.Path({str(seen)!r})
i = os.environ["JAX_PROCESS_ID"]
(seen / i).write_text(json.dumps({{k: v for k, v in os.environ.items() if k.startswith("JAX_")}}))
if i == "0":
    time.sleep(300)
while not (seen / "0").exists():
    time.sleep(0.05)
sys.exit(3)
""")
    seen.mkdir()
    start = time.time()
    assert zoo_main(["launch", "ray", "--num-processes", "2", "--", "python", str(script)]) == 3
    assert time.time() - start < 60
    assert "error: process 1 exited with 3" in capsys.readouterr().err
    got = [json.loads((seen / str(i)).read_text()) for i in range(2)]
    assert [g["JAX_PROCESS_ID"] for g in got] == ["0", "1"] and {g["JAX_NUM_PROCESSES"] for g in got} == {"2"}
    assert got[0]["JAX_COORDINATOR_ADDRESS"] == got[1]["JAX_COORDINATOR_ADDRESS"]  # process 0's node and port


def test_zoo_launch_ray_without_ray_names_the_extra(monkeypatch, capsys):
    """Without Ray installed, one line naming the extra, exit 2."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert zoo_main(["launch", "ray", "--num-processes", "2", "--", "pretrain", "train"]) == 2
    assert capsys.readouterr().err.strip() == "error: zoo launch ray needs Ray; pip install 'lmzoo[ray]'"


@pytest.mark.slow
def test_distributed_without_a_cluster_is_one_line(tmp_path):
    """`--distributed` where JAX detects no cluster: one line saying how to start the command (not JAX's
    'coordinator_address should be defined'), exit 2, before anything is read. A fresh process: JAX joins a run
    only before its first computation. Slow (7 s loaded): the process imports JAX."""
    env = {k: v for k, v in devices_env(1).items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAX_NUM", "JAX_PROCESS", "TPU_",
                                "KUBERNETES_", "MEGASCALE_"))}
    done = subprocess.run([sys.executable, "-m", "pretrain.cli", "train", "model.path=absent", "data.path=absent", "max_steps=1",
                           f"output_dir={tmp_path / 'run'}", "--distributed"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --distributed found no cluster to join") and "srun" in line
    assert not (tmp_path / "run").exists()


RECIPES = REPO / "docs" / "recipes"


def _train_command(words):
    """The train command of a recipe's words (`pretrain train ...` or a path to it), parsed by its parser."""
    from pretrain.cli import build_parser

    start = next(i for i, w in enumerate(words) if os.path.basename(w) == "pretrain")
    return build_parser().parse_args(words[start + 1:])


def test_recipes_parse_and_agree(tmp_path):
    """docs/recipes/: each command parses with its parser, joins through --distributed (or `zoo launch ray`), and
    the TPU recipes agree on the slice: a v5p-32 is 16 chips of topology 2x2x4, 4 hosts of 4 chips (v5p's
    accelerator type counts TensorCores, 2 a chip)."""
    import shlex

    import yaml

    from zoo.cli import build_parser as zoo_parser

    # SLURM: one task per GPU (JAX gives each task the GPU of its SLURM_LOCALID), all of a node's GPUs visible.
    sbatch = (RECIPES / "slurm.sbatch").read_text()
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", sbatch, re.M))
    assert opts["ntasks-per-node"] == opts["gpus-per-node"] and "gpus-per-task" not in opts
    srun = shlex.split(next(line for line in sbatch.splitlines() if line.startswith("srun ")))
    assert _train_command(srun).distributed

    # TPU VMs: the same command on every worker.
    tpu_vm = shlex.split((RECIPES / "tpu-vm.sh").read_text().replace("\\\n", " "), comments=True)
    chips = int(tpu_vm[tpu_vm.index("--accelerator-type") + 1].removeprefix("v5p-")) // 2
    run = [w for i, w in enumerate(tpu_vm) if i and tpu_vm[i - 1] == "--command" and "pretrain" in w]
    assert len(run) == 1 and "--worker=all" in tpu_vm
    args = _train_command(shlex.split(run[0]))
    assert args.distributed and any(o.startswith("output_dir=gs://") for o in args.overrides)

    # GKE: a ConfigMap holding run.yaml, mounted where the JobSet's command reads it.
    config_map, jobset = yaml.safe_load_all((RECIPES / "tpu-slice-jobset.yaml").read_text())
    assert jobset["kind"] == "JobSet" and config_map["kind"] == "ConfigMap"
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    args = _train_command(container["command"])
    assert args.distributed
    mount = next(m["mountPath"] for m in container["volumeMounts"])
    assert next(v["configMap"]["name"] for v in pod["volumes"]) == config_map["metadata"]["name"]
    assert os.path.dirname(args.config) == mount and os.path.basename(args.config) in config_map["data"]
    (tmp_path / "run.yaml").write_text(config_map["data"]["run.yaml"])
    cfg = load_config(tmp_path / "run.yaml", args.overrides)
    assert cfg.output_dir.startswith("gs://")
    env = {e["name"] for e in container.get("env", [])}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(container["command"]))) <= env  # Kubernetes expands $(VAR)
    from jax._src.clusters import cloud_tpu_cluster

    assert int(cloud_tpu_cluster.coordinator_port) in {p["containerPort"] for p in container["ports"]}
    per_host = container["resources"]["limits"]["google.com/tpu"]
    assert container["resources"]["requests"]["google.com/tpu"] == per_host == 4
    topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
    assert math.prod(map(int, topology.split("x"))) == chips == job["parallelism"] * per_host
    assert job["completions"] == job["parallelism"]

    # Ray: `zoo launch ray`, a bundle per host of the same slice, around the same train command.
    ray_job = shlex.split((RECIPES / "ray-job.sh").read_text().replace("\\\n", " "), comments=True)
    launch = zoo_parser().parse_args(ray_job[ray_job.index("zoo") + 1:])
    assert launch.num_processes == job["parallelism"] and json.loads(launch.resources) == {"TPU": per_host}
    assert not _train_command(launch.command).distributed  # the launch sets the JAX_* variables instead

