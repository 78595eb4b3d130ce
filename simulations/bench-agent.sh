#!/usr/bin/env bash
# Issue 4 benchmarks on loopback (not a test): a 1-node allocator and one agent in release mode,
# then allot-bench against the agent's Envoy RLS API:
#   1. p50/p99 at 5,000 req/s (3 runs each), local and leased policy, each against a no-op RLS baseline
#      (`allot-bench noop`, a process of its own like the agent) measured in the same run;
#   2. the highest offered rate the agent still answers in full (throughput ramp);
#   3. allocator RPCs per 1,000 admitted decisions at a steady 2,000 req/s.
# Usage: bash simulations/bench-agent.sh   (from the repository root)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release -q -p allot-allocator -p allot-agent -p allot-simulations --bins
bin="$root/target/release"
tmp="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
mkdir -p "$tmp/policies"
cat > "$tmp/policies/bench.yaml" <<'YAML'
domain: bench
descriptors:
  - key: tenant
    value: local
    rate_limit: {unit: second, requests_per_unit: 1000000, scope: local}
  - key: tenant
    value: leased
    rate_limit:
      unit: second
      requests_per_unit: 100000
      burst: 100000
      lease: {ttl_ms: 5000, max_grant: 50000}
YAML
# Every server binds port 0 and writes "NAME HOST:PORT" lines to its ready file once listening.
addr() { # addr FILE NAME: waits for FILE, prints NAME's port
  for _ in $(seq 300); do [ -s "$1" ] && break; sleep 0.1; done
  awk -v n="$2" '$1 == n { sub(/.*:/, "", $2); print $2 }' "$1"
}
"$bin/allot-allocator" --node-id 1 --listen 127.0.0.1:0 --ready-file "$tmp/alloc.ready" --init \
  --data-dir "$tmp/alloc" --policies "$tmp/policies" 2>"$tmp/alloc.log" &
ap=$(addr "$tmp/alloc.ready" grpc)
"$bin/allot-agent" --agent-id bench-1 --region eu --allocator 127.0.0.1:$ap \
  --grpc-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --ready-file "$tmp/agent.ready" \
  --policies "$tmp/policies" 2>"$tmp/agent.log" &
"$bin/allot-bench" --threads 2 noop --listen 127.0.0.1:0 --ready-file "$tmp/noop.ready" 2>"$tmp/noop.log" &
gp=$(addr "$tmp/agent.ready" grpc); hp=$(addr "$tmp/agent.ready" http); np=$(addr "$tmp/noop.ready" grpc)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$hp/healthz" >/dev/null && break; sleep 0.1; done
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "## 1. RLS latency at 5000 req/s, 3 runs of 10 s, each after a 3 s warm-up (local-scope policy)"
"$bin/allot-bench" rls --target 127.0.0.1:$gp --rate 5000 --duration 10 --warmup 3 --repeat 3 --domain bench --entry tenant=local --baseline-target 127.0.0.1:$np
echo
echo "## 1b. RLS latency at 5000 req/s, 3 runs of 10 s, each after a 3 s warm-up (leased policy)"
"$bin/allot-bench" rls --target 127.0.0.1:$gp --rate 5000 --duration 10 --warmup 3 --repeat 3 --domain bench --entry tenant=leased --baseline-target 127.0.0.1:$np
echo
echo "## 2. throughput ramp (local-scope policy, 5 s each after a 1 s warm-up)"
for rate in 5000 10000 15000 20000 30000; do
  "$bin/allot-bench" rls --target 127.0.0.1:$gp --rate $rate --duration 5 --warmup 1 --domain bench --entry tenant=local --json \
    | python3 -c "import json,sys; r=json.load(sys.stdin)['target']; print(f\"offered {$rate}/s: answered {r['throughput']:.0f}/s, errors {r['errors']}, from send p50 {r['svc_p50_us']} µs p99 {r['svc_p99_us']} µs, from schedule p99 {r['p99_us']} µs\")"
done
echo
echo "## 3. allocator RPCs per 1000 admitted (leased policy, 2000 req/s, 20 s after a 3 s warm-up)"
"$bin/allot-bench" steady --target 127.0.0.1:$gp --http 127.0.0.1:$hp --rate 2000 --duration 20 --domain bench --entry tenant=leased
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
