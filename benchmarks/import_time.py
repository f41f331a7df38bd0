"""What starting stable_attn costs: ``import stable_attn`` over ``import torch``, the callbacks, ``stable-attn --help``.

Each row runs in fresh interpreters (``--repeats`` of them, rows interleaved so that machine load hits all
alike) and times the import inside the interpreter with ``time.perf_counter``; ``stable-attn --help`` is timed
from outside, as the whole process a user waits for, through the entry point the tree's ``pyproject.toml`` names
(``[project.scripts]``), called the way the installed console script calls it. The table shows the median and the
minimum (other load only ever adds to it) and which heavy packages the statement left in ``sys.modules`` (for
``stable-attn --help`` torch too). ``--tree`` (repeatable) measures the ``stable_attn`` of other checkouts in the
same interleaved rounds (each interpreter runs in that folder with it on ``PYTHONPATH``); the default is this
repository.

    python benchmarks/import_time.py [--repeats 7] [--tree /path/to/other/checkout --tree .]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

HEAVY = ("transformers", "lightning", "triton", "torch._dynamo")

# (row, code run before the clock starts, code timed); each prints the seconds and the heavy modules loaded
ROWS = (
    ("import torch", "", "import torch"),
    ("import stable_attn (over torch)", "import torch", "import stable_attn"),
    ("stable_attn.callbacks.StableAttentionCallback (over stable_attn)", "import torch, stable_attn",
     "from stable_attn.callbacks import StableAttentionCallback"),
    ("transformers model code + registration (over stable_attn)", "import torch, stable_attn",
     "import transformers.modeling_utils"),
)

TIMED = """
import sys, time
{setup}
t = time.perf_counter()
{timed}
print(time.perf_counter() - t, ",".join(m for m in {heavy!r} if m in sys.modules) or "-")
"""

# the console script as pip writes it, with the entry point the tree's pyproject.toml names; then what it loaded
HELP = """
import sys
sys.argv = ["stable-attn", "--help"]
try:
    from {module} import {function}
    sys.exit({function}())
except SystemExit:
    pass
print(",".join(m for m in ("torch", *{heavy!r}) if m in sys.modules) or "-")
"""


ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree,
                          env=env).stdout


def _once(setup: str, timed: str, tree: Path) -> tuple[float, str]:
    out = _python(TIMED.format(setup=setup, timed=timed, heavy=HEAVY), tree).split()
    return float(out[0]), out[1]


def _help_once(tree: Path) -> tuple[float, str]:
    script = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["stable-attn"]
    module, function = script.split(":")
    t = time.perf_counter()
    out = _python(HELP.format(module=module, function=function, heavy=HEAVY), tree)
    return time.perf_counter() - t, out.split()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tree", type=Path, action="append", default=None,
                        help="a checkout whose stable_attn to measure (repeatable; default: this repository)")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    runs: dict[tuple[str, Path], list[float]] = {}
    loaded: dict[tuple[str, Path], str] = {}
    for _ in range(args.repeats):
        for tree in trees:
            for row, setup, timed in ROWS:
                seconds, loaded[row, tree] = _once(setup, timed, tree)
                runs.setdefault((row, tree), []).append(seconds)
            seconds, loaded["stable-attn --help (whole process)", tree] = _help_once(tree)
            runs.setdefault(("stable-attn --help (whole process)", tree), []).append(seconds)
    print(f"machine: {cpu_model()}; python {sys.version.split()[0]}; {args.repeats} fresh interpreters per row\n")
    print("| tree | what | median s | min s | heavy modules loaded |")
    print("|---|---|---|---|---|")
    for (row, tree), seconds in sorted(runs.items(), key=lambda kv: trees.index(kv[0][1])):
        print(f"| {tree} | {row} | {statistics.median(seconds):.2f} | {min(seconds):.2f} | "
              f"{loaded[row, tree] or 'n/a'} |")


if __name__ == "__main__":
    main()
