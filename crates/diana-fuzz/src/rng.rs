//! A small deterministic generator (SplitMix64): every case is generated from
//! `(seed, target, case number)` alone, so any case can be generated again to replay it.

/// SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng(u64);

/// Mixes one value into a seed (the SplitMix64 finaliser).
pub fn mix(seed: u64, value: u64) -> u64 {
    let mut z = seed ^ value.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The generator of case `case` of target `target` in a run seeded `seed`.
    pub fn for_case(seed: u64, target: u64, case: u64) -> Rng {
        Rng(mix(mix(seed, target), case))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0, 0)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Uniform in `0..n` as a `usize`.
    pub fn index(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).unwrap_or(0)
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    /// One of `items` (`None` when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        let at = self.index(items.len());
        items.get(at)
    }

    /// A number that often sits on a boundary: 0, 1, powers of two and their neighbours,
    /// the ends of `u32` and `u64`, or anything.
    pub fn interesting_u64(&mut self) -> u64 {
        match self.below(6) {
            0 => self.below(4),
            1 => (1u64 << self.below(64))
                .wrapping_add(self.below(3))
                .wrapping_sub(1),
            2 => u64::from(u32::MAX)
                .wrapping_add(self.below(3))
                .wrapping_sub(1),
            3 => u64::MAX - self.below(2),
            4 => self.below(1_000),
            _ => self.next_u64(),
        }
    }
}
