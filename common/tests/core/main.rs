//! Integration tests of the decision core (issue 2, "Tests"; design §10 "Algorithms" and "Config
//! versions").
//!
//! One test binary with modules. Every test drives time explicitly (a `now` argument or a
//! [`ManualClock`](allot_common::ManualClock)); none sleeps. Every test asserts exact numbers.

mod concurrency;
mod limiter;
mod packed;
mod properties;
mod robustness;
mod seed30;
mod shaper;
mod support;
mod transitions;
