#!/usr/bin/env bash
# The whole suite in two phases (docs/testing.md, "Two phases"): first every test not marked `alone`, side by side
# in TEST_WORKERS pytest-xdist processes (a module's tests stay in one process, so a module's server starts once),
# then the tests marked `alone` (they judge timing or load) one after another with the machine to themselves.
# Together the phases select every test: nothing is deselected. Arguments go to both phases (a file, -k, -x, ...).
#
# In the parallel phase torch's and OpenMP's pools take one thread a process (OMP_NUM_THREADS=1): two workers each
# spinning two threads on two cores ran torch work several times slower than one thread each (docs/testing.md).
# Exit status: 0 when both phases pass (a phase that selects nothing, pytest's 5, counts as passed unless both do).
# What every test only reads (the trained digits checkpoint, its export) is made once for both phases, in a folder
# removed at the end (tests/conftest.py, made_once).
set -u
BIN=${BIN:-.venv/bin}
WORKERS=${TEST_WORKERS:-2}
VISIONSERVE_TEST_ONCE_DIR=$(mktemp -d -t visionserve-tests-XXXXXX)
export VISIONSERVE_TEST_ONCE_DIR
trap 'rm -rf "$VISIONSERVE_TEST_ONCE_DIR"' EXIT
OMP_NUM_THREADS=1 "$BIN/pytest" -n "$WORKERS" --dist loadfile -m "not alone" "$@"
parallel=$?
"$BIN/pytest" -p no:xdist -m alone "$@"
alone=$?
echo "test-suite: parallel phase exit $parallel, alone phase exit $alone"
passed() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
if passed "$parallel" && passed "$alone" && [ $((parallel + alone)) -lt 10 ]; then
    exit 0
fi
exit 1
