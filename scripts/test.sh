#!/usr/bin/env bash
# The whole test suite, as CI runs it (README): the fast tier, then the engine tier.
#
# Same tests as `python3 -m pytest -q`, in two pytest runs: the fast tier on two pytest-xdist
# workers (tests/conftest.py gives `-m "not engine"` its workers), then the engine tier in one
# process, one engine's tests at a time. In one process the fast tier takes twice its two-worker
# time (bench/results/suite_time.md; docs/testing.md). Both tiers run even if the first fails;
# the exit status is the first failing tier's. No arguments: for a part of the suite, call pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -ne 0 ]; then
  echo "usage: scripts/test.sh   (no arguments: the whole suite; for part of it, run python3 -m pytest)" >&2
  exit 2
fi
echo "test.sh: the fast tier (-m \"not engine\")"
python3 -m pytest -q -m "not engine"
fast=$?
echo "test.sh: the engine tier (-m engine)"
python3 -m pytest -q -m engine
engine=$?
if [ "$fast" -ne 0 ]; then exit "$fast"; fi
exit "$engine"
