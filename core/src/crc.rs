//! CRC-32C (Castagnoli), table-driven, `const`-built: the frame checksum.

const POLY: u32 = 0x82F6_3B78; // reflected Castagnoli polynomial

const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// Continues a CRC-32C over `bytes`. Start with `crc32c(0, ..)`; feeding the
/// result back in with more bytes equals one call over the concatenation.
pub fn crc32c(crc: u32, bytes: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in bytes {
        c = TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::crc32c;

    #[test]
    fn matches_the_rfc3720_check_values() {
        // RFC 3720 B.4: 32 bytes of zeros, and "123456789" (the standard check value).
        assert_eq!(crc32c(0, &[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(0, b"123456789"), 0xE306_9283);
    }

    #[test]
    fn is_incremental() {
        let whole = crc32c(0, b"hello, zerohop");
        assert_eq!(crc32c(crc32c(0, b"hello, "), b"zerohop"), whole);
    }
}
