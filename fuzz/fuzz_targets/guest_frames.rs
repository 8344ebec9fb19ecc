//! The daemon decodes every byte a guest writes to its virtio-serial port
//! (`vrdma_core::proto::guest`); no stream may panic the decoder, and
//! whatever decodes must encode back to an equal frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_core::proto::guest::{encode, FrameDecoder};

fuzz_target!(|data: &[u8]| {
    // Split where the first byte says, to exercise partial frames.
    let (cut, rest) = match data.split_first() {
        Some((c, r)) => (*c as usize % (r.len() + 1), r),
        None => return,
    };
    let mut d = FrameDecoder::new();
    for part in [&rest[..cut], &rest[cut..]] {
        d.push(part);
        while let Ok(Some(f)) = d.next_frame() {
            let mut again = FrameDecoder::new();
            again.push(&encode(&f));
            assert_eq!(again.next_frame().expect("re-encoded frame decodes"), Some(f));
        }
    }
});
