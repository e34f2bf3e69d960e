#!/usr/bin/env bash
# The whole test suite, set-up included: scripts/setup.sh --dev (Debian's graphviz when
# missing, .venv with graddbg and the test tools, torch pinned), then pytest.
# pytest's own exit code is returned: 5 (no tests collected) fails like any other error.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
