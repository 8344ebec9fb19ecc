//! Which tenants the daemon serves at once, and each one's share of the
//! daemon's memory mappings.
//!
//! The daemon's mappings are one budget for every tenant (`max_mappings`,
//! below the kernel's `vm.max_map_count`). Were they first come, first
//! served, a few tenants registering small regions within their quotas
//! would spend it, and every other tenant would be refused even a
//! context. So a tenant is admitted (at its first Hello) only while fewer
//! than `max_tenants` tenants are, and each admitted tenant's mappings are
//! charged to a [`MappingBudget`] of its quota's size. The configuration
//! is checked at load so that the `max_tenants` largest quotas fit in the
//! budget together (`config::DaemonConfig::budgets_within`): whatever the
//! others hold, an admitted tenant can reach its own quota.
//!
//! The daemon's file descriptors are shared the same way: each admitted
//! tenant may hold its quota's `max_descriptors` (by default its share of
//! the open-file limit, less the daemon's own), counted here: a context
//! takes [`DESCRIPTORS_PER_CONTEXT`] (its connection, doorbells, and what
//! a request may carry), a completion channel one, and each descriptor the
//! direct path keeps for it (a region's memfd, a QP segment with an
//! inbox, a window page: [`KeptDescriptor`]) one. The direct path's are
//! not an error when refused: the object is simply not granted, and its
//! work requests take the engine path.
//!
//! A tenant stays admitted while it has a session, or while a mapping
//! made for it still lives (one that something still holds after its
//! context closed): only then is its room really free for another.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use vrdma_core::hca::TenantId;
use vrdma_shm::MappingBudget;

pub(crate) use crate::config::DESCRIPTORS_PER_CONTEXT;

/// An admitted tenant: its sessions, its mappings' budget, and the
/// descriptors its sessions hold.
struct Entry {
    sessions: usize,
    budget: Arc<MappingBudget>,
    descriptors: usize,
    max_descriptors: usize,
    /// Descriptors the direct path keeps for the tenant, counted by the
    /// [`KeptDescriptor`]s that hold them (they live on the engine thread
    /// and go with the objects, not with a session).
    kept: Arc<AtomicUsize>,
}

impl Entry {
    fn charge(&mut self, n: usize) -> Result<(), Refused> {
        if self.descriptors + self.kept.load(Ordering::SeqCst) + n > self.max_descriptors {
            return Err(Refused::Descriptors { limit: self.max_descriptors });
        }
        self.descriptors += n;
        Ok(())
    }
}

#[derive(Default)]
struct Table {
    admitted: HashMap<TenantId, Entry>,
}

impl Table {
    /// Forgets tenants that have neither sessions nor mappings.
    fn purge(&mut self) {
        self.admitted
            .retain(|_, e| e.sessions > 0 || e.budget.live() > 0 || e.kept.load(Ordering::SeqCst) > 0);
    }
}

pub(crate) struct Admission {
    max_tenants: usize,
    table: Arc<Mutex<Table>>,
    /// Refusals so far, for the metrics: tenants over `max_tenants`, and
    /// contexts or channels over a tenant's descriptors.
    pub refused_full: Arc<AtomicU64>,
    pub refused_descriptors: Arc<AtomicU64>,
}

/// Why a context or a completion channel was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    #[error(
        "the daemon serves its limit of {max_tenants} tenants at once (max_tenants), so that each can reach \
         its quota; try again once another tenant has closed its contexts"
    )]
    Full { max_tenants: usize },
    #[error(
        "this tenant holds its share of {limit} file descriptors in the daemon (max_descriptors: a context \
         takes {DESCRIPTORS_PER_CONTEXT}, a completion channel 1)"
    )]
    Descriptors { limit: usize },
}

impl Refused {
    /// The errno the client sees.
    pub fn errno(&self) -> i32 {
        match self {
            Refused::Full { .. } => libc::EUSERS,
            Refused::Descriptors { .. } => libc::EMFILE,
        }
    }
}

/// A session's hold on its tenant's admission. Dropping it (after the
/// session's context is closed) lets the tenant go once nothing of it is
/// left.
pub(crate) struct Admitted {
    table: Arc<Mutex<Table>>,
    refused_descriptors: Arc<AtomicU64>,
    tenant: TenantId,
    budget: Arc<MappingBudget>,
    /// Descriptors this session holds, charged to the tenant.
    descriptors: usize,
}

