//! An idle holder returns unspent tokens early (issue 9 item 6): a leased key that decided
//! nothing for `idle_return_ms` has its allocations closed and released with their final spend
//! at the next maintenance pass, so the allocator can grant the rest elsewhere before expiry.

use crate::support::*;
use allot_agent::lease::{AllocatorLink, HeldAllocation, LeaseBook, LeaseManager, LeaseSettings};
use allot_agent::Enforcer;
use allot_common::clock::ManualClock;
use allot_common::config::ConfigSet;
use allot_common::limiter::Code;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// One leased key (`tenant=idle`) holding a 5-token allocation with a 60 s deadline, one token
/// spent, on a manual clock; maintenance is run by hand. `idle_return_ms` as given.
struct Idle {
    clock: ManualClock,
    enforcer: Enforcer,
    manager: LeaseManager,
    fake: FakeAllocator,
    held: Arc<HeldAllocation>,
    _server: tokio::task::JoinHandle<()>,
}

async fn idle_rig(idle_return_ms: u64) -> Idle {
    let fake = FakeAllocator::new(1_000, 60_000);
    fake.serve_batch.store(true, Ordering::SeqCst);
    let (addr, server) = fake.serve().await;
    let clock = ManualClock::new(1_000 * S);
    let (tx, _events) = tokio::sync::mpsc::unbounded_channel();
    let mut settings = LeaseSettings::new("gw", "eu");
    settings.promote_tokens = 0;
    settings.idle_return_ms = idle_return_ms;
    let book = Arc::new(LeaseBook::new(Arc::new(clock.clone()), settings, tx));
    let config = ConfigSet::from_yaml(TENANT, Path::new("p.yaml")).unwrap();
    let enforcer = Enforcer::new(config, book.clone());
    let link = AllocatorLink::new(&[addr.to_string()], Duration::from_secs(5)).unwrap();
    let manager = LeaseManager::new(book.clone(), Arc::new(link));
    tenant_request!(req, "idle", None);
    let mut st = Vec::new();
    enforcer.decide_now(&req, &mut st).unwrap();
    let kl = book
        .existing("api", 0, req.descriptors[0].entries)
        .expect("seen");
    let held = Arc::new(HeldAllocation::new(7, 7, 5 * T, 1_060 * S, 0, 1));
    kl.value.protocol.install(held.clone());
    assert_eq!(enforcer.decide_now(&req, &mut st).unwrap().code, Code::Ok);
    Idle {
        clock,
        enforcer,
        manager,
        fake,
        held,
        _server: server,
    }
}

impl Idle {
    fn decide(&self) -> Code {
        tenant_request!(req, "idle", None);
        let mut st = Vec::new();
        self.enforcer.decide_now(&req, &mut st).unwrap().code
    }
}

/// Busy within `idle_return_ms`: reported, kept. Idle for `idle_return_ms`: closed and
/// released with its final spend (one token), and no later spend can succeed from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_key_releases_its_unspent_allocation_early() {
    let r = idle_rig(1_000).await;
    r.clock.advance(999 * MS);
    r.manager.maintain().await;
    assert_eq!(r.fake.releases.load(Ordering::SeqCst), 0, "not idle yet");
    assert_eq!(r.fake.reports.load(Ordering::SeqCst), 1);
    assert_eq!(r.held.reported(), T);
    assert!(!r.held.is_closed());
    r.clock.advance(MS);
    r.manager.maintain().await;
    assert_eq!(r.fake.releases.load(Ordering::SeqCst), 1);
    assert_eq!(r.fake.released_spend.load(Ordering::SeqCst), T);
    assert!(r.held.is_closed());
    assert!(!r.held.try_spend(T, 1_001 * S), "closed: nothing more");
    // The key holds nothing now: the next request waits for a fresh allocation instead.
    assert_eq!(r.decide(), Code::OverLimit);
    r.manager.maintain().await;
    assert_eq!(r.fake.releases.load(Ordering::SeqCst), 1, "released once");
}

/// A key in use keeps its allocation however long it lives, and `idle_return_ms: 0` never
/// returns early: the allocation is kept until spent or past its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_key_or_a_disabled_setting_keeps_the_allocation() {
    let busy = idle_rig(1_000).await;
    for _ in 0..3 {
        busy.clock.advance(600 * MS);
        assert_eq!(busy.decide(), Code::Ok);
        busy.manager.maintain().await;
    }
    assert_eq!(busy.fake.releases.load(Ordering::SeqCst), 0);
    assert_eq!(busy.held.reported(), 4 * T);
    let off = idle_rig(0).await;
    off.clock.advance(30 * S);
    off.manager.maintain().await;
    assert_eq!(off.fake.releases.load(Ordering::SeqCst), 0);
    assert!(!off.held.is_closed());
}
