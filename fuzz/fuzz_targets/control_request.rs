//! The daemon decodes every control message a tenant sends; no input may
//! panic it, and whatever decodes must encode back to an equal request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_core::proto::{decode_request, encode_request};

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = decode_request(data) {
        let again = decode_request(&encode_request(&req)).expect("re-encoded request decodes");
        assert_eq!(again, req);
        let _ = req.expected_fds();
    }
});
