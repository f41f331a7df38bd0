#!/usr/bin/env python3
"""README's "Tested with" table, written from the constraints files CI installs (never by hand).

    python .ci/tested_with.py            rewrite the table in README.md
    python .ci/tested_with.py --check    exit 1 when README's table is not what the files say (a test runs this)
    python .ci/tested_with.py --installed FILE
                                         exit 1 when this environment's versions differ from FILE's pins (CI runs
                                         this after each install, so the table is what CI really installed)
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / ".ci" / "constraints"
README = ROOT / "README.md"
START, END = "<!-- tested-with:start -->", "<!-- tested-with:end -->"
# what the table shows, in order: (row label, distribution name)
ROWS = (("Python", "python"), ("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
        ("lightning", "lightning"), ("accelerate", "accelerate"), ("TRL", "trl"))
TORCH = "2.13.0"  # installed first in every CI environment (the CPU wheel); not in the constraints files


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line (``# python==X`` included)."""
    found = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"#?\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)\s*", line)
        if m:
            found[m.group(1).lower().replace("_", "-")] = m.group(2)
    return found


def table() -> str:
    floor, newest = pins(CONSTRAINTS / "floor.txt"), pins(CONSTRAINTS / "newest.txt")
    lines = ["| | floor (CI) | newest (CI) |", "|---|---|---|"]
    for label, name in ROWS:
        low = TORCH if name == "torch" else floor.get(name, "not tested")
        high = TORCH if name == "torch" else newest.get(name, "not tested")
        lines.append(f"| {label} | {low} | {high} |")
    return "\n".join(lines)


def readme_table() -> str | None:
    text = README.read_text()
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    return m.group(1).rstrip("\n") if m else None


def check_installed(path: Path) -> list[str]:
    wrong = []
    for name, want in pins(path).items():
        if name == "python":
            got = f"{sys.version_info.major}.{sys.version_info.minor}"
        else:
            try:
                got = metadata.version(name)
            except metadata.PackageNotFoundError:
                # a pin constrains without installing; the table's packages must be there
                if name not in dict((n, label) for label, n in ROWS):
                    continue
                got = "absent"
        if got != want:
            wrong.append(f"{name}: installed {got}, {path.name} pins {want}")
    torch = metadata.version("torch").split("+")[0]
    if torch != TORCH:
        wrong.append(f"torch: installed {torch}, CI installs {TORCH}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--installed", type=Path)
    args = parser.parse_args()
    if args.installed:
        wrong = check_installed(args.installed)
        for line in wrong:
            print(f"tested_with: {line}", file=sys.stderr)
        if not wrong:
            print(f"tested_with: this environment has every pin of {args.installed.name}")
        return 1 if wrong else 0
    want = table()
    if args.check:
        if readme_table() != want:
            print(f"README.md's table between {START} and {END} is not what .ci/constraints says; run "
                  "python .ci/tested_with.py", file=sys.stderr)
            return 1
        return 0
    text = README.read_text()
    if readme_table() is None:
        print(f"README.md has no {START} ... {END} block", file=sys.stderr)
        return 1
    README.write_text(re.sub(re.escape(START) + r"\n.*?" + re.escape(END), lambda _: f"{START}\n{want}\n{END}",
                             text, flags=re.S))
    return 0


if __name__ == "__main__":
    sys.exit(main())
