//! Human-readable and JSON renderings of the allocator's answers. Token quantities arrive in
//! microtokens; the text shows tokens with their fraction, the JSON keeps raw microtokens.

use allot_proto::allot::v1 as pb;
use serde_json::{json, Value};
use tonic::Status;

/// Microtokens per token.
const MICROS_PER_TOKEN: u64 = 1_000_000;

/// Microtokens as tokens with the fraction kept exactly and trailing zeros dropped:
/// 1_500_000 → "1.5", 4_000_000 → "4", 1 → "0.000001".
pub fn tokens(micros: u64) -> String {
    let whole = micros / MICROS_PER_TOKEN;
    let frac = micros % MICROS_PER_TOKEN;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:06}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// An error from the allocator: its gRPC code and message, and where the leader is when a
/// follower named it.
pub fn status_error(s: &Status) -> String {
    let mut out = format!("{:?}: {}", s.code(), s.message());
    if let Some(h) = allot_proto::error_detail::leader_hint(s) {
        let id = h.leader_id.map_or("unknown".into(), |i| i.to_string());
        let addr = if h.leader_addr.is_empty() {
            "unknown address".to_string()
        } else {
            h.leader_addr
        };
        out.push_str(&format!("\nleader hint: node {id} at {addr}"));
    }
    out
}

/// A key's status as a table.
pub fn key_status_text(s: &pb::StatusResponse) -> String {
    let key = s.key.as_ref().map_or(String::new(), |k| {
        let entries: Vec<String> = k
            .entries
            .iter()
            .map(|e| format!("{}={}", e.key, e.value))
            .collect();
        format!("{} {}", k.domain, entries.join(" "))
    });
    let mut rows = vec![[
        "region".to_string(),
        "live".into(),
        "granted".into(),
        "reported".into(),
        "stranded".into(),
        "overshoot bound".into(),
    ]];
    for r in &s.regions {
        rows.push([
            r.region.clone(),
            r.live_allocations.to_string(),
            tokens(r.granted),
            tokens(r.reported),
            tokens(r.stranded),
            tokens(r.overshoot_bound),
        ]);
    }
    let mut widths = [0usize; 6];
    for row in &rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = format!(
        "key {key}: policy version {}, global bucket {} tokens\n",
        s.policy_version,
        tokens(s.bucket_tokens)
    );
    if !s.policy.is_empty() {
        out.push_str(&format!("rule {}: {}\n", s.policy, limit(s)));
    }
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i == 0 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str("(tokens; live, granted, reported and the overshoot bound cover live allocations; stranded is cumulative)\n");
    let parts: Vec<String> = s
        .regions
        .iter()
        .filter(|r| r.part_ppm.is_some())
        .map(|r| format!("{} {}", r.region, part(r)))
        .collect();
    if !parts.is_empty() {
        out.push_str(&format!(
            "parts now (configured share): {}\n",
            parts.join(", ")
        ));
    }
    out
}

/// The rule's limit as configured, e.g. "10 per second, capacity 40 tokens"; "unlimited" for
/// a rule without one (an allocator older than these fields sends none: empty policy name).
fn limit(s: &pb::StatusResponse) -> String {
    if s.requests_per_unit == 0 {
        return "unlimited".into();
    }
    let unit = s.unit.to_ascii_lowercase();
    let per = if s.unit_multiplier > 1 {
        format!("{} {unit}s", s.unit_multiplier)
    } else {
        unit
    };
    format!(
        "{} per {per}, capacity {} tokens",
        s.requests_per_unit, s.capacity_tokens
    )
}

/// Parts per million as a percentage with up to four decimals, e.g. 662500 → "66.25%".
fn percent(ppm: u32) -> String {
    let whole = ppm / 10_000;
    let frac = ppm % 10_000;
    if frac == 0 {
        return format!("{whole}%");
    }
    let f = format!("{frac:04}");
    format!("{whole}.{}%", f.trim_end_matches('0'))
}

/// A region's part and share, e.g. "66.25% (50%)", with a handoff in progress noted; "-" when
/// the policy has no regional shares.
fn part(r: &pb::RegionStatus) -> String {
    let Some(p) = r.part_ppm else {
        return "-".into();
    };
    let mut s = percent(p);
    if let Some(g) = r.share_ppm {
        s.push_str(&format!(" ({})", percent(g)));
    }
    if r.reserved_ppm > 0 {
        s.push_str(&format!(" +{} held", percent(r.reserved_ppm)));
    }
    s
}

