#!/usr/bin/env bash
# The agent's HTTP check (`POST /v1/check`) from outside (issue 13 item 5, not a test): two agent
# binaries, a baseline and a candidate, alternated round by round on loopback with h2load
# (Debian `nghttp2-client`) over HTTP/1.1 as the client. Each agent runs alone with a local-only
# policy (two rules, 10^9/s: every request is admitted) and no allocator; the body has two
# descriptors. Per round and binary: closed-loop throughput (16 connections, 10 s after a
# warm-up of 20,000 requests) and latency at 5,000 req/s (4 connections x 1,250 req/s, 10 s,
# p50/p99/p99.9 from h2load's per-request log). Prints every round, the medians and
# candidate / baseline.
# Usage: bash simulations/bench-http.sh BASELINE_AGENT [CANDIDATE_AGENT] [ROUNDS]
#   (CANDIDATE_AGENT defaults to target/release/allot-agent of this checkout, ROUNDS to 3)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="$(realpath "${1:?usage: bench-http.sh BASELINE_AGENT [CANDIDATE_AGENT] [ROUNDS]}")"
cand="$(realpath "${2:-$root/target/release/allot-agent}")"
rounds="${3:-3}"
command -v h2load >/dev/null || { echo "h2load not found (apt-get install nghttp2-client)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
cat > "$tmp/policy.yaml" <<'YAML'
domain: bench
descriptors:
  - key: tenant
    value: local
    rate_limit: {name: bench-local, unit: second, requests_per_unit: 1000000000, burst: 1000000000, scope: local}
  - key: path
    rate_limit: {name: bench-path, unit: second, requests_per_unit: 1000000000, burst: 1000000000, scope: local}
YAML
printf '%s' '{"domain":"bench","descriptors":[{"entries":[{"key":"tenant","value":"local"}]},{"entries":[{"key":"path","value":"/a"}]}]}' > "$tmp/body.json"
h2() { h2load --h1 -t 1 -H 'content-type: application/json' -d "$tmp/body.json" "$@"; }

# run BIN: one round against BIN; prints "req/s p50 p99 p99.9" (latencies in µs).
run() {
  local ready="$tmp/ready" log="$tmp/lat.log"
  rm -f "$ready" "$log"
  "$1" --agent-id bench --region r --policies "$tmp/policy.yaml" --grpc-listen 127.0.0.1:0 \
    --http-listen 127.0.0.1:0 --ready-file "$ready" 2>"$tmp/agent.log" &
  local pid=$!
  for _ in $(seq 300); do [ -s "$ready" ] && break; sleep 0.1; done
  local url="http://$(awk '$1 == "http" { print $2 }' "$ready")/v1/check"
  h2 -n 20000 -c 16 "$url" >/dev/null
  local rps
  rps=$(h2 -D 10 -c 16 "$url" | awk '/^finished in/ { print int($4) }')
  h2 -D 10 -c 4 --rps 1250 --log-file "$log" "$url" >/dev/null
  local lat
  lat=$(sort -n -k3 "$log" | awk '{ a[NR] = $3 } END { print a[int(NR * 0.5)], a[int(NR * 0.99)], a[int(NR * 0.999)] }')
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$rps $lat"
}

median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }

: > "$tmp/base" ; : > "$tmp/cand"
for r in $(seq "$rounds"); do
  # The order flips each round, so neither binary always runs first.
  if (( r % 2 )); then order="base cand"; else order="cand base"; fi
  for which in $order; do
    bin=$base; [ "$which" = cand ] && bin=$cand
    line=$(run "$bin")
    echo "round $r $which: req/s p50 p99 p99.9 (µs) = $line"
    echo "$line" >> "$tmp/$which"
  done
done
echo "medians over $rounds rounds:"
for col in 1 2 3 4; do
  name=$(echo "req/s p50_us p99_us p99.9_us" | cut -d' ' -f$col)
  b=$(cut -d' ' -f$col "$tmp/base" | median)
  c=$(cut -d' ' -f$col "$tmp/cand" | median)
  awk -v n="$name" -v b="$b" -v c="$c" 'BEGIN { printf "  %-9s baseline %8d  candidate %8d  candidate/baseline %.2fx\n", n, b, c, (b > 0 ? c / b : 0) }'
done
