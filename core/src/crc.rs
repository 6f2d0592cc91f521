//! CRC-32C (Castagnoli), the frame checksum, from kept crates: `crc`'s
//! table (no_std, 1 KiB of table: the firmware's) and, with the `std`
//! feature, `crc32c`'s, which uses the CPU's CRC instruction where there is
//! one (SSE 4.2 on x86-64, found at run time).

/// Continues a CRC-32C over `bytes`. Start with `crc32c(0, ..)`; feeding the
/// result back in with more bytes equals one call over the concatenation.
#[cfg(feature = "std")]
pub fn crc32c(crc: u32, bytes: &[u8]) -> u32 {
    ::crc32c::crc32c_append(crc, bytes)
}

/// Continues a CRC-32C over `bytes`. Start with `crc32c(0, ..)`; feeding the
/// result back in with more bytes equals one call over the concatenation.
#[cfg(not(feature = "std"))]
pub fn crc32c(crc: u32, bytes: &[u8]) -> u32 {
    static CASTAGNOLI: ::crc::Crc<u32, ::crc::Table<1>> =
        ::crc::Crc::<u32, ::crc::Table<1>>::new(&::crc::CRC_32_ISCSI);
    // The algorithm's register holds the sum before its final inversion,
    // bit-reversed (it reflects its input): that is where `crc` left off.
    let mut digest = CASTAGNOLI.digest_with_initial((!crc).reverse_bits());
    digest.update(bytes);
    digest.finalize()
}

#[cfg(test)]
mod tests {
    use super::crc32c;

    #[test]
    fn matches_the_rfc3720_check_values() {
        // RFC 3720 B.4: 32 bytes of zeros, of 0xFF, ascending; and "123456789".
        assert_eq!(crc32c(0, &[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(0, &[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: [u8; 32] = core::array::from_fn(|i| i as u8);
        assert_eq!(crc32c(0, &ascending), 0x46DD_794E);
        assert_eq!(crc32c(0, b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(0, &[]), 0);
    }

    #[test]
    fn is_incremental() {
        let whole = crc32c(0, b"hello, zerohop");
        for cut in 0..=14 {
            let (a, b) = b"hello, zerohop".split_at(cut);
            assert_eq!(crc32c(crc32c(0, a), b), whole, "cut at {cut}");
        }
        assert_ne!(crc32c(0, b"hello, zerohoq"), whole);
    }
}