impl Admitted {
    /// The budget every mapping made for this tenant is charged to.
    pub fn budget(&self) -> &Arc<MappingBudget> {
        &self.budget
    }

    /// Charges one more descriptor (a completion channel's) to the tenant,
    /// or refuses if it holds its share.
    pub fn charge_descriptor(&mut self) -> Result<(), Refused> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let e = t.admitted.get_mut(&self.tenant).expect("an admitted tenant stays while it has sessions");
        e.charge(1).inspect_err(|_| {
            self.refused_descriptors.fetch_add(1, Ordering::Relaxed);
        })?;
        self.descriptors += 1;
        Ok(())
    }

    /// Charges one descriptor the direct path keeps for this tenant, or
    /// `None` if it holds its share (the direct path then does without:
    /// not an error). Given back when the returned charge is dropped.
    pub fn charge_kept(&self) -> Option<KeptDescriptor> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let e = t.admitted.get_mut(&self.tenant)?;
        if e.descriptors + e.kept.load(Ordering::SeqCst) >= e.max_descriptors {
            return None;
        }
        e.kept.fetch_add(1, Ordering::SeqCst);
        Some(KeptDescriptor { count: e.kept.clone() })
    }

    /// Gives back what [`charge_descriptor`](Self::charge_descriptor) took.
    pub fn refund_descriptor(&mut self) {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = t.admitted.get_mut(&self.tenant) {
            e.descriptors = e.descriptors.saturating_sub(1);
        }
        self.descriptors = self.descriptors.saturating_sub(1);
    }
}

/// One descriptor the direct path keeps, charged to its tenant until
/// dropped (with the object that holds the descriptor).
#[derive(Debug)]
pub struct KeptDescriptor {
    count: Arc<AtomicUsize>,
}

#[cfg(test)]
impl KeptDescriptor {
    /// A charge counted nowhere, for tests of what holds one.
    pub fn for_test() -> KeptDescriptor {
        KeptDescriptor { count: Arc::new(AtomicUsize::new(1)) }
    }
}

impl Drop for KeptDescriptor {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = t.admitted.get_mut(&self.tenant) {
            e.sessions = e.sessions.saturating_sub(1);
            e.descriptors = e.descriptors.saturating_sub(self.descriptors);
        }
        t.purge();
    }
}

impl Admission {
    pub fn new(max_tenants: u32) -> Admission {
        Admission {
            max_tenants: max_tenants as usize,
            table: Arc::default(),
            refused_full: Arc::default(),
            refused_descriptors: Arc::default(),
        }
    }

