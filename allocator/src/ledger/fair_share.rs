//! Max-min fair division of scarce quota: among the holders of one region (as Doorman's
//! FairShare: when the asks exceed what is available, each holder gets at most an equal part,
//! and what holders asking less leave over is split among the rest, so one early gateway cannot
//! take the whole burst while the others are refused), and among the regions of one policy key
//! (weighted max-min by demand, design §5: shares are guaranteed minimums and weights).

use allot_common::config::PPM;
use allot_common::units::ppm_in_ceil;

/// The part of `pool` that `me` (an index into `wants`) gets when `wants` are divided max-min
/// fairly. Integer arithmetic; the sum of all parts never exceeds `pool`.
pub fn fair_part(pool: u64, wants: &[u64], me: usize) -> u64 {
    let total: u128 = wants.iter().map(|&w| w as u128).sum();
    if total <= pool as u128 {
        return wants[me];
    }
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut left = pool;
    let mut n = wants.len() as u64;
    for &i in &order {
        let equal = left / n;
        if wants[i] <= equal {
            if i == me {
                return wants[i];
            }
            left -= wants[i];
            n -= 1;
        } else {
            // Everyone from here on wants more than an equal part: all get the equal part.
            return equal;
        }
    }
    0
}

/// One region's claim in the division of a policy key's rate and capacity among regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionClaim {
    /// Its share: both the minimum it is guaranteed while it has demand and its weight in
    /// dividing what is left, parts per million. 0 means nothing, ever.
    pub guarantee_ppm: u32,
    /// Its measured demand in parts per million of the policy's rate; `None` when unbounded (it
    /// uses everything it is given, so its true demand is not known).
    pub demand_ppm: Option<u32>,
    /// Whether it asked recently; an idle region gets nothing and leaves its share to the busy.
    pub busy: bool,
    /// Whether it uses (nearly) all of its current part, so may want more than it can show:
    /// what is spare goes to hungry regions first.
    pub hungry: bool,
}

/// Weighted max-min division of the whole ([`PPM`]) among regions by demand (design §5):
/// 1. busy regions with a share are filled in proportion to their shares, none beyond its
///    demand, what a region below its demand-capped part leaves going to the others by weight
///    (water-filling), so each gets at least min(its demand, its share);
/// 2. what is still left (everyone's demand met) is divided by weight among the hungry busy
///    regions (those using all they have), or among all busy regions when none is hungry, as
///    headroom to grow into;
/// 3. a busy region's part is raised to `min_part_ppm` (the part worth one whole token of
///    capacity, see [`one_token_ppm`]) when the whole allows, taken from the largest part:
///    tokens are indivisible, a smaller part would never hold one.
///
/// Returns one part per claim, in order; integer arithmetic, Σ parts ≤ [`PPM`]; idle regions and
/// regions with a share of 0 get 0.
pub fn region_parts(claims: &[RegionClaim], min_part_ppm: u32) -> Vec<u32> {
    let whole = u64::from(PPM);
    let weight = |i: usize| u64::from(claims[i].guarantee_ppm);
    let active: Vec<usize> = (0..claims.len())
        .filter(|&i| claims[i].busy && claims[i].guarantee_ppm > 0)
        .collect();
    let mut parts = vec![0u64; claims.len()];
    let mut left = whole;
    let mut open = active.clone();
    while !open.is_empty() {
        let w: u64 = open.iter().map(|&i| weight(i)).sum();
        // Each open region's level; ≤ PPM × PPM, far inside u64.
        let level = |i: usize| left * weight(i) / w;
        let (capped, rest): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| {
            claims[i]
                .demand_ppm
                .is_some_and(|d| u64::from(d) <= level(i))
        });
        if capped.is_empty() {
            let given: Vec<(usize, u64)> = open.iter().map(|&i| (i, level(i))).collect();
            for (i, p) in given {
                parts[i] = p;
                left -= p;
            }
            break;
        }
        for i in capped {
            let d = claims[i].demand_ppm.map_or(0, u64::from);
            parts[i] = d;
            left -= d;
        }
        open = rest;
    }
    let hungry: Vec<usize> = active
        .iter()
        .copied()
        .filter(|&i| claims[i].hungry)
        .collect();
    let growers = if hungry.is_empty() { &active } else { &hungry };
    let w_grow: u64 = growers.iter().map(|&i| weight(i)).sum();
    let spare = left;
    for &i in growers {
        // w_grow > 0 whenever there is a grower: every active region has a weight.
        let extra = (spare * weight(i)).checked_div(w_grow).unwrap_or(0);
        parts[i] += extra;
        left -= extra;
    }
    let need = |i: usize| {
        let g = u64::from(claims[i].guarantee_ppm);
        claims[i].demand_ppm.map_or(g, |d| g.min(u64::from(d)))
    };
    let needs: Vec<u64> = (0..claims.len()).map(need).collect();
    give_whole_tokens(&mut parts, &active, &needs, u64::from(min_part_ppm), left);
    debug_assert!(parts.iter().sum::<u64>() <= whole);
    parts
        .into_iter()
        .map(|p| u32::try_from(p).unwrap_or(PPM))
        .collect()
}

