#!/usr/bin/env python3
"""A real gateway in front of Allot: Envoy's HTTP rate-limit filter calling an Allot agent.

Starts a 1-node allocator, one agent and two Envoy proxies (failure_mode_deny true and false) in
front of a small upstream, all on loopback, then checks from outside, over HTTP:
  * requests through Envoy get 200 until the contract (burst 5) is spent, then 429 with the
    RateLimit headers and Retry-After;
  * another tenant has its own budget;
  * with the agent stopped, the deny-mode Envoy refuses (its configured failure mode) and the
    allow-mode Envoy lets requests through.
Prints one line per check and `N passed, M failed` last; exits non-zero on any failure.

Environment: ALLOT_BIN_DIR (default target/debug), ENVOY (default `envoy` on PATH).
"""
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("ALLOT_BIN_DIR", os.path.join(ROOT, "target", "debug"))
ENVOY = os.environ.get("ENVOY", shutil.which("envoy") or "envoy")

POLICY = """domain: edge
descriptors:
  - key: tenant
    descriptors:
      - key: operation
        value: search
        rate_limit:
          name: edge-search
          unit: minute
          requests_per_unit: 1
          burst: 5
          lease: {ttl_ms: 5000, max_grant: 5}
"""

results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(("ok   " if ok else "FAIL ") + name + (f"  ({detail})" if detail else ""), flush=True)


def read_ready(path, proc, timeout=30.0):
    """The {name: port} a child wrote to its --ready-file once it listened; {} if it did not."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(path) as f:
                lines = [line.split() for line in f.read().splitlines() if line.strip()]
            return {name: int(addr.rsplit(":", 1)[1]) for name, addr in lines}
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            return {}
        time.sleep(0.02)
    return {}


def envoy_listener_port(admin_path, proc, timeout=30.0):
    """The ingress listener's port, read from the admin API whose address Envoy wrote to
    admin_path (--admin-address-path); None if Envoy did not come up."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            admin = open(admin_path).read().strip()
            with urllib.request.urlopen(f"http://{admin}/listeners?format=json", timeout=1) as r:
                listeners = json.load(r)["listener_statuses"]
            for ln in listeners:
                port = ln["local_address"]["socket_address"].get("port_value", 0)
                if ln["name"] == "ingress" and port:
                    return port
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def wait_port(port, timeout=30.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


class Upstream(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def get(port, tenant):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/search", headers={"x-tenant": tenant})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def envoy_config(tmp, name, listen, admin, agent_port, upstream_port, deny):
    tmpl = open(os.path.join(ROOT, "tests", "envoy", "envoy.yaml.tmpl")).read()
    cfg = (
        tmpl.replace("@listen_port@", str(listen))
        .replace("@admin_port@", str(admin))
        .replace("@agent_port@", str(agent_port))
        .replace("@upstream_port@", str(upstream_port))
        .replace("@domain@", "edge")
        .replace("@failure_mode_deny@", "true" if deny else "false")
    )
    path = os.path.join(tmp, f"{name}.yaml")
    open(path, "w").write(cfg)
    return path


def main():
    tmp = tempfile.mkdtemp(prefix="allot-envoy-")
    procs = []
    logs = []

    def spawn(name, argv):
        log = open(os.path.join(tmp, f"{name}.log"), "w")
        logs.append(log)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(p)
        return p

    try:
        policy_dir = os.path.join(tmp, "policies")
        os.makedirs(policy_dir)
        open(os.path.join(policy_dir, "edge.yaml"), "w").write(POLICY)

        # Every server binds port 0 and reports the port it got; nothing picks a port for it.
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
        upstream_port = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()

        ready = os.path.join(tmp, "allocator.ready")
        alloc = spawn("allocator", [
            os.path.join(BIN, "allot-allocator"), "--node-id", "1",
            "--listen", "127.0.0.1:0", "--ready-file", ready,
            "--data-dir", os.path.join(tmp, "alloc"), "--init", "--policies", policy_dir,
        ])
        alloc_port = read_ready(ready, alloc).get("grpc")
        check("allocator listens", alloc_port is not None and wait_port(alloc_port))

        ready = os.path.join(tmp, "agent.ready")
        agent = spawn("agent", [
            os.path.join(BIN, "allot-agent"), "--agent-id", "gw-1", "--region", "eu-west",
            "--allocator", f"127.0.0.1:{alloc_port}", "--policies", policy_dir,
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--ready-file", ready,
        ])
        rls_port = read_ready(ready, agent).get("grpc")
        check("agent listens", rls_port is not None and wait_port(rls_port))

        ports = {}
        for name, deny in (("deny", True), ("allow", False)):
            cfg = envoy_config(tmp, f"envoy-{name}", 0, 0, rls_port, upstream_port, deny)
            admin_path = os.path.join(tmp, f"envoy-{name}.admin")
            proc = spawn(f"envoy-{name}", [ENVOY, "-c", cfg, "--admin-address-path", admin_path,
                                           "--use-dynamic-base-id", "--log-level", "warn",
                                           "--concurrency", "1"])
            ports[name] = envoy_listener_port(admin_path, proc)
            check(f"envoy ({name} on failure) listens", ports[name] is not None)

        # The policy is installed once the allocator leads: wait for the first 200.
        t0 = time.time()
        status, headers = get(ports["deny"], "acme")
        while status != 200 and time.time() - t0 < 20:
            time.sleep(0.2)
            status, headers = get(ports["deny"], "acme")
        codes = [status] + [get(ports["deny"], "acme")[0] for _ in range(4)]
        check("first 5 requests through Envoy are 200", codes == [200] * 5, f"codes {codes}")
        status, headers = get(ports["deny"], "acme")
        lower = {k.lower(): v for k, v in headers.items()}
        check("6th request is 429", status == 429, f"status {status}")
        ra = lower.get("retry-after")
        # 1 token per minute, the 6th asked at most a few seconds after the 5th: 55..60 s.
        check("429 carries Retry-After (whole seconds, one token at 1/min)",
              ra is not None and ra.isdigit() and 50 <= int(ra) <= 60, f"retry-after {ra!r}")
        check("429 carries RateLimit headers",
              "ratelimit-limit" in lower and lower.get("ratelimit-remaining") == "0",
              f"headers {sorted(k for k in lower if 'ratelimit' in k)}")
        status, _ = get(ports["deny"], "birch")
        check("another tenant has its own budget", status == 200, f"status {status}")

        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        check("agent stops cleanly on SIGTERM", agent.returncode == 0, f"exit {agent.returncode}")
        status, _ = get(ports["deny"], "carol")
        check("agent down: failure_mode_deny Envoy refuses", status >= 500, f"status {status}")
        status, _ = get(ports["allow"], "carol")
        check("agent down: fail-open Envoy lets the request through", status == 200, f"status {status}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
        if all(results):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}")
    passed = sum(1 for r in results if r)
    failed = len(results) - passed
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