    /// Admits a session of `tenant`, whose quota allows `max_mappings`
    /// and `max_descriptors`, charging it a context's descriptors: at once
    /// if the tenant is already admitted (its budget is the one its other
    /// sessions share), else if fewer than `max_tenants` are.
    pub fn admit(
        &self,
        tenant: TenantId,
        max_mappings: u32,
        max_descriptors: u32,
    ) -> Result<Admitted, Refused> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if !t.admitted.contains_key(&tenant) {
            t.purge();
            if t.admitted.len() >= self.max_tenants {
                self.refused_full.fetch_add(1, Ordering::Relaxed);
                return Err(Refused::Full { max_tenants: self.max_tenants });
            }
        }
        let e = t.admitted.entry(tenant).or_insert_with(|| Entry {
            sessions: 0,
            budget: MappingBudget::new(max_mappings as usize),
            descriptors: 0,
            max_descriptors: max_descriptors as usize,
            kept: Arc::default(),
        });
        let charged = e.charge(DESCRIPTORS_PER_CONTEXT as usize);
        if let Err(refused) = charged {
            self.refused_descriptors.fetch_add(1, Ordering::Relaxed);
            t.purge();
            return Err(refused);
        }
        e.sessions += 1;
        Ok(Admitted {
            table: self.table.clone(),
            refused_descriptors: self.refused_descriptors.clone(),
            tenant,
            budget: e.budget.clone(),
            descriptors: DESCRIPTORS_PER_CONTEXT as usize,
        })
    }

    /// Tenants admitted now.
    #[cfg(test)]
    fn admitted(&self) -> usize {
        self.table.lock().unwrap().admitted.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_shm::Segment;

    #[test]
    fn at_most_max_tenants_are_admitted_and_each_has_its_own_budget() {
        let a = Admission::new(2);
        let one = a.admit(TenantId(1), 3, 100).unwrap();
        let one_again = a.admit(TenantId(1), 3, 100).unwrap();
        assert!(Arc::ptr_eq(one.budget(), one_again.budget()), "a tenant's sessions share its budget");
        let two = a.admit(TenantId(2), 3, 100).unwrap();
        let refused = a.admit(TenantId(3), 3, 100).err().expect("a third tenant is refused");
        assert!(refused.to_string().contains("limit of 2 tenants"), "{refused}");
        assert_eq!(a.refused_full.load(Ordering::Relaxed), 1, "counted for the metrics");
        // One tenant filling its budget leaves the other's whole.
        let mut held = Vec::new();
        while let Ok(s) = Segment::create_in("vrdma-test", 4096, Some(one.budget())) {
            held.push(s);
            assert!(held.len() <= 3);
        }
        assert_eq!((one.budget().live(), two.budget().live()), (3, 0));
        for _ in 0..3 {
            held.push(Segment::create_in("vrdma-test", 4096, Some(two.budget())).unwrap());
        }
        // A tenant with a session left stays admitted.
        drop(one);
        assert!(a.admit(TenantId(3), 3, 100).is_err());
        // One whose sessions are gone but whose mappings live on, too.
        drop(one_again);
        assert_eq!(a.admitted(), 2);
        assert!(a.admit(TenantId(3), 3, 100).is_err());
        held.drain(..3);
        let three = a.admit(TenantId(3), 3, 100).unwrap();
        assert_eq!(three.budget().live(), 0);
        assert_eq!(a.admitted(), 2);
        // A tenant that comes back gets a fresh budget of its own quota.
        drop(held);
        drop(two);
        assert_eq!(a.admitted(), 1);
        let one = a.admit(TenantId(1), 5, 100).unwrap();
        assert_eq!(one.budget().limit(), 5);
    }

    #[test]
    fn a_tenants_descriptors_are_bounded_across_its_sessions() {
        let per = DESCRIPTORS_PER_CONTEXT as usize;
        let a = Admission::new(2);
        // Room for two contexts and three channels.
        let limit = (2 * per + 3) as u32;
        let mut one = a.admit(TenantId(1), 10, limit).unwrap();
        let mut two = a.admit(TenantId(1), 10, limit).unwrap();
        for _ in 0..3 {
            one.charge_descriptor().unwrap();
        }
        let e = two.charge_descriptor().unwrap_err();
        assert_eq!(e.errno(), libc::EMFILE);
        assert!(e.to_string().contains(&format!("share of {limit} file descriptors")), "{e}");
        let e = a.admit(TenantId(1), 10, limit).err().expect("no room for a third context");
        assert!(matches!(e, Refused::Descriptors { .. }), "{e}");
        // Another tenant's are its own.
        let other = a.admit(TenantId(2), 10, (per + 1) as u32).unwrap();
        // A channel given back, or a session gone with its channels, makes
        // room again.
        one.refund_descriptor();
        two.charge_descriptor().unwrap();
        drop(one);
        for _ in 0..per + 2 {
            two.charge_descriptor().unwrap();
        }
        assert!(two.charge_descriptor().is_err());
        drop(two);
        // Nothing is left charged once every session has gone.
        let again = a.admit(TenantId(1), 10, limit).unwrap();
        assert_eq!(a.table.lock().unwrap().admitted[&TenantId(1)].descriptors, per);
        drop((again, other));
        assert_eq!(a.admitted(), 0);
    }

    #[test]
    fn descriptors_the_direct_path_keeps_share_the_tenants_limit() {
        let per = DESCRIPTORS_PER_CONTEXT as usize;
        let a = Admission::new(2);
        let mut one = a.admit(TenantId(1), 10, (per + 3) as u32).unwrap();
        let kept: Vec<_> = (0..3).map(|_| one.charge_kept().expect("room for three")).collect();
        assert!(one.charge_kept().is_none(), "refused at the limit, without an error");
        assert!(one.charge_descriptor().is_err(), "a channel counts against the same share");
        drop(kept);
        one.charge_descriptor().unwrap();
        let k = one.charge_kept().unwrap();
        // A tenant whose sessions are gone stays while the direct path
        // holds a descriptor for it, and goes with the last one.
        drop(one);
        assert_eq!(a.admitted(), 1);
        drop(k);
        let again = a.admit(TenantId(1), 10, (per + 3) as u32).unwrap();
        assert_eq!(a.table.lock().unwrap().admitted[&TenantId(1)].kept.load(Ordering::SeqCst), 0);
        drop(again);
    }
}