/// Raises each active part below `min` to `min`, from `left` first, then from the largest part
/// while that keeps at least `min` and its own guaranteed need; a part that cannot be raised so
/// is left as it is.
fn give_whole_tokens(parts: &mut [u64], active: &[usize], needs: &[u64], min: u64, mut left: u64) {
    for &i in active {
        if parts[i] >= min {
            continue;
        }
        let need = min - parts[i];
        let from_left = need.min(left);
        left -= from_left;
        parts[i] += from_left;
        let need = need - from_left;
        if need == 0 {
            continue;
        }
        let donor = active
            .iter()
            .copied()
            .filter(|&j| j != i && parts[j] >= min.max(needs[j]).saturating_add(need))
            .max_by_key(|&j| (parts[j], std::cmp::Reverse(j)));
        if let Some(j) = donor {
            parts[j] -= need;
            parts[i] += need;
        }
    }
}

/// Parts per million of a capacity worth one whole token: ⌈10⁶ × 10⁶ / capacity⌉ for a
/// capacity in microtokens, [`PPM`] when the capacity is below one token, 0 for 0.
pub fn one_token_ppm(capacity_micros: u64) -> u32 {
    if capacity_micros == 0 {
        return 0;
    }
    let ppm = ppm_in_ceil(allot_common::units::MICROS_PER_TOKEN, capacity_micros);
    u32::try_from(ppm).unwrap_or(PPM).min(PPM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn everyone_gets_their_want_when_it_fits() {
        assert_eq!(fair_part(100, &[10, 20, 30], 1), 20);
    }

    #[test]
    fn scarce_pool_is_split_max_min() {
        // 40 tokens, six gateways wanting 40 each: 6 each (40/6 rounded down).
        let wants = [40; 6];
        let parts: Vec<u64> = (0..6).map(|i| fair_part(40, &wants, i)).collect();
        assert_eq!(parts, vec![6; 6]);
        // Small asks are met in full, the rest share what is left.
        assert_eq!(fair_part(30, &[2, 50, 50], 0), 2);
        assert_eq!(fair_part(30, &[2, 50, 50], 1), 14);
        assert!((0..3).map(|i| fair_part(30, &[2, 50, 50], i)).sum::<u64>() <= 30);
        assert_eq!(fair_part(0, &[5, 5], 0), 0);
    }

    fn claim(g: u32, d: Option<u32>, busy: bool) -> RegionClaim {
        RegionClaim {
            guarantee_ppm: g,
            demand_ppm: d,
            busy,
            hungry: false,
        }
    }

    #[test]
    fn idle_regions_leave_their_share_to_the_busy_by_weight() {
        // acme: eu-west and us-east 50 % each, only eu-west busy: it may use everything.
        let parts = region_parts(
            &[claim(500_000, None, true), claim(500_000, None, false)],
            0,
        );
        assert_eq!(parts, vec![1_000_000, 0]);
        // Story part c: 500/400/100, ap-south idle, both others unbounded: by weight 5:4.
        let parts = region_parts(
            &[
                claim(500_000, None, true),
                claim(400_000, None, true),
                claim(100_000, None, false),
            ],
            0,
        );
        assert_eq!(parts, vec![555_555, 444_444, 0]);
    }

    #[test]
    fn demand_caps_a_part_and_the_rest_goes_to_the_others() {
        // eu-west wants 650/s, us-east 300/s of 1000/s, ap-south idle: us-east is met, eu-west
        // gets the rest of its demand, and the spare 50 is split 5:4 as headroom.
        let parts = region_parts(
            &[
                claim(500_000, Some(650_000), true),
                claim(400_000, Some(300_000), true),
                claim(100_000, None, false),
            ],
            0,
        );
        assert_eq!(parts, vec![650_000 + 27_777, 300_000 + 22_222, 0]);
        // When eu-west uses all it has (hungry), the spare goes to it alone.
        let hungry_eu = RegionClaim {
            hungry: true,
            ..claim(500_000, Some(650_000), true)
        };
        let parts = region_parts(
            &[
                hungry_eu,
                claim(400_000, Some(300_000), true),
                claim(100_000, None, false),
            ],
            0,
        );
        assert_eq!(parts, vec![700_000, 300_000, 0]);
        // Everyone unbounded: exactly the shares (the guarantee is also the weight).
        let parts = region_parts(
            &[
                claim(500_000, None, true),
                claim(400_000, None, true),
                claim(100_000, None, true),
            ],
            0,
        );
        assert_eq!(parts, vec![500_000, 400_000, 100_000]);
    }

    #[test]
    fn a_busy_region_gets_at_least_its_guarantee_however_greedy_the_others() {
        // ap-south resumes at 100/s (its whole share) while the others want everything.
        let parts = region_parts(
            &[
                claim(500_000, None, true),
                claim(400_000, None, true),
                claim(100_000, Some(100_000), true),
            ],
            0,
        );
        assert!(parts[2] >= 100_000, "{parts:?}");
        assert!(parts.iter().map(|&p| u64::from(p)).sum::<u64>() <= u64::from(PPM));
        // Shares that add up to less than the whole: the rest still goes to the busy.
        let parts = region_parts(&[claim(100_000, None, true), claim(0, None, true)], 0);
        assert_eq!(parts, vec![1_000_000, 0], "share 0 still means nothing");
    }

    #[test]
    fn nothing_busy_or_nothing_shared_gives_nothing() {
        assert_eq!(region_parts(&[], 0), Vec::<u32>::new());
        assert_eq!(
            region_parts(&[claim(500_000, None, false), claim(0, Some(5), true)], 0),
            vec![0, 0]
        );
        // Zero demand from a busy region: it gets only the spare headroom by weight.
        assert_eq!(
            region_parts(
                &[claim(500_000, Some(0), true), claim(500_000, Some(0), true)],
                0
            ),
            vec![500_000, 500_000]
        );
    }

    #[test]
    fn a_busy_part_is_worth_at_least_one_whole_token() {
        // Burst 40: one token is 25 000 ppm. A 1 % region would get about 1.1 %, less than a
        // token: it is raised to one token from the largest part's headroom above its share.
        let min = one_token_ppm(40 * allot_common::units::MICROS_PER_TOKEN);
        assert_eq!(min, 25_000);
        let parts = region_parts(
            &[claim(900_000, None, true), claim(10_000, None, true)],
            min,
        );
        assert_eq!(parts, vec![975_000, 25_000]);
        // Never at the expense of another busy region's guarantee.
        let parts = region_parts(
            &[claim(990_000, None, true), claim(10_000, None, true)],
            min,
        );
        assert_eq!(parts, vec![990_000, 10_000]);
        // Extremes of the helper.
        assert_eq!(one_token_ppm(0), 0);
        assert_eq!(one_token_ppm(1), PPM);
        assert_eq!(one_token_ppm(u64::MAX), 1);
        assert_eq!(one_token_ppm(allot_common::units::MICROS_PER_TOKEN), PPM);
    }

    proptest::proptest! {
        #[test]
        fn parts_fit_the_whole_and_meet_every_busy_guarantee(
            raw in proptest::collection::vec(
                (
                    0u32..=1_000_000,
                    proptest::option::of(0u32..=1_200_000),
                    proptest::bool::ANY,
                    proptest::bool::ANY,
                ),
                0..6,
            ),
            min_part in 0u32..=60_000,
        ) {
            // Shares are validated to add up to at most 100 %.
            let mut total = 0u32;
            let claims: Vec<RegionClaim> = raw
                .into_iter()
                .map(|(g, d, busy, hungry)| {
                    let g = g.min(PPM - total);
                    total += g;
                    RegionClaim { hungry, ..claim(g, d, busy) }
                })
                .collect();
            let parts = region_parts(&claims, min_part);
            proptest::prop_assert_eq!(parts.len(), claims.len());
            let sum: u64 = parts.iter().map(|&p| u64::from(p)).sum();
            proptest::prop_assert!(sum <= u64::from(PPM), "{:?} -> {:?}", claims, parts);
            for (c, &p) in claims.iter().zip(&parts) {
                if !c.busy || c.guarantee_ppm == 0 {
                    proptest::prop_assert_eq!(p, 0);
                } else {
                    let need = c.demand_ppm.unwrap_or(PPM).min(c.guarantee_ppm);
                    proptest::prop_assert!(p >= need, "{:?} got {} < {}", c, p, need);
                }
            }
        }
    }
}
