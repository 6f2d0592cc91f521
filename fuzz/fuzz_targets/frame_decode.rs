//! The frame decoder: arbitrary bytes never panic, and every valid header
//! round-trips through encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerohop_core::wire::{Flags, Header, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let max = 1usize << 20;
    if let Ok(h) = Header::decode(data, max) {
        assert!(h.len as usize <= max, "a decoded length is always bounded");
        assert_eq!(
            &h.encode()[..],
            &data[..HEADER_LEN],
            "decode then encode is the identity"
        );
        let _ = h.verify(&data[HEADER_LEN..]);
    }
    // And the other way: a header built from the input round-trips.
    if data.len() >= 24 {
        let seq = u64::from_le_bytes(data[0..8].try_into().unwrap());
        let src = u32::from_le_bytes(data[8..12].try_into().unwrap());
        let dst = u32::from_le_bytes(data[12..16].try_into().unwrap());
        let payload = &data[24..];
        let extra = [Flags::NONE, Flags::MORE, Flags::STRIPED][data[17] as usize % 3];
        let h = Header::data(src, dst, seq, payload, data[16] & 1 == 1, extra);
        let back = Header::decode(&h.encode(), payload.len()).expect("an encoded header decodes");
        assert_eq!(back, h);
        assert!(back.verify(payload).is_ok());
    }
});
