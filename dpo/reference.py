"""The DPO reference model: which weights (``dpo.reference``), and the precomputed, cached log-probabilities.

* ``base`` — the policy's own base weights with the LoRA adapters switched off
  (the step's frozen base, run once more without adapters): no second copy of
  the model exists. LoRA only: with full fine-tuning the base is what trains.
* a path — a frozen zoo checkpoint, loaded and sharded like the policy, passed
  to the train step as its ``reference`` argument (full fine-tuning or LoRA).
* ``precomputed`` — a first pass scores every pair with the reference
  (``dpo.reference_model``, or the policy's starting weights: the base of
  LoRA, the initial weights of full fine-tuning) and caches the per-token
  log-probabilities in ``output_dir/reference_logps/<key>.npz``; training then
  holds one model and reads them from the batch. The key hashes the pair
  documents (so the data, the tokenization and ``data.seq_len`` truncation),
  the chat template with its variables and date, the reference checkpoint's
  files, and the params and compute dtypes: a rerun with the same inputs
  reuses the file, and a change of any of them scores the pairs anew.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zoo.data.batching import Finish, score_documents
from zoo.model.config import ModelConfig
from zoo.storage import RunPath, is_remote

CACHE_DIR = "reference_logps"
CACHE_VERSION = "3"  # bump when what is cached changes meaning (3: + params dtype and chat template)


REFERENCE_ALSO = "base or precomputed"  # what dpo.reference may be besides a checkpoint path


def resolve_checkpoint(path: str) -> Path:
    """The zoo checkpoint folder ``path`` of a reference, or a UserError."""
    from zoo.checkpoints.loading import reference_dir

    return reference_dir(path, "dpo.reference", REFERENCE_ALSO)


def load_reference(path: str, mcfg: ModelConfig, mesh: jax.sharding.Mesh, dtype: Any) -> dict:
    """The frozen reference checkpoint at ``path``, sharded like the policy (it must have the policy's shapes)."""
    from zoo.checkpoints.loading import load_reference as load

    return load(path, "dpo.reference", REFERENCE_ALSO, mcfg, mesh, dtype)


def checkpoint_digest(path: Path) -> str:
    """sha256 over the names and bytes of every file of a checkpoint folder (the reference weights), and of
    its base checkpoint's when it is an adapter checkpoint (its weights are the merged model). The local copy of
    a checkpoint on a bucket holds its small files only: its arrays' objects count by their listing stamps."""
    from zoo.checkpoints.adapter import base_checkpoint
    from zoo.checkpoints.format import PARAMS_DIR, read_meta
    from zoo.storage import object_stamps, origin

    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    url = origin(path)
    if url is not None:
        h.update(json.dumps(object_stamps(f"{url}/{PARAMS_DIR}"), sort_keys=True).encode())
    meta = read_meta(path)
    if meta.get("lora"):
        h.update(checkpoint_digest(base_checkpoint(path, meta)).encode())
    return h.hexdigest()


def cache_key(docs: dict[str, dict[int, dict[str, np.ndarray]]], weights_digest: str, compute: str,
              params: str = "float32", template: dict | None = None, images: str | None = None) -> str:
    """The cache file's key: a hash of the pair documents of every data file (their tokens: the tokenization),
    the weights, the params dtype they are loaded in, the compute dtype, the chat template with its
    variables and date (``ChatTemplate.identity``), and the digest of the pairs' images' pixels (``images``)."""
    # the images only where there are any: a text run's key (and its cache) stays what it was
    extra = {"images": images} if images else {}
    setting = json.dumps({"params": params, "compute": compute, "template": template, **extra}, sort_keys=True,
                         default=str)
    h = hashlib.sha256(f"v{CACHE_VERSION}\0{weights_digest}\0{setting}\0".encode())
    for path in sorted(docs):
        h.update(path.encode() + b"\0")
        for i in sorted(docs[path]):
            d = docs[path][i]
            h.update(str(i).encode())
            for k in ("tokens", "loss_mask", "tokens_segment_ids", "tokens_positions", "tokens_prefix_ids"):
                if k in d:
                    h.update(k.encode() + np.ascontiguousarray(d[k]).tobytes())
    return h.hexdigest()[:32]


def compute_reference_logps(mcfg: ModelConfig, params: dict, docs: list[dict[str, np.ndarray]], seq_len: int,
                            rows: int, mesh: jax.sharding.Mesh, compute: Any, finish: Finish | None = None
                            ) -> list[np.ndarray]:
    """Per-token reference log-probabilities of each pair document (float32, one per token: the
    log-probability of that token given its segment's earlier ones, 0 where it is not an answer token).
    ``finish``: the task's (pairs with images: their rows' patches, :func:`zoo.data.batching.stacked`)."""
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    return score_documents(mcfg, params, docs, seq_len + 1, rows, sharding, compute, finish=finish)


def cached_reference_logps(out_dir: Path | RunPath, docs: dict[str, dict[int, dict[str, np.ndarray]]], weights: Path,
                           compute_name: str, score: Any, primary: bool = True, params_name: str = "float32",
                           template: dict | None = None, unit: str = "pairs",
                           images: str | None = None) -> dict[str, dict[int, np.ndarray]]:
    """{data path: {row: per-token reference log-probabilities}} of ``docs``, from the cache or ``score``.

    ``score(list of documents) -> list of arrays`` runs the reference pass; it
    runs only on a cache miss, and the result is written (by the primary
    process, atomically) to ``out_dir/reference_logps/<key>.npz``. ``unit``: what one document is, as the log line
    counts them (DPO's pairs, KTO's rows); ``images``: a digest of the documents' images (:func:`cache_key`).
    """
    key = cache_key(docs, checkpoint_digest(weights), compute_name, params_name, template, images)
    f = out_dir / CACHE_DIR / f"{key}.npz"
    flat = [(path, i) for path in sorted(docs) for i in sorted(docs[path])]
    if f.is_file():
        with f.open("rb") as fh, np.load(fh) as z:  # through the file's own API: a run folder may be a bucket
            values, offsets = z["values"], z["offsets"]
        if primary:
            print(f"reference log-probabilities: cache hit ({f})", file=sys.stderr)
    else:
        t0 = time.perf_counter()
        per_doc = score([docs[p][i] for p, i in flat])
        values = np.concatenate(per_doc) if per_doc else np.zeros(0, np.float32)
        offsets = np.cumsum([0] + [len(x) for x in per_doc])
        if primary:
            f.parent.mkdir(parents=True, exist_ok=True)
            # An object on a bucket appears whole when its write closes: no temporary file to rename there.
            tmp = f if is_remote(f) else f.with_name(f.stem + ".tmp.npz")
            with tmp.open("wb") as fh:
                np.savez(fh, values=values, offsets=offsets)
            if tmp != f:
                tmp.replace(f)
            print(f"reference log-probabilities: cache miss, computed {len(flat)} {unit} with {weights} in "
                  f"{time.perf_counter() - t0:.1f}s ({f})", file=sys.stderr)
    out: dict[str, dict[int, np.ndarray]] = {p: {} for p in docs}
    for j, (p, i) in enumerate(flat):
        out[p][i] = values[offsets[j]:offsets[j + 1]]
    return out
