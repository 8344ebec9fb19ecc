//! A migration snapshot comes from another host's daemon: decoded, and
//! imported into a device with a live link, resumed, and its frames
//! polled. Nothing may panic; a decoded snapshot re-encodes to an equal
//! one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_core::hca::migrate::TenantSnapshot;
use vrdma_core::hca::{
    AsyncEvent, ContextId, CqFull, Hca, HcaConfig, KeySource, LinkInfo, Pulled, Queues, RecvSource, TenantId,
};
use vrdma_core::memory::Region;
use vrdma_core::ring::{Cqe, RecvWr, SendWr};
use vrdma_core::time::Instant;
use vrdma_core::verbs::{Gid, QpState};

struct Keys(u32);

impl KeySource for Keys {
    fn next_key(&mut self) -> u32 {
        self.0 += 1;
        self.0
    }
}

/// Queues with nothing posted, that take every completion.
struct Empty;

impl Queues for Empty {
    fn pull_send(&mut self, _: u32) -> Option<Pulled<SendWr>> {
        None
    }
    fn send_retired(&mut self, _: u32, _: u32) {}
    fn pull_recv(&mut self, _: RecvSource) -> Option<Pulled<RecvWr>> {
        None
    }
    fn recv_posted(&mut self, _: RecvSource) -> u32 {
        0
    }
    fn discard(&mut self, _: u32) {}
    fn push_cqe(&mut self, _: u32, _: &Cqe) -> Result<(), CqFull> {
        Ok(())
    }
    fn async_event(&mut self, _: ContextId, _: AsyncEvent) {}
    fn qp_state_changed(&mut self, _: u32, _: QpState) {}
    fn take_posted(&mut self, _: u32, _: &mut Vec<u32>) -> bool {
        false
    }
    fn park_queues(&mut self, _: u32, _: bool) -> bool {
        true
    }
    fn named_since_parked(&mut self, _: u32) -> bool {
        false
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = TenantSnapshot::decode(data) {
        assert_eq!(TenantSnapshot::decode(&s.encode()).as_ref(), Ok(&s));
    }
    let mut hca = Hca::new(HcaConfig::for_host([10, 0, 0, 3]), Box::new(Keys(0x30000)));
    // Links to the hosts a snapshot most likely names.
    let mut links = Vec::new();
    for ip in [[10, 0, 0, 1], [10, 0, 0, 2]] {
        links.push(hca.link_up(LinkInfo {
            gid: Gid::from_ipv4(ip),
            lid: u16::from(ip[3]),
            chunk: 256,
            verified: true,
        }));
    }
    let mut region_of =
        |m: &vrdma_core::hca::migrate::MrImport| (m.len <= 1 << 20).then(|| Region::heap(m.len as usize));
    let now = Instant(1_000_000);
    let Ok(tenant) = hca.import_tenant(data, now, &mut region_of) else { return };
    assert_eq!(tenant, TenantId(tenant.0));
    let _ = hca.resume_tenant(tenant, now);
    let mut io = Empty;
    for i in 0..8u64 {
        let t = Instant(now.0 + i * 50_000_000);
        hca.process(t, &mut io);
        for &l in &links {
            for _ in 0..8 {
                if hca.poll_transmit(l, t, &mut io).is_none() {
                    break;
                }
            }
        }
    }
});
