#!/usr/bin/env bash
# The project's test command (README "Test"): every crate's tests, then the shared acceptance
# cases through `allotctl replay` and check.py. Exits non-zero on any failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

acceptance="${ALLOT_ACCEPTANCE:-$root/../shared/acceptance}"
if [[ ! -f "$acceptance/check.py" ]]; then
  echo "test.sh: acceptance suite not found at $acceptance (set ALLOT_ACCEPTANCE)" >&2
  exit 1
fi

cargo test --workspace
cargo build -p allotctl
python3 "$acceptance/check.py" --replay "$root/target/debug/allotctl replay --summary none"
