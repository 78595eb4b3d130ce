//! Parsers of the admin commands' arguments: `REGION=SHARE` shares and `KEY=VALUE` descriptor
//! entries (an `ID=HOST:PORT` member parses with its `FromStr`, in `allot_proto::member`).
//! Errors are messages naming the bad input.

use allot_proto::allot::v1 as pb;

/// `KEY=VALUE` → a descriptor entry.
pub fn entry(s: &str) -> Result<pb::DescriptorEntry, String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    if key.is_empty() {
        return Err(format!("entry {s:?} has an empty key"));
    }
    Ok(pb::DescriptorEntry {
        key: key.to_string(),
        value: value.to_string(),
    })
}

/// Parts per million in 100 %.
const PPM: u64 = 1_000_000;

/// `REGION=50%` (a fraction, up to four decimals: `12.5%`) or `REGION=400` (an absolute rate in
/// the policy's requests per unit) → a region share.
pub fn share(s: &str) -> Result<pb::RegionShare, String> {
    let (region, value) = s
        .split_once('=')
        .ok_or_else(|| format!("expected REGION=PERCENT% or REGION=RATE, got {s:?}"))?;
    if region.is_empty() {
        return Err(format!("share {s:?} has an empty region"));
    }
    let value = value.trim();
    let share = match value.strip_suffix('%') {
        Some(pct) => pb::region_share::Share::FractionPpm(percent_to_ppm(pct.trim()).ok_or_else(
            || format!("share of {region:?}: {value:?} is not a percentage from 0% to 100% with at most 4 decimals"),
        )?),
        None => pb::region_share::Share::AbsoluteRate(value.parse::<u64>().map_err(|_| {
            format!("share of {region:?}: {value:?} is neither PERCENT% nor a whole rate")
        })?),
    };
    Ok(pb::RegionShare {
        region: region.to_string(),
        share: Some(share),
    })
}

/// "12.5" → 125_000 ppm, exactly; `None` beyond 100 or beyond 4 decimals.
fn percent_to_ppm(pct: &str) -> Option<u32> {
    let (whole, frac) = pct.split_once('.').unwrap_or((pct, ""));
    if whole.is_empty() || frac.len() > 4 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: u64 = whole.parse().ok()?;
    let frac_ppm: u64 = if frac.is_empty() {
        0
    } else {
        frac.parse::<u64>().ok()? * 10u64.pow(4 - frac.len() as u32)
    };
    let ppm = whole.checked_mul(PPM / 100)?.checked_add(frac_ppm)?;
    if ppm > PPM {
        return None;
    }
    u32::try_from(ppm).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::region_share::Share;

    #[test]
    fn shares_parse_exactly() {
        let s = |x: &str| share(x).map(|s| (s.region, s.share));
        assert_eq!(
            s("eu-west=50%"),
            Ok(("eu-west".into(), Some(Share::FractionPpm(500_000))))
        );
        assert_eq!(
            s("a=12.5%"),
            Ok(("a".into(), Some(Share::FractionPpm(125_000))))
        );
        assert_eq!(
            s("a=0.0001%"),
            Ok(("a".into(), Some(Share::FractionPpm(1))))
        );
        assert_eq!(
            s("us-east=400"),
            Ok(("us-east".into(), Some(Share::AbsoluteRate(400))))
        );
        for bad in ["a=101%", "a=1.00001%", "a=-1%", "a=x", "=5%", "a", "a=.5%"] {
            assert!(share(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn members_and_entries_parse() {
        assert_eq!(
            "2=127.0.0.1:7702".parse::<pb::Member>(),
            Ok(pb::Member {
                node_id: 2,
                addr: "127.0.0.1:7702".into()
            })
        );
        assert!("x=a:1".parse::<pb::Member>().is_err());
        assert!("1=".parse::<pb::Member>().is_err());
        assert_eq!(entry("tenant=acme").map(|e| e.value), Ok("acme".into()));
        assert_eq!(entry("tenant=").map(|e| e.value), Ok(String::new()));
        assert!(entry("=x").is_err());
        assert!(entry("tenant").is_err());
    }
}
