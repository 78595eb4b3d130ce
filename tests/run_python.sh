#!/usr/bin/env bash
# Runs the Python conformance tests against a freshly built allot-agent:
#   tests/run_python.sh
# Creates (once) a virtualenv in target/pyvenv with tests/requirements.txt, builds the agent
# (debug, honouring CARGO_TARGET_DIR) and runs every tests/*_conformance.py; exits non-zero when
# any test fails. Each test file prints a closing "N passed, M failed" line.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/target/pyvenv"
target_dir="${CARGO_TARGET_DIR:-$root/target}"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/tests/requirements.txt"

(cd "$root" && cargo build --quiet -p allot-agent --bin allot-agent)
export ALLOT_AGENT="$target_dir/debug/allot-agent"
export ALLOT_PROTO_DIR="$root/proto"

status=0
for t in "$root"/tests/*_conformance.py; do
  echo "== $(basename "$t")"
  "$venv/bin/python" "$t" || status=1
done
exit "$status"
