#!/usr/bin/env bash
# The whole test suite, set-up included: scripts/setup.sh --dev (Debian's graphviz when
# missing, .venv with graddbg, the test tools and the docs tools, torch pinned), then pytest.
# The documentation is part of the suite: tests/test_site.py runs `mkdocs build --strict`,
# tests/test_docs.py and tests/test_readme.py run every Python block, tests/test_wheel.py
# installs a built wheel into a fresh virtual environment.
# pytest's own exit code is returned: 5 (no tests collected) fails like any other error.
# The 20 slowest tests are printed at the end (docs/contributing.md keeps a measured list).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
