"""The versions we declare are the versions CI tests: README's table is written from the constraints files,
pyproject's lower bounds are the floor CI installs, and no dependency has an upper bound."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))
import tested_with  # noqa: E402


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return project["dependencies"] + extras


def test_readme_table_is_what_the_constraints_files_say():
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "tested_with.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert tested_with.readme_table() == tested_with.table()


def test_lower_bounds_are_the_floor_ci_installs():
    floor = tested_with.pins(ROOT / ".ci" / "constraints" / "floor.txt")
    bounds = {}
    for req in _requirements():
        m = re.match(r"([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)", req)
        if m:
            bounds[m.group(1).lower()] = m.group(2)
    for name in ("triton", "transformers", "lightning", "accelerate"):
        assert bounds[name] in (floor[name], floor[name].removesuffix(".0")), (name, bounds[name], floor[name])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={floor['python']}"


def test_no_dependency_has_an_upper_bound():
    capped = [r for r in _requirements() if "<" in r.split(";")[0]]
    assert capped == [], capped


def test_the_table_names_every_row_and_both_environments():
    table = tested_with.table()
    for label, _ in tested_with.ROWS:
        assert f"| {label} |" in table
    newest = tested_with.pins(ROOT / ".ci" / "constraints" / "newest.txt")
    assert f"| transformers | 5.24.0 | {newest['transformers']} |" in table
