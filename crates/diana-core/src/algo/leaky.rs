//! placeholder
use super::{Algorithm, Limit, Verdict};
use crate::time::{Nanos, Unit};
use std::num::NonZeroU32;

#[derive(Debug)]
pub struct LeakyBucket;

impl Algorithm for LeakyBucket {
    fn code(&self) -> &'static str { "LeakyBucket" }
    fn aliases(&self) -> &'static [&'static str] { &[] }
    fn default_burst(&self, rpu: NonZeroU32, _unit: Unit) -> NonZeroU32 { rpu }
    fn state_words(&self, _limit: &Limit) -> usize { 2 }
    fn acquire(&self, _limit: &Limit, _state: &mut [u64], _now: Nanos, _want: u32) -> Verdict { Verdict::default() }
    fn is_idle(&self, _limit: &Limit, _state: &[u64], _now: Nanos) -> bool { true }
}
