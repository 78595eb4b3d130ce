//! Part c without an operator (issue 9): eu-west's demand rises to 650/s while us-east sends
//! 300/s and ap-south idles, with the shares left at 500/400/100; then ap-south resumes at
//! 100/s. Measured from the records: when eu-west is first admitted at ≥ 640/s in every 1 s
//! window for 2 s running, when ap-south first gets ≥ 95 in a 1 s window after it resumes, and
//! the worst 1 s global window.

use super::{at_rate, Extra, Run, Timing};
use crate::arrivals::{Record, RequestAnswer};
use anyhow::Result;
use std::time::Duration;

/// Slot width of the rolling windows.
const SLOT_NS: u64 = 100_000_000;
/// Slots in one 1 s window.
const WINDOW: usize = 10;

/// Admitted per slot from `from_ns` on, for records of `agents`.
fn slots(recs: &[Record], agents: &[usize], from_ns: u64, n: usize) -> Vec<u64> {
    let mut out = vec![0u64; n];
    for r in recs
        .iter()
        .filter(|r| r.answer == RequestAnswer::Admitted && agents.contains(&r.agent))
    {
        if let Some(i) = r
            .sent_ns
            .checked_sub(from_ns)
            .map(|d| (d / SLOT_NS) as usize)
        {
            if let Some(s) = out.get_mut(i) {
                *s += 1;
            }
        }
    }
    out
}

/// Sum of each full 1 s window, by its first slot.
fn windows(s: &[u64]) -> Vec<u64> {
    s.windows(WINDOW).map(|w| w.iter().sum()).collect()
}

/// Seconds from the start of `w`'s slots to the end of the first window that starts `hold`
/// windows all ≥ `min` (None if none does).
fn first_sustained(w: &[u64], min: u64, hold: usize) -> Option<f64> {
    (0..w.len().saturating_sub(hold))
        .find(|&i| w[i..=i + hold].iter().all(|&x| x >= min))
        .map(|i| (i + WINDOW) as f64 * SLOT_NS as f64 / 1e9)
}

/// Runs the part and appends its row.
pub(super) async fn skew(run: &mut Run<'_>, part: &str, t: Timing) -> Result<()> {
    let k = run.key("search", &[("cluster", "search")], 1000);
    let (eu, us, ap) = (
        run.agents_of(&["eu-west"]),
        run.agents_of(&["us-east"]),
        run.agents_of(&["ap-south"]),
    );
    let total = t.skew_s + t.resume_s;
    let mut a = at_rate(650, total, &eu, k);
    a.extend(at_rate(300, total, &us, k));
    let resume_at = Duration::from_secs(t.skew_s);
    a.extend(at_rate(100, t.resume_s, &ap, k).into_iter().map(|mut x| {
        x.at += resume_at;
        x
    }));
    a.sort_by_key(|x| x.at);
    let recs = run.send(&a).await?;
    let start_ns = recs.first().map_or(0, |r| r.sent_ns);
    let n = (total * 1_000_000_000 / SLOT_NS) as usize;
    let eu_w = windows(&slots(&recs, &eu, start_ns, n));
    let all: Vec<usize> = eu.iter().chain(&us).chain(&ap).copied().collect();
    let global_max = windows(&slots(&recs, &all, start_ns, n))
        .into_iter()
        .max()
        .unwrap_or(0);
    let resume_ns = start_ns + t.skew_s * 1_000_000_000;
    let ap_w = windows(&slots(
        &recs,
        &ap,
        resume_ns,
        (t.resume_s * 1_000_000_000 / SLOT_NS) as usize,
    ));
    let eu_at = first_sustained(&eu_w, 640, 2 * WINDOW);
    let ap_at = first_sustained(&ap_w, 95, 0);
    let bound = run.bound_of(k).await?;
    // ap-south's lease TTL 2.5 s + drift 0.2 s + 1 s (deploy/examples/search-cluster.yaml).
    let ap_limit = 3.7;
    let met = eu_at.is_some_and(|s| s <= 3.0)
        && ap_at.is_some_and(|s| s <= ap_limit)
        && global_max as f64 <= 1000.0 + bound;
    let show = |x: Option<f64>| x.map_or("never".to_string(), |s| format!("{s:.1} s"));
    let mut e = Extra {
        measured: format!(
            "eu-west ≥ 640/s after {}; ap-south ≥ 95/s after {}; worst 1 s global {global_max}",
            show(eu_at),
            show(ap_at)
        ),
        target: format!("eu ≤ 3 s, ap ≤ {ap_limit} s, global ≤ 1000 + bound {bound:.0}"),
        met: Box::new(move |_| met),
        figures: serde_json::Map::new(),
    };
    e.figures.insert("eu_640_after_s".into(), eu_at.into());
    e.figures.insert("ap_95_after_s".into(), ap_at.into());
    e.figures
        .insert("worst_global_window".into(), global_max.into());
    let what = format!(
        "part c, no operator: eu-west 650/s, us-east 300/s for {} s, then ap-south 100/s for {} s",
        t.skew_s, t.resume_s
    );
    run.finish(part, what, &recs, e).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sustained_rate_is_found_from_the_first_window_that_holds() {
        // 10 slots of 50 then 30 of 70 per slot: windows reach 700 from slot 10 on.
        let s: Vec<u64> = std::iter::repeat_n(50, 10)
            .chain(std::iter::repeat_n(70, 30))
            .collect();
        let w = windows(&s);
        assert_eq!(w[0], 500);
        assert_eq!(w[10], 700);
        // Window 7 is the first ≥ 640 (500 + 20·7); it and the 20 after it hold: 1.7 s.
        let at = first_sustained(&w, 640, 2 * WINDOW).expect("sustained");
        assert!((at - 1.7).abs() < 1e-9, "{at}");
        assert_eq!(first_sustained(&w, 701, 0), None);
        assert_eq!(first_sustained(&[], 1, 0), None);
        assert_eq!(first_sustained(&[u64::MAX], u64::MAX, 0), Some(1.0));
    }
}
