"""The fault suite as a table: per case, what is expected, what happened, and the verdict.

Runs tests/faults (the same inputs as CI; ``--slow`` adds the long cases) through pytest and prints one row per
case from what each test recorded (``row(expected, got)`` in tests/faults/conftest.py), so the reliability figures
can be re-derived by anyone:

    python benchmarks/fault_matrix.py                 # markdown table on stdout (about 2 min on 2 shared CPU cores)
    python benchmarks/fault_matrix.py -k replay       # only the cases whose name matches (pytest's -k)
    python benchmarks/fault_matrix.py --slow          # the long cases too

The exit status is 0 when every case passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Rows:
    """A pytest plugin keeping, per test, its name, what it recorded and its outcome."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            props = dict(report.user_properties)
            got = props.get("got")
            if got is None and report.failed:
                got = str(report.longrepr).strip().splitlines()[-1][:160]
            verdict = "pass" if report.passed else ("skipped" if report.skipped else "FAIL")
            case = report.nodeid.split("tests/faults/test_", 1)[-1].replace("_faults.py::test_", ": ")
            self.rows.append((case, props.get("expected", ""), got or "", verdict))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default=None, help="only cases matching this pytest -k expression")
    parser.add_argument("--slow", action="store_true", help="also the cases marked slow")
    args = parser.parse_args(argv)
    import pytest

    rows = Rows()
    pytest_args = ["-q", "-p", "no:cacheprovider", "--rootdir", ROOT, os.path.join(ROOT, "tests", "faults"),
                   "-m", "" if args.slow else "not slow"]
    if args.k:
        pytest_args += ["-k", args.k]
    start = time.monotonic()
    os.chdir(ROOT)
    code = pytest.main(pytest_args, plugins=[rows])
    print(f"\nfault matrix: {len(rows.rows)} cases, {sum(r[3] == 'pass' for r in rows.rows)} pass, "
          f"{sum(r[3] == 'FAIL' for r in rows.rows)} fail ({time.monotonic() - start:.0f} s, "
          f"python benchmarks/fault_matrix.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''})\n")
    print("| case | expected | got | verdict |")
    print("|---|---|---|---|")
    for row in rows.rows:
        print("| " + " | ".join(_cell(x) for x in row) + " |")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
