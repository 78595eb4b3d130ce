//! Runs the strategy table: every strategy on every workload with one seed, the same fault
//! schedule and network, measured against the same contracts.

use super::measure::{measure, Measured};
use super::{contracts, Strategy, PARTITION_MS};
use crate::sim::run;
use crate::sim::workload::Workload;
use anyhow::Result;

/// One cell of the table: a strategy's run of a workload.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The strategy.
    pub strategy: Strategy,
    /// The workload.
    pub workload: Workload,
    /// What was measured.
    pub measured: Measured,
    /// The run's trace hash (equal hashes: the same run).
    pub trace_hash: u64,
}

/// Runs `strategies` on `workloads` with `seed`, reporting progress through `progress`.
///
/// # Errors
/// A run could not be set up (data directory, policy).
pub fn compare(
    seed: u64,
    workloads: &[Workload],
    strategies: &[Strategy],
    mut progress: impl FnMut(&Cell),
) -> Result<Vec<Cell>> {
    let mut cells = Vec::new();
    for &workload in workloads {
        let contracts = contracts(workload);
        for &strategy in strategies {
            let r = run(seed, &strategy.config(workload))?;
            let cell = Cell {
                strategy,
                workload,
                measured: measure(&r, &contracts, PARTITION_MS),
                trace_hash: r.trace_hash,
            };
            progress(&cell);
            cells.push(cell);
        }
    }
    Ok(cells)
}
