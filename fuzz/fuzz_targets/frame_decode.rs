//! The frame decoder: arbitrary bytes never panic, a decoded length is
//! always bounded, and every header that decodes re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerohop_core::wire::{Frame, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let max = 1usize << 20;
    if let Ok(d) = Frame::decode(data, max) {
        assert!(
            d.frame.payload_len() <= max,
            "a decoded length is always bounded"
        );
        let payload = &data[HEADER_LEN..];
        let payload = &payload[..d.frame.payload_len().min(payload.len())];
        let again = d.frame.encode(payload);
        // Bytes 0..28 are the frame's fields: they round-trip exactly; the
        // checksum does when the payload it covers is all there.
        assert_eq!(
            &again[..28],
            &data[..28],
            "decode then encode is the identity"
        );
        if d.verify(payload).is_ok() {
            assert_eq!(&again[..], &data[..HEADER_LEN]);
        }
    }
});
