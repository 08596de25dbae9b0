#!/usr/bin/env bash
# The test suite under coverage.py, with every process the tests start (cohort runs, their further ranks, torchrun's
# workers) measured too (pyproject.toml's [tool.coverage.*]), then one report of app/, models/, core/, datamodules/.
# Arguments go to pytest: scripts/coverage.sh -m "not slow" measures the fast tier only. Needs pip install -e '.[dev]'.
set -uo pipefail
cd "$(dirname "$0")/.."
rm -f .coverage .coverage.*
# -n 0: the tests in this process, one after another (no pytest-xdist workers), as the README's figure was measured
python -m coverage run -m pytest -n 0 "$@"
tests=$?
python -m coverage combine --quiet && python -m coverage report --sort cover
exit $tests
