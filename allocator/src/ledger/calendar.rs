//! UTC calendar periods for quotas ("20 M units a month"), from Unix milliseconds, in integers.

use allot_common::config::CalendarPeriod;

const MS_PER_DAY: u64 = 86_400_000;

/// (year, month 1–12, day 1–31) of a day count since 1970-01-01 (Hinnant's civil_from_days).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Days since 1970-01-01 of a civil date (Hinnant's days_from_civil).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 } as i64;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Start and end (Unix ms, UTC) of the period containing `now_ms`.
pub fn period_bounds(period: CalendarPeriod, now_ms: u64) -> (u64, u64) {
    let day = now_ms / MS_PER_DAY;
    match period {
        CalendarPeriod::Day => (day * MS_PER_DAY, (day + 1) * MS_PER_DAY),
        CalendarPeriod::Month => {
            let (y, m, _) = civil_from_days(day as i64);
            let start = days_from_civil(y, m, 1);
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            let end = days_from_civil(ny, nm, 1);
            (start as u64 * MS_PER_DAY, end as u64 * MS_PER_DAY)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn month_bounds_are_utc_calendar_months() {
        // 2026-11-29T21:35:00Z
        let now = 1_795_988_100_000;
        let (s, e) = period_bounds(CalendarPeriod::Month, now);
        assert_eq!(s, 1_793_491_200_000); // 2026-11-01T00:00:00Z
        assert_eq!(e, 1_796_083_200_000); // 2026-12-01T00:00:00Z
                                          // February of a leap year has 29 days.
        let feb = days_from_civil(2028, 2, 10) as u64 * MS_PER_DAY;
        let (s, e) = period_bounds(CalendarPeriod::Month, feb);
        assert_eq!((e - s) / MS_PER_DAY, 29);
        let (s, e) = period_bounds(CalendarPeriod::Day, now);
        assert_eq!((s, e - s), (1_795_910_400_000, MS_PER_DAY));
        assert_eq!(
            period_bounds(CalendarPeriod::Month, 0),
            (0, 31 * MS_PER_DAY)
        );
    }

    #[test]
    fn civil_round_trip() {
        for d in [-1_000_000i64, -1, 0, 59, 60, 11_016, 20_000, 1_000_000] {
            let (y, m, dd) = civil_from_days(d);
            assert_eq!(days_from_civil(y, m, dd), d);
        }
    }
}
