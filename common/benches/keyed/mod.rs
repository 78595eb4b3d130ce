//! The keyed case shared by the `decision` and `instructions` benches: 10,000 tenants, one rule
//! `key: tenant` at 10^9/s in domain `bench`, requests built once before measuring.

use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request};
use std::path::Path;

/// Distinct keys of the keyed case.
pub const KEYS: usize = 10_000;

/// The tenants' names, `tenant-00000` to `tenant-09999`.
pub fn values() -> Vec<String> {
    (0..KEYS).map(|i| format!("tenant-{i:05}")).collect()
}

/// One entry `tenant=<value>` per value.
pub fn entries(values: &[String]) -> Vec<[Entry<'_>; 1]> {
    values
        .iter()
        .map(|v| {
            [Entry {
                key: "tenant",
                value: v,
            }]
        })
        .collect()
}

/// One descriptor per entry, cost 1.
pub fn descriptors<'a>(entries: &'a [[Entry<'a>; 1]]) -> Vec<[Descriptor<'a>; 1]> {
    entries
        .iter()
        .map(|e| {
            [Descriptor {
                entries: e,
                hits_addend: None,
            }]
        })
        .collect()
}

/// One request of domain `bench` per descriptor.
pub fn requests<'a>(descriptors: &'a [[Descriptor<'a>; 1]]) -> Vec<Request<'a>> {
    descriptors
        .iter()
        .map(|d| Request {
            domain: "bench",
            descriptors: d,
            hits_addend: None,
        })
        .collect()
}

/// The one-rule config of the keyed case with `algorithm` (`token_bucket` or `gcra`).
pub fn config(algorithm: &str) -> ConfigSet {
    let yaml = format!(
        "domain: bench\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: second\n      \
         requests_per_unit: 1000000000\n      algorithm: {algorithm}\n      max_keys: 100000\n"
    );
    ConfigSet::from_yaml(&yaml, Path::new("bench.yaml")).expect("bench config")
}
