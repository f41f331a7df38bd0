#!/usr/bin/env bash
# Run at every round: install whatever the package index serves today (no pins but torch==2.13.0, the CPU
# wheel), run the integration tests and the README blocks, and print which versions differ from
# .ci/constraints/newest.txt. When it passes, raise the pins: python .ci/try_newest.sh --write
# (rewrites newest.txt from this environment, then README's table: python .ci/tested_with.py).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TRY_NEWEST_VENV:-.venv-newest}
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e ".[test,trl]" 2>/dev/null || "$venv/bin/pip" install -q -e ".[test]"
"$venv/bin/pip" freeze --exclude-editable | grep -v -E '^(torch==|#)' | sort -f > "$venv/freeze.txt"
grep -v '^#' .ci/constraints/newest.txt | sort -f > "$venv/pinned.txt"
echo "versions that differ from .ci/constraints/newest.txt (< pinned, > served today):"
diff "$venv/pinned.txt" "$venv/freeze.txt" || true
status=0
"$venv/bin/python" -m pytest -m "not slow" -q -p no:cacheprovider \
  tests/integrations tests/callbacks tests/trainer tests/test_readme.py || status=$?
if [ "$status" = 0 ] && [ "${1:-}" = "--write" ]; then
  { grep '^#' .ci/constraints/newest.txt; cat "$venv/freeze.txt"; } > .ci/constraints/newest.txt.new
  mv .ci/constraints/newest.txt.new .ci/constraints/newest.txt
  "$venv/bin/python" .ci/tested_with.py
  echo "newest.txt and README's table raised"
fi
exit $status
