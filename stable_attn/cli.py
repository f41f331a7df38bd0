"""The ``stable-attn`` commands: for each command ``<name>`` of :data:`stable_attn_cli.COMMANDS` (where its name
and help line live), ``_<name>_arguments`` adds its arguments to an ``argparse`` parser and ``_<name>_run`` runs
it and returns the exit status. To add a command, write those two functions and add its name and help line
there. The console script's entry point is :func:`stable_attn_cli.main`, which imports this module (and so
torch) only once a command is chosen; :func:`main` here is the same entry point.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import stable_attn_cli


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR",
        help="directory a training run wrote: its metrics (a Lightning metrics.csv, or a transformers Trainer's "
        "trainer_state.json) and the callback's alerts JSONL are found below it",
    )
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="where to write the PNGs and report.md (default: RUN_DIR)"
    )


def _report_run(args: argparse.Namespace) -> int:
    from stable_attn.report import build_report, format_summary, load_run, summarize

    path = build_report(args.run_dir, args.out)
    run = load_run(args.run_dir)
    for line in run.skipped_alert_lines:
        print(f"stable-attn report: warning: {_printable(line)}", file=sys.stderr)
    print(format_summary(summarize(run)))
    print(f"report: {path}")
    return 0


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    from stable_attn.numerics.probe import add_probe_arguments

    add_probe_arguments(parser)


def _probe_run(args: argparse.Namespace) -> int:
    from stable_attn.numerics.probe import run_probe

    return run_probe(args)


def _replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", metavar="BUNDLE_DIR",
                        help="a replay bundle: a folder diagnose_spikes=True wrote below the run's log directory "
                        "(replay/step-N) or stable_attn.monitor.actions.replay.write_replay_bundle wrote")
    parser.add_argument("--device", default="cpu", help="where to run the replay (default: cpu)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")


def _replay_run(args: argparse.Namespace) -> int:
    import json

    from stable_attn.monitor.actions.replay import replay_bundle, table

    result = replay_bundle(args.bundle, device=args.device)
    print(json.dumps(result, indent=1) if args.json else "\n".join(map(_printable, table(result).splitlines())))
    return 0


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``command`` (a key of :data:`stable_attn_cli.COMMANDS`) to its subparser."""
    globals()[f"_{command}_arguments"](parser)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command's subparser and arguments."""
    return stable_attn_cli.build_parser(stable_attn_cli.COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``stable-attn`` command: :func:`stable_attn_cli.main`."""
    return stable_attn_cli.main(argv)


def run(args: argparse.Namespace) -> int:
    """Run the command ``args.command`` that :func:`build_parser`'s parser parsed; returns the exit status.

    Expected failures (a missing run directory, unreadable input, an output folder that is read-only
    or full) print one line to stderr and return 1 instead of a traceback.
    """
    try:
        return globals()[f"_{args.command}_run"](args)
    except (OSError, ValueError) as err:  # a missing run directory, unreadable input, an unwritable output folder
        text = str(err)
        if isinstance(err, OSError) and err.strerror:  # without "[Errno 13]", with the file if the text lacks it
            name = err.filename
            text = err.strerror if name is None or str(name) in err.strerror else f"{err.strerror}: {name}"
        print(f"stable-attn {args.command}: error: {_printable(text)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
