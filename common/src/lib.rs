//! # allot-common: Allot's decision core
//!
//! One implementation of every admission decision, used by `allotctl replay`, the gateway agent
//! and the allocator:
//!
//! * [`units`]: fixed-point microtokens and integer nanoseconds (design §10 "Units and time");
//! * [`clock`]: injected time, real and manual (design §10 "Units and time");
//! * [`algorithm`]: token bucket, GCRA, fixed window, sliding-window counter, sliding log, and the
//!   leaky-bucket shaper (design §10 "Algorithms"), exact and overflow-free;
//! * [`config`]: the envoyproxy/ratelimit YAML with Allot's additions, validated (design §10
//!   "Config versions");
//! * [`descriptor`]: requests and injective canonical keys with bounded sizes (design §10 "Keys");
//! * [`keyed`]: per-key state with a cap on keys and idle eviction (design §10 "Keys"), each
//!   key's state in a [`cell`] decided with one compare-and-swap where it packs;
//! * [`limiter`]: all-or-nothing multi-descriptor decisions, shadow mode, config transitions;
//! * [`concurrency`]: in-flight limits (design §10 "Concurrency"); [`direct`]: a single-key
//!   limiter;
//! * [`name`]: map keys compared inline on the decision path;
//! * [`global`]: the seam through which an agent decides `scope: global` rules from leases;
//! * [`process`]: off the decision path, a daemon's ready file and (feature `signal`) its stop
//!   signal, shared by the agent and the allocator.
//!
//! No I/O, no async runtime, no floating point on the decision path.

#![warn(missing_docs)]

pub mod algorithm;
pub mod cell;
pub mod clock;
pub mod concurrency;
pub mod config;
pub mod decision;
pub mod descriptor;
pub mod direct;
pub mod global;
pub mod keyed;
pub mod limiter;
pub mod name;
pub mod process;
pub mod units;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use decision::{Decision, RetryAfter};
pub use limiter::{Code, DescriptorStatus, Limiter, Outcome, Reason};
