//! `allotctl replay` and `validate` from outside, as an operator runs them.

use std::path::Path;
use std::process::Command;

const POLICY: &str = "domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1, burst: 2, name: k-limit}
  - key: s
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: fixed_window, name: s-limit}
";

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

fn replay(dir: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_allotctl"))
        .current_dir(dir)
        .args(["replay", "--config", "p.yaml", "--trace", "t.jsonl"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn replay_prints_decisions_errors_and_per_limit_counts() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.yaml", POLICY);
    let req = |k: &str| {
        format!(
            r#"{{"t_ms": 0, "request": {{"domain": "d", "descriptors": [{{"entries": [{{"key": "{k}", "value": "x"}}]}}]}}}}"#
        )
    };
    let trace = [req("k"), req("k"), req("k"), req("s"), req("s"), "not json".into(), r#"{"t_ms": 1, "request": {"domain": "nope", "descriptors": [{"entries": [{"key": "k", "value": "x"}]}]}}"#.into()]
        .join("\n");
    write(dir.path(), "t.jsonl", &trace);
    let out = replay(dir.path(), &["--summary", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 7);
    let codes: Vec<_> = lines[..5]
        .iter()
        .map(|l| l["overall_code"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(codes, ["OK", "OK", "OVER_LIMIT", "OK", "OK"]);
    assert_eq!(lines[2]["retry_after_s"], 1);
    assert_eq!(lines[4]["statuses"][0]["shadow_over_limit"], true);
    assert_eq!(lines[5]["error"], "invalid_argument");
    assert_eq!(lines[6]["error"], "invalid_argument");
    assert!(lines[6]["message"].as_str().unwrap().contains("nope"));
    let summary: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(summary["requests"], 5);
    assert_eq!(summary["invalid"], 2);
    assert_eq!(summary["limits"]["k-limit"]["allowed"], 2);
    assert_eq!(summary["limits"]["k-limit"]["denied"], 1);
    assert_eq!(summary["limits"]["s-limit"]["allowed"], 2);
    assert_eq!(summary["limits"]["s-limit"]["shadow_denied"], 1);
}

#[test]
fn a_bad_config_anywhere_in_the_trace_refuses_the_whole_replay() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.yaml", POLICY);
    write(dir.path(), "bad.yaml", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 0}\n");
    write(
        dir.path(),
        "t.jsonl",
        "{\"t_ms\": 0, \"request\": {\"domain\": \"d\", \"descriptors\": [{\"entries\": [{\"key\": \"k\", \"value\": \"x\"}]}]}}\n{\"t_ms\": 5, \"config\": \"bad.yaml\"}\n",
    );
    let out = replay(dir.path(), &[]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "nothing is decided");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yaml") && err.contains("burst") && err.contains("got 0"),
        "{err}"
    );
}

#[test]
fn validate_lists_rules_or_names_the_fault() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.yaml", POLICY);
    let out = Command::new(env!("CARGO_BIN_EXE_allotctl"))
        .args(["validate", "--config"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("k-limit: token_bucket 1 per 1×second (capacity 2)"),
        "{text}"
    );
    assert!(
        text.contains("s-limit: fixed_window 1 per 1×minute (capacity 1) [shadow]"),
        "{text}"
    );
    // The path may also be given alone.
    let plain = Command::new(env!("CARGO_BIN_EXE_allotctl"))
        .arg("validate")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(plain.status.success());
    assert_eq!(String::from_utf8(plain.stdout).unwrap(), text);
    write(dir.path(), "q.yaml", "domain: d\ndescriptors: []\n");
    let out = Command::new(env!("CARGO_BIN_EXE_allotctl"))
        .args(["validate", "--config"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"d\"") && err.contains("p.yaml") && err.contains("q.yaml"),
        "{err}"
    );
}
