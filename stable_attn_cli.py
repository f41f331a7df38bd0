"""The ``stable-attn`` console script: ``stable-attn <command> ...``, without importing torch until a command runs.

This module sits beside the ``stable_attn`` package, not inside it, because importing anything inside the
package runs ``stable_attn/__init__.py``, which imports torch (seconds). It owns the command names and their
help lines (:data:`COMMANDS`) and the top-level parser; the arguments of a command are added only once that
command is chosen, and they and the command itself live in :mod:`stable_attn.cli` (``_<name>_arguments`` and
``_<name>_run``). So ``stable-attn``, ``stable-attn --help`` and an unknown command's usage error never import
torch; ``stable-attn <command> ...`` (and its ``--help``) behaves as if every parser were built up front.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence

COMMANDS: dict[str, str] = {
    "report": "rebuild the plots and report.md of a run from its metrics.csv or trainer_state.json and alerts JSONL",
    "probe": "measure per attention layer whether the rounding error of O and delta is biased, fix off and on",
    "replay": "re-run a spiking step with the fix off, with our fix and with P-bar V in fp32: numerical or data?",
}


def build_parser(chosen: Iterable[str] = ()) -> argparse.ArgumentParser:
    """The parser with one subparser per entry of :data:`COMMANDS`; only the ``chosen`` ones get their
    arguments (which imports :mod:`stable_attn.cli`, hence torch, when ``chosen`` is not empty)."""
    parser = argparse.ArgumentParser(
        prog="stable-attn", description="Tools for stable_attn: stable BF16 flash attention for training."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = set(chosen)
    for name, help_line in COMMANDS.items():
        command = sub.add_parser(name, help=help_line, description=help_line)
        if name in chosen:
            from stable_attn import cli

            cli.add_arguments(name, command)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first positional argument (the top-level parser takes no option with a
    value); None when there is none, it names no command, or a top-level ``--help`` before it wins (the parser
    then prints the help or the error without needing any command's arguments)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return None
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stable-attn`` console script; returns the exit status (see :func:`stable_attn.cli.run`
    for how a command's expected failures are reported)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = chosen_command(argv)
    parser = build_parser(() if name is None else (name,))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from stable_attn import cli

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
