//! The engine decodes every work-queue slot a tenant writes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_core::ring::{RecvWr, SendWr};

fuzz_target!(|data: &[u8]| {
    if let Ok(wr) = SendWr::decode(data) {
        let mut slot = vec![0u8; data.len().max(64)];
        wr.encode(&mut slot).expect("a decoded WR fits the slot it came from");
    }
    let _ = RecvWr::decode(data);
});
