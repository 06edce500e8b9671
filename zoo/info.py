"""`zoo list` and `zoo info`: the registry as a table, and what a checkpoint holds (size, dtype, shapes, disk layout).

Both read only the ground floor (the registry, checkpoint metadata), so they live in zoo/ itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from zoo.console import print_table
from zoo.model.config import ModelConfig
from zoo.storage import RunPath, file_sizes


def add_list_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo list`: its subparser of ``sub`` (no flags; zoo/cli.py sets what runs it)."""
    return sub.add_parser("list", help="show the named models of the zoo")


def list_command(args: argparse.Namespace) -> None:
    """`zoo list`: print the registry as a table."""
    from zoo.registry.catalogue import REGISTRY, human_count

    rows = [("name", "family", "params", "hugging face repo")]
    rows += [(e.name, e.family, human_count(e.params) if e.params else "tiny", e.hf_repo or "(built-in config: zoo init)")
             for e in REGISTRY.values()]
    print_table(rows)


def add_info_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo info`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser("info", help="describe a zoo checkpoint")
    p.add_argument("ckpt", metavar="CKPT", help="path of a zoo checkpoint folder")
    return p


def info_command(args: argparse.Namespace) -> None:
    """`zoo info CKPT`: describe a checkpoint: family, size, dtype, shapes and on-disk layout."""
    # Imported here: zoo.checkpoints.format loads NumPy, which `zoo list` (sharing this module) does not need.
    from zoo.checkpoints.format import params_dir, read_meta
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.registry.catalogue import human_count

    args.ckpt = str(checkpoint_dir(args.ckpt))
    meta = read_meta(args.ckpt)
    params = meta["params"]
    total = sum(_prod(p["shape"]) for p in params.values())
    dtypes = sorted({p["dtype"] for p in params.values()})
    stored = params_dir(args.ckpt)  # a checkpoint on a bucket: its arrays there (its small files are copied)
    chunks = _chunk_shapes(stored)
    files = file_sizes(stored)
    size = sum(files.values())
    cfg = meta["config"]
    print(f"checkpoint  {args.ckpt}")
    print(f"family      {meta['family']}   (format version {meta['format_version']})")
    print(f"source      {meta.get('source', '?')}")
    print(f"parameters  {human_count(total)} ({total:,})")
    print(f"dtype       {', '.join(dtypes)}")
    print(
        f"shape       layers={cfg['num_layers']} hidden={cfg['hidden_size']} heads={cfg['num_heads']} "
        f"kv_heads={cfg['num_kv_heads']} head_dim={cfg['head_dim']} mlp={cfg['intermediate_size']} "
        f"vocab={cfg['vocab_size']} tied={cfg['tie_word_embeddings']}"
    )
    if cfg.get("num_experts"):
        print(f"experts     {cfg['num_experts']} routed (top-{cfg['experts_per_token']}), "
              f"{cfg.get('shared_experts', 0)} shared, {dense_layer_text(ModelConfig.from_dict(cfg))}")
    lora = meta.get("lora")
    if lora:
        # An adapter checkpoint: the table above describes the merged model; on disk are the adapters only.
        n = sum(_prod(p["shape"]) for p in lora["params"].values())
        print(f"lora        rank {lora['rank']}, alpha {lora['alpha']:g}{', rslora' if lora['rslora'] else ''}, "
              f"{human_count(n)} ({n:,}) adapter parameters on {', '.join(lora['target_modules'])}")
        from zoo.checkpoints.adapter import base_location  # noqa: PLC0415 - only adapter checkpoints need it

        print(f"base        {base_location(args.ckpt, meta)}  (merged on load and export)")
        bq = lora.get("base_quant")
        if bq:  # QLoRA: trained beside the quantized base, merged into its dequantized weights
            what = "NF4, double quantization" if bq["kind"] == "nf4" and bq.get("double") else bq["kind"].upper()
            print(f"base_quant  {what}: the adapters were trained on the quantized base (QLoRA) and merge into "
                  "its dequantized weights")
        params = lora["params"]
    q = meta.get("quantized")
    if q:  # `zoo quantize`: the table above is the float model; on disk the projections are quantized fields
        from zoo.checkpoints.quantized import describe  # noqa: PLC0415 - only quantized checkpoints need it

        n = sum(_prod(meta["params"][p.rpartition(".")[0]]["shape"]) for p in q["params"]
                if p not in meta["params"] and p.endswith((".packed", ".q")))
        print(f"quantized   {describe(q['kind'], q['double'])}: {human_count(n)} ({n:,}) projection parameters at "
              f"{q['bits_per_param']:.3f} bits each; the rest as stored; dequantized on load and export, "
              "a QLoRA base as it is")
        params = q["params"]
    print(f"on disk     Orbax OCDBT/zarr3, {len(files)} files, {size / 2**20:.1f} MiB; chunked as below")
    print()
    rows = [("parameter", "shape", "dtype", "logical axes", "disk chunk", "chunks")]
    for name, p in params.items():
        ch = chunks.get(name)
        stored = str(_prod(-(-s // c) for s, c in zip(p["shape"], ch))) if ch else "?"
        rows.append((name, "x".join(map(str, p["shape"])), p["dtype"], ",".join(a or "-" for a in p["axes"]),
                     "x".join(map(str, ch)) if ch else "?", stored))
    print_table(rows)


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _chunk_shapes(params_dir: Path | RunPath) -> dict[str, tuple[int, ...]]:
    """Dotted path -> on-disk chunk shape, from Orbax's metadata (empty if unreadable)."""
    try:
        import orbax.checkpoint.experimental.v1 as ocp

        tree = ocp.metadata(params_dir).metadata
    except Exception:
        return {}
    from zoo.model.params import flatten

    out = {}
    for k, v in flatten(dict(tree)).items():
        sm = getattr(v, "storage_metadata", None)
        if sm is not None and sm.chunk_shape is not None:
            out[k] = tuple(sm.chunk_shape)
    return out


def dense_layer_text(cfg: ModelConfig) -> str:
    """How a MoE model's dense layers read: "every layer MoE", "first 3 layers dense" or the dense layers'
    indices (Qwen3-MoE's ``mlp_only_layers``, a ``decoder_sparse_step`` over 1)."""
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if not dense:
        return "every layer MoE"
    if dense == list(range(len(dense))):
        return f"first {len(dense)} layer{'s' if len(dense) > 1 else ''} dense"
    return f"layers {', '.join(map(str, dense))} dense (of {cfg.num_layers})"
