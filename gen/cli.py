"""The `gen` command line. Each subcommand lives in its own module with `register(subparsers)`,
which adds its parser and sets `func` to the function that runs it (returning an exit code)."""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("gen.tune.command", "gen.tune.cache_cmd", "gen.bench.command", "gen.deploy.precompile_cmd",
               "gen.deploy.export_cmd", "gen.dev.sweep", "gen.dev.compile_cmd", "gen.dev.profile",
               "gen.dev.modelcheck", "gen.dev.timeline", "gen.dev.prelude_check")


def positive_int(expected: str):
    """An argparse type: a whole number of at least 1; anything else is refused with `expected` and
    the text given."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    return parse


class OneLineErrors(argparse.ArgumentParser):
    """argparse with its usage errors (a missing or malformed flag) as one line on stderr, exit status
    2, like the commands' own refusals; `--help` still prints the usage. Subcommands' parsers are of
    the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="gen", description="tilemarlin: tuned W4A16 GEMM kernels on TileLang")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
