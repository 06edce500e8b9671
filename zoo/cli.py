"""The `zoo` command: list, info, convert, init, export, quantize, plot, generate, serve, eval, demo, launch.

Only the parser's assembly and one thin dispatch function per command live here. Each command's body, and its
flags beside it, live in the package it drives (zoo/info.py, convert/cli.py, eval/cli.py, eval/generate_cli.py,
serve/cli.py, demo/job.py) and are imported inside this module's functions, so the zoo package itself stays the
ground floor.
Those modules import nothing heavy at their top, so `zoo list`, `zoo --help` and a bad flag never load the
converter, the trainer or JAX.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zoo.console import run_cli


def cmd_list(args: argparse.Namespace) -> None:
    """`zoo list` -> zoo/info.py."""
    from zoo.info import list_command

    list_command(args)


def cmd_info(args: argparse.Namespace) -> None:
    """`zoo info` -> zoo/info.py."""
    from zoo.info import info_command

    info_command(args)


def cmd_convert(args: argparse.Namespace) -> None:
    """`zoo convert` -> convert/cli.py; an unknown registry name is said first, before the converter loads JAX."""
    from pathlib import Path

    from zoo.registry import catalogue as registry

    if registry.looks_like_name(args.source) and not Path(args.source).expanduser().exists():
        registry.get(args.source)  # convert.source.open_source reads a bare name that is no path the same way
    from convert.cli import convert_command

    convert_command(args)


def cmd_init(args: argparse.Namespace) -> None:
    """`zoo init` -> convert/cli.py."""
    from convert.cli import init_command

    init_command(args)


def cmd_export(args: argparse.Namespace) -> None:
    """`zoo export` -> convert/cli.py."""
    from convert.cli import export_command

    export_command(args)


def cmd_quantize(args: argparse.Namespace) -> None:
    """`zoo quantize` -> convert/cli.py."""
    from convert.cli import quantize_command

    quantize_command(args)


def cmd_plot(args: argparse.Namespace) -> None:
    """`zoo plot` -> eval/cli.py."""
    from eval.cli import plot_command

    plot_command(args)


def cmd_generate(args: argparse.Namespace) -> int | None:
    """`zoo generate` -> eval/generate_cli.py; with --compile-only -> eval/generate_compile.py, the model's config
    read as train --compile-only reads it (pretrain/setup.py model_config_of)."""
    if getattr(args, "compile_only", False):
        from eval.generate_compile import generate_compile_command
        from pretrain.setup import model_config_of

        return generate_compile_command(args, model_config_of)
    from chat.images import ImageExpander  # --image: the model's processor, a floor above eval/
    from eval.generate_cli import generate_command

    return generate_command(args, ImageExpander.from_folder)


def cmd_serve(args: argparse.Namespace) -> None:
    """`zoo serve` -> serve/cli.py."""
    from serve.cli import run

    run(args)


def cmd_eval(args: argparse.Namespace) -> None:
    """`zoo eval` -> eval/cli.py (rows with images: the model's processor, a floor above eval/)."""
    from chat.images import ImageExpander
    from eval.cli import eval_command

    eval_command(args, ImageExpander.from_folder)


def cmd_demo(args: argparse.Namespace) -> None:
    """`zoo demo` -> demo/job.py (the fine-tuning main job)."""
    from demo.job import demo_command

    demo_command(args)


def cmd_launch(args: argparse.Namespace) -> int:
    """`zoo launch ray` -> pretrain/ray_launch.py."""
    from pretrain.ray_launch import launch_command

    return launch_command(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `zoo` (every flag documented): each command's subparser comes from the module that
    runs it, imported here (their top-level imports are light: `zoo --help` and a bad flag load no JAX)."""
    from convert.cli import add_convert_parser, add_export_parser, add_init_parser, add_quantize_parser
    from demo.job import add_demo_parser
    from eval.cli import add_eval_parser, add_plot_parser
    from eval.generate_cli import add_generate_parser
    from pretrain.ray_launch import add_launch_parser
    from serve.cli import add_serve_parser
    from zoo.info import add_info_parser, add_list_parser

    p = argparse.ArgumentParser(prog="zoo", description="lmzoo model zoo: list, convert, inspect and run models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = ((add_list_parser, cmd_list), (add_info_parser, cmd_info), (add_convert_parser, cmd_convert),
                (add_init_parser, cmd_init), (add_export_parser, cmd_export), (add_quantize_parser, cmd_quantize),
                (add_plot_parser, cmd_plot), (add_generate_parser, cmd_generate), (add_serve_parser, cmd_serve),
                (add_eval_parser, cmd_eval), (add_demo_parser, cmd_demo), (add_launch_parser, cmd_launch))
    for add_parser, run in commands:
        add_parser(sub).set_defaults(fn=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zoo` console script."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
