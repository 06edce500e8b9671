"""`zoo convert`, `zoo init`, `zoo quantize` and `zoo export`: the bodies of the `zoo` commands that convert/ drives.

zoo/cli.py parses the flags and calls these lazily, so `zoo list` never imports the converter.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from zoo.console import human_bytes, print_table
from zoo.errors import UserError


def convert_command(args: argparse.Namespace) -> None:
    """`zoo convert SOURCE --out DIR`: convert a Hugging Face / GGUF model into a zoo checkpoint."""
    from convert import convert

    out = convert(args.source, args.out, dtype=args.dtype, keep_mtp=args.keep_mtp)
    print(f"wrote {out}")


def init_command(args: argparse.Namespace) -> None:
    """`zoo init SOURCE --out DIR`: a random-weight checkpoint from a built-in or given config."""
    from convert.init import init_random

    print(f"wrote {init_random(args.source, args.out, args.seed, args.dtype)}")


def quantize_command(args: argparse.Namespace) -> None:
    """`zoo quantize CKPT --out DIR`: the checkpoint with its projections stored quantized (convert/quantize.py)."""
    from convert.quantize import quantize_checkpoint
    from zoo.checkpoints.paths import checkpoint_dir

    out, bits = quantize_checkpoint(checkpoint_dir(args.ckpt), args.out, args.quant, args.double_quant)
    print(f"wrote {out}  ({bits:.3f} bits per quantized parameter)")


def export_command(args: argparse.Namespace) -> None:
    """`zoo export CKPT`: write a checkpoint as a Hugging Face folder (or, with --adapter, a PEFT adapter) and/or
    push it to the Hub."""
    import tempfile

    from convert.hub import check_repo_id, destination, push_folder

    if not args.out and not args.push_to_hub:
        raise UserError("zoo export needs --out DIR, --push-to-hub USER/REPO, or both")
    if (args.private or args.revision) and not args.push_to_hub:
        raise UserError("--private and --revision only apply with --push-to-hub USER/REPO")
    from zoo.checkpoints.paths import checkpoint_dir

    args.ckpt = str(checkpoint_dir(args.ckpt))
    if args.eval_results:
        from convert.model_card import read_eval_results

        read_eval_results(args.eval_results)  # a bad results file is said before anything is planned or written
    if args.push_to_hub:
        check_repo_id(args.push_to_hub)
    if args.base_out and not args.adapter:
        raise UserError("--base-out applies to --adapter only: without it the whole model is exported")
    base_out = _adapter_base_out(args) if args.adapter else None
    write, planned = _export_writer(args, base_out)
    if args.dry_run:
        files = planned()
        where = [str(Path(args.out).absolute())] if args.out else []
        if args.push_to_hub:
            where.append(destination(args.push_to_hub, args.revision) + (" (private)" if args.private else ""))
        print(f"dry run: would write {len(files)} files to {' and '.join(where)}")
        print_table([("file", "size")] + [(n, human_bytes(s) if s else "small") for n, s in files])
        return
    hint = args.push_to_hub or Path(args.out).name
    if args.out:
        out = write(args.out, args.overwrite, hint)
        print(f"wrote {out}")
        if base_out:
            print(f"wrote {base_out}  (the adapter's base model)")
        if args.push_to_hub:
            print(f"pushed: {push_folder(out, args.push_to_hub, args.private, args.revision)}")
        return
    with tempfile.TemporaryDirectory(prefix="lmzoo-export-") as tmp:
        out = write(Path(tmp) / "export", False, hint)
        print(f"pushed: {push_folder(out, args.push_to_hub, args.private, args.revision)}")


def _adapter_base_out(args: argparse.Namespace) -> Path | None:
    """Where `zoo export --adapter` exports the adapter's base: --base-out, else beside --out when the adapter
    needs it (a base stored quantized, convert/peft.py); a note when it needs one and there is nowhere to put it."""
    import sys

    from convert.peft import adapter_meta_of, default_base_out, quantized_base

    if args.base_out:
        return Path(args.base_out).absolute()
    if args.out:
        return default_base_out(args.ckpt, args.out)
    base = quantized_base(args.ckpt, adapter_meta_of(args.ckpt))
    if base is not None:
        print(f"note: the adapter's base {base} is stored quantized, which transformers does not read; add "
              "--base-out DIR to export it dequantized and name that folder as the adapter's base", file=sys.stderr)
    return None


def _export_writer(args: argparse.Namespace, base_out: Path | None
                   ) -> tuple[Callable[[str | Path, bool, str], Path], Callable[[], list[tuple[str, int]]]]:
    """(write(out, overwrite, repo_hint) -> folder, planned() -> [(file, size)]) for the kind of export asked;
    ``base_out``: where an adapter export writes its base (:func:`_adapter_base_out`). The card lists the
    scores of --eval-results, when given."""
    eval_results = args.eval_results
    if args.adapter:
        from convert.peft import export_adapter, planned_adapter_files

        if args.max_shard_size is not None:
            raise UserError("--max-shard-size does not apply to --adapter: the adapter is one small safetensors file")
        return (lambda out, overwrite, hint: export_adapter(args.ckpt, out, overwrite, args.dtype, hint, base_out,
                                                            eval_results),
                lambda: planned_adapter_files(args.ckpt, args.dtype, base_out))
    from convert.export import DEFAULT_MAX_SHARD, export, planned_files

    size = args.max_shard_size or DEFAULT_MAX_SHARD
    return (lambda out, overwrite, hint: export(args.ckpt, out, args.dtype, size, overwrite, repo_hint=hint,
                                                eval_results=eval_results),
            lambda: planned_files(args.ckpt, args.dtype, size))
