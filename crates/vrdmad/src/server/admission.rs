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
//! A tenant stays admitted while it has a session, or while a mapping
//! made for it still lives (one that something still holds after its
//! context closed): only then is its room really free for another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use vrdma_core::hca::TenantId;
use vrdma_shm::MappingBudget;

/// An admitted tenant: its sessions and its budget.
struct Entry {
    sessions: usize,
    budget: Arc<MappingBudget>,
}

#[derive(Default)]
struct Table {
    admitted: HashMap<TenantId, Entry>,
}

impl Table {
    /// Forgets tenants that have neither sessions nor mappings.
    fn purge(&mut self) {
        self.admitted.retain(|_, e| e.sessions > 0 || e.budget.live() > 0);
    }
}

pub(crate) struct Admission {
    max_tenants: usize,
    table: Arc<Mutex<Table>>,
}

/// Why a tenant was not admitted.
#[derive(Debug, thiserror::Error)]
#[error(
    "the daemon serves its limit of {max_tenants} tenants at once (max_tenants), so that each can reach its \
     quota; try again once another tenant has closed its contexts"
)]
pub(crate) struct Full {
    pub max_tenants: usize,
}

/// A session's hold on its tenant's admission. Dropping it (after the
/// session's context is closed) lets the tenant go once nothing of it is
/// left.
pub(crate) struct Admitted {
    table: Arc<Mutex<Table>>,
    tenant: TenantId,
    budget: Arc<MappingBudget>,
}

impl Admitted {
    /// The budget every mapping made for this tenant is charged to.
    pub fn budget(&self) -> &Arc<MappingBudget> {
        &self.budget
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = t.admitted.get_mut(&self.tenant) {
            e.sessions = e.sessions.saturating_sub(1);
        }
        t.purge();
    }
}

impl Admission {
    pub fn new(max_tenants: u32) -> Admission {
        Admission { max_tenants: max_tenants as usize, table: Arc::default() }
    }

    /// Admits a session of `tenant`, whose quota allows `max_mappings`: at
    /// once if the tenant is already admitted (its budget is the one its
    /// other sessions share), else if fewer than `max_tenants` are.
    pub fn admit(&self, tenant: TenantId, max_mappings: u32) -> Result<Admitted, Full> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if !t.admitted.contains_key(&tenant) {
            t.purge();
            if t.admitted.len() >= self.max_tenants {
                return Err(Full { max_tenants: self.max_tenants });
            }
        }
        let e = t
            .admitted
            .entry(tenant)
            .or_insert_with(|| Entry { sessions: 0, budget: MappingBudget::new(max_mappings as usize) });
        e.sessions += 1;
        Ok(Admitted { table: self.table.clone(), tenant, budget: e.budget.clone() })
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
        let one = a.admit(TenantId(1), 3).unwrap();
        let one_again = a.admit(TenantId(1), 3).unwrap();
        assert!(Arc::ptr_eq(one.budget(), one_again.budget()), "a tenant's sessions share its budget");
        let two = a.admit(TenantId(2), 3).unwrap();
        let refused = a.admit(TenantId(3), 3).err().expect("a third tenant is refused");
        assert!(refused.to_string().contains("limit of 2 tenants"), "{refused}");
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
        assert!(a.admit(TenantId(3), 3).is_err());
        // One whose sessions are gone but whose mappings live on, too.
        drop(one_again);
        assert_eq!(a.admitted(), 2);
        assert!(a.admit(TenantId(3), 3).is_err());
        held.drain(..3);
        let three = a.admit(TenantId(3), 3).unwrap();
        assert_eq!(three.budget().live(), 0);
        assert_eq!(a.admitted(), 2);
        // A tenant that comes back gets a fresh budget of its own quota.
        drop(held);
        drop(two);
        assert_eq!(a.admitted(), 1);
        let one = a.admit(TenantId(1), 5).unwrap();
        assert_eq!(one.budget().limit(), 5);
    }
}
