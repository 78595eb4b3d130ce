//! Max-min fair division of scarce quota among holders (as Doorman's FairShare): when the asks
//! exceed what is available, each holder gets at most an equal part, and what holders asking
//! less leave over is split among the rest. One early gateway cannot take the whole burst while
//! the others are refused.

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
}