/// A key's status as JSON, quantities in raw microtokens.
pub fn key_status_json(s: &pb::StatusResponse) -> Value {
    let key = s.key.as_ref().map(|k| {
        json!({
            "domain": k.domain,
            "entries": k.entries.iter().map(|e| json!({"key": e.key, "value": e.value})).collect::<Vec<_>>(),
        })
    });
    json!({
        "key": key,
        "policy_version": s.policy_version,
        "policy": s.policy,
        "requests_per_unit": s.requests_per_unit,
        "unit": s.unit,
        "unit_multiplier": s.unit_multiplier,
        "capacity_tokens": s.capacity_tokens,
        "bucket_tokens_micros": s.bucket_tokens,
        "regions": s.regions.iter().map(|r| json!({
            "region": r.region,
            "live_allocations": r.live_allocations,
            "granted_micros": r.granted,
            "reported_micros": r.reported,
            "stranded_micros": r.stranded,
            "overshoot_bound_micros": r.overshoot_bound,
            "part_ppm": r.part_ppm,
            "share_ppm": r.share_ppm,
            "reserved_ppm": r.reserved_ppm,
        })).collect::<Vec<_>>(),
    })
}

fn members(ms: &[pb::Member]) -> Vec<Value> {
    ms.iter()
        .map(|m| json!({"node_id": m.node_id, "addr": m.addr}))
        .collect()
}

