//! Key popularity for load generation: a seeded Zipf(s) distribution over N keys (rank k, from
//! 1, drawn with probability ∝ 1/kˢ), so a run with many tenants has a hot head and a long tail
//! and is reproducible from its seed. Floating point is used here only to shape the *offered*
//! load; no admission decision depends on it.

use anyhow::{bail, Result};

/// A small, fast, seeded generator (SplitMix64): the same seed gives the same key sequence.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s) over keys `0..n` (index 0 is rank 1, the most popular).
#[derive(Debug, Clone)]
pub struct Zipf {
    /// Cumulative probability up to and including each index; the last is 1.
    cdf: Vec<f64>,
}

impl Zipf {
    /// The distribution over `n` keys with exponent `s`.
    ///
    /// # Errors
    /// `n` is 0, or `s` is not a finite number ≥ 0 (0 is uniform).
    pub fn new(n: u32, s: f64) -> Result<Zipf> {
        if n == 0 {
            bail!("a Zipf distribution needs at least one key");
        }
        if !s.is_finite() || s < 0.0 {
            bail!("the Zipf exponent must be a finite number ≥ 0 (got {s})");
        }
        let mut cdf = Vec::with_capacity(n as usize);
        let mut total = 0.0;
        for k in 1..=n {
            total += 1.0 / f64::from(k).powf(s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Ok(Zipf { cdf })
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.cdf.len()
    }

    /// Always false: a distribution has at least one key.
    pub fn is_empty(&self) -> bool {
        self.cdf.is_empty()
    }

    /// Probability of key `i` (0 past the last key).
    pub fn probability(&self, i: usize) -> f64 {
        match i {
            0 => self.cdf.first().copied().unwrap_or(0.0),
            _ if i < self.cdf.len() => self.cdf[i] - self.cdf[i - 1],
            _ => 0.0,
        }
    }

    /// A key index drawn with `rng`.
    pub fn sample(&self, rng: &mut SplitMix64) -> usize {
        let u = rng.next_unit();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_keys() {
        let z = Zipf::new(1000, 1.1).expect("valid");
        let draw = |seed| {
            let mut r = SplitMix64::new(seed);
            (0..100).map(|_| z.sample(&mut r)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn ranks_are_drawn_in_proportion_to_one_over_k_to_the_s() {
        let z = Zipf::new(10_000, 1.1).expect("valid");
        let mut r = SplitMix64::new(1);
        let mut counts = vec![0u32; z.len()];
        let draws = 200_000;
        for _ in 0..draws {
            counts[z.sample(&mut r)] += 1;
        }
        // Rank 1 over rank 2 is 2^1.1 ≈ 2.14 in expectation.
        let ratio = f64::from(counts[0]) / f64::from(counts[1]);
        assert!((1.9..2.4).contains(&ratio), "rank 1 / rank 2 = {ratio}");
        let expected = z.probability(0) * f64::from(draws);
        let got = f64::from(counts[0]);
        assert!(
            (got - expected).abs() < 0.05 * expected,
            "{got} vs {expected}"
        );
        // Every draw is a valid index, and the tail is reached.
        assert!(counts[5_000..].iter().any(|&c| c > 0));
    }

    #[test]
    fn extremes_are_valid_or_refused() {
        let one = Zipf::new(1, 1.1).expect("one key");
        let mut r = SplitMix64::new(u64::MAX);
        assert!((0..100).all(|_| one.sample(&mut r) == 0));
        assert_eq!(one.probability(0), 1.0);
        assert_eq!(one.probability(1), 0.0);
        let uniform = Zipf::new(4, 0.0).expect("s = 0 is uniform");
        assert!((uniform.probability(3) - 0.25).abs() < 1e-12);
        assert!(Zipf::new(0, 1.1).is_err());
        assert!(Zipf::new(10, -1.0).is_err());
        assert!(Zipf::new(10, f64::NAN).is_err());
        assert!(Zipf::new(10, f64::INFINITY).is_err());
        let huge = Zipf::new(u32::from(u16::MAX), 50.0).expect("steep");
        let mut r = SplitMix64::new(0);
        assert!((0..100).all(|_| huge.sample(&mut r) < huge.len()));
    }
}
