//! The acceptance cases hold through the agent (issue 4): every shared case replayed with
//! `--through agent` (the agent's native Check, cross-checked against its Envoy RLS handler)
//! answers line for line what the decision core answers (which `check.py` holds to the
//! contract), including a cost above the limit's capacity: OVER_LIMIT with no Retry-After from
//! both (issue 10 item 16: an error would let it through a gateway that fails open).
//!
//! The cases are read from `$ALLOT_ACCEPTANCE`, else `../shared/acceptance` beside the
//! repository (where `scripts/test.sh` also expects them).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn acceptance() -> PathBuf {
    std::env::var_os("ALLOT_ACCEPTANCE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/acceptance"))
}

fn replay(case: &Path, through: &str) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_allotctl"))
        .args([
            "replay",
            "--config",
            "limits.yaml",
            "--trace",
            "trace.jsonl",
            "--summary",
            "none",
            "--through",
            through,
        ])
        .current_dir(case)
        .output()
        .expect("allotctl runs");
    assert!(
        out.status.success(),
        "{} --through {through}: {}",
        case.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("UTF-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// The core's line without `current_limit`, which the native API does not carry in full.
fn comparable(mut v: Value) -> Value {
    if let Some(sts) = v.get_mut("statuses").and_then(Value::as_array_mut) {
        for s in sts {
            if let Some(o) = s.as_object_mut() {
                o.remove("current_limit");
            }
        }
    }
    v
}

/// The core's answer for a cost that can never pass: OVER_LIMIT with no Retry-After (the only
/// denial without one).
fn can_never_pass(core: &Value) -> bool {
    core["overall_code"] == "OVER_LIMIT" && core["retry_after_s"].is_null()
}

#[test]
fn acceptance_cases_hold_through_the_agent() {
    let dir = acceptance().join("cases");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "acceptance cases not found at {} ({e}); set ALLOT_ACCEPTANCE",
                dir.display()
            )
        })
        .map(|e| e.expect("readable").path())
        .filter(|p| p.join("trace.jsonl").exists() && p.join("expect.jsonl").exists())
        .collect();
    cases.sort();
    assert!(cases.len() >= 10, "too few cases in {}", dir.display());
    let (mut same, mut never) = (0, 0);
    for case in &cases {
        let core = replay(case, "core");
        let agent = replay(case, "agent");
        assert_eq!(core.len(), agent.len(), "{}: line count", case.display());
        for (i, (c, a)) in core.into_iter().zip(agent).enumerate() {
            let at = format!("{} line {}", case.display(), i + 1);
            if can_never_pass(&c) {
                never += 1;
            }
            assert_eq!(comparable(c), a, "{at}");
            same += 1;
        }
    }
    // The two cases with a cost above capacity answer as the core does, among plenty of
    // identical answers.
    assert!(
        never >= 2,
        "expected the cost-above-capacity requests, saw {never}"
    );
    assert!(same > 100, "only {same} identical lines");
}