/// Raft state as seen by one node, as text.
pub fn cluster_status_text(c: &pb::ClusterStatusResponse) -> String {
    let list = |ms: &[pb::Member]| {
        if ms.is_empty() {
            "-".to_string()
        } else {
            ms.iter()
                .map(|m| format!("{}={}", m.node_id, m.addr))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    let tables: String = c
        .tables
        .iter()
        .map(|t| {
            format!(
                "table {}: {} entries, {} refused, {} evicted\n",
                t.table, t.entries, t.refused, t.evicted
            )
        })
        .collect();
    let skew = c
        .clock_skew_ms
        .map_or("-".to_string(), |ms| format!("{ms:+} ms"));
    format!(
        "node {}: {} in term {}\nleader: {}\nvoters: {}\nlearners: {}\nlast log index: {}, last applied: {}\nclock skew: {} (beyond max drift {} times)\n{tables}",
        c.node_id,
        c.state,
        c.current_term,
        match c.leader_id {
            Some(id) if c.leader_addr.is_empty() => format!("node {id}"),
            Some(id) => format!("node {id} at {}", c.leader_addr),
            None => "unknown".into(),
        },
        list(&c.voters),
        list(&c.learners),
        opt(c.last_log_index),
        opt(c.last_applied_index),
        skew,
        c.clock_skew_beyond_max,
    )
}

/// Raft state as seen by one node, as JSON.
pub fn cluster_status_json(c: &pb::ClusterStatusResponse) -> Value {
    json!({
        "node_id": c.node_id,
        "state": c.state,
        "current_term": c.current_term,
        "leader_id": c.leader_id,
        "leader_addr": c.leader_addr,
        "voters": members(&c.voters),
        "learners": members(&c.learners),
        "last_log_index": c.last_log_index,
        "last_applied_index": c.last_applied_index,
        "tables": c.tables.iter().map(|t| json!({
            "table": t.table,
            "entries": t.entries,
            "refused": t.refused,
            "evicted": t.evicted,
        })).collect::<Vec<_>>(),
        "clock_skew_ms": c.clock_skew_ms,
        "clock_skew_beyond_max": c.clock_skew_beyond_max,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn tokens_keep_exact_fractions() {
        assert_eq!(tokens(0), "0");
        assert_eq!(tokens(4_000_000), "4");
        assert_eq!(tokens(1_500_000), "1.5");
        assert_eq!(tokens(1), "0.000001");
        assert_eq!(tokens(12_345_678), "12.345678");
        assert_eq!(tokens(u64::MAX), "18446744073709.551615");
    }

    #[test]
    fn leader_hint_is_shown() {
        let hint = pb::LeaderHint {
            leader_id: Some(2),
            leader_addr: "127.0.0.1:7702".into(),
        };
        let s = Status::with_details(
            tonic::Code::FailedPrecondition,
            "not the leader",
            hint.encode_to_vec().into(),
        );
        let text = status_error(&s);
        assert!(
            text.starts_with("FailedPrecondition: not the leader"),
            "{text}"
        );
        assert!(text.contains("node 2 at 127.0.0.1:7702"), "{text}");
        // The typed form: a NOT_LEADER ErrorDetail in a google.rpc.Status.
        let typed = allot_proto::error_detail::status(
            tonic::Code::FailedPrecondition,
            &pb::ErrorDetail {
                reason: pb::ErrorReason::NotLeader as i32,
                message: "not the leader".into(),
                leader_id: Some(3),
                leader_addr: "127.0.0.1:7703".into(),
                ..Default::default()
            },
        );
        let text = status_error(&typed);
        assert!(text.contains("node 3 at 127.0.0.1:7703"), "{text}");
        let plain = status_error(&Status::not_found("no allocation 7"));
        assert_eq!(plain, "NotFound: no allocation 7");
    }

    #[test]
    fn status_table_shows_tokens() {
        let s = pb::StatusResponse {
            key: Some(pb::PolicyKey {
                domain: "api".into(),
                entries: vec![pb::DescriptorEntry {
                    key: "tenant".into(),
                    value: "acme".into(),
                }],
            }),
            policy_version: 3,
            policy: "acme-search".into(),
            requests_per_unit: 10,
            unit: "SECOND".into(),
            unit_multiplier: 1,
            capacity_tokens: 40,
            bucket_tokens: 46_500_000,
            regions: vec![pb::RegionStatus {
                region: "eu-west".into(),
                live_allocations: 2,
                granted: 8_000_000,
                reported: 2_250_000,
                stranded: 0,
                overshoot_bound: 5_750_000,
                part_ppm: Some(662_500),
                share_ppm: Some(500_000),
                reserved_ppm: 0,
            }],
        };
        let t = key_status_text(&s);
        assert!(
            t.contains("key api tenant=acme: policy version 3, global bucket 46.5 tokens"),
            "{t}"
        );
        assert!(
            t.contains("rule acme-search: 10 per second, capacity 40 tokens"),
            "{t}"
        );
        assert!(t.contains("eu-west"), "{t}");
        assert!(t.contains("5.75"), "{t}");
        assert!(
            t.contains("parts now (configured share): eu-west 66.25% (50%)"),
            "{t}"
        );
        let j = key_status_json(&s);
        assert_eq!(j["regions"][0]["overshoot_bound_micros"], 5_750_000);
        assert_eq!(j["regions"][0]["part_ppm"], 662_500);
        assert_eq!(j["regions"][0]["share_ppm"], 500_000);
        // Extremes of the percentage.
        assert_eq!(percent(0), "0%");
        assert_eq!(percent(1), "0.0001%");
        assert_eq!(percent(1_000_000), "100%");
        assert_eq!(percent(u32::MAX), "429496.7295%");
        let held = pb::RegionStatus {
            reserved_ppm: 100_000,
            ..s.regions[0].clone()
        };
        assert_eq!(part(&held), "66.25% (50%) +10% held");
        let none = pb::RegionStatus {
            part_ppm: None,
            ..s.regions[0].clone()
        };
        assert_eq!(part(&none), "-");
    }

    #[test]
    fn cluster_status_shows_the_clock_skew() {
        let mut c = pb::ClusterStatusResponse {
            node_id: 2,
            state: "Leader".into(),
            clock_skew_ms: Some(3_000),
            clock_skew_beyond_max: 4,
            ..Default::default()
        };
        let text = cluster_status_text(&c);
        assert!(
            text.contains("clock skew: +3000 ms (beyond max drift 4 times)"),
            "{text}"
        );
        assert_eq!(cluster_status_json(&c)["clock_skew_ms"], 3_000);
        c.clock_skew_ms = Some(-12);
        assert!(cluster_status_text(&c).contains("clock skew: -12 ms"));
        c.clock_skew_ms = None;
        assert!(cluster_status_text(&c).contains("clock skew: - (beyond"));
        assert!(cluster_status_json(&c)["clock_skew_ms"].is_null());
    }
}
