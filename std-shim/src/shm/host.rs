//! Where this process runs, as far as sharing memory goes: the kernel it
//! booted (its boot id) and the IPC, mount and network namespaces it is in.
//! Two processes with the same identity can pass a memfd over an abstract
//! Unix socket (network namespace) and map it (same kernel); the IPC and
//! mount namespaces are part of it too, as the issue of "one host" asks.

use std::io;

use zerohop_core::session::HostOffer;

/// A digest of what makes two processes one host for shared memory.
pub(crate) fn identity() -> io::Result<u64> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let mut h = Fnv::new();
    h.write(boot.trim().as_bytes());
    for ns in ["ipc", "mnt", "net"] {
        let link = std::fs::read_link(format!("/proc/self/ns/{ns}"))?;
        h.write(link.as_os_str().as_encoded_bytes());
    }
    Ok(h.0)
}

/// This process's offer: its identity, its pid, and `nonce` (which, with
/// the pid, names where it takes segments).
pub(crate) fn offer(nonce: u32) -> io::Result<HostOffer> {
    Ok(HostOffer {
        host: identity()?,
        pid: std::process::id(),
        nonce,
    })
}

/// The abstract Unix socket name an offer's side takes segments on.
pub(crate) fn socket_name(offer: &HostOffer) -> String {
    format!(
        "zerohop-lane.{:016x}.{}.{:08x}",
        offer.host, offer.pid, offer.nonce
    )
}

/// FNV-1a, 64 bits: a stable digest (the same in every process, unlike
/// std's randomly keyed hasher).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so ("ab", "c") and ("a", "bc") differ.
        self.0 = (self.0 ^ 0xFF).wrapping_mul(0x0100_0000_01b3);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_is_stable_and_the_same_in_a_child_process() {
        let here = identity().unwrap();
        assert_eq!(here, identity().unwrap());
        // A child in the same namespaces computes the same digest from the
        // same files (read through its own /proc/self).
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        let out = std::process::Command::new("readlink")
            .args([
                "/proc/self/ns/ipc",
                "/proc/self/ns/mnt",
                "/proc/self/ns/net",
            ])
            .output()
            .unwrap();
        let mut h = Fnv::new();
        h.write(boot.trim().as_bytes());
        for line in String::from_utf8(out.stdout).unwrap().lines() {
            h.write(line.as_bytes());
        }
        assert_eq!(h.0, here);
        let o = offer(7).unwrap();
        assert_eq!((o.host, o.pid, o.nonce), (here, std::process::id(), 7));
        assert!(socket_name(&o).starts_with("zerohop-lane."));
    }

    #[test]
    fn the_digest_separates_its_parts() {
        let (mut a, mut b) = (Fnv::new(), Fnv::new());
        a.write(b"ab");
        a.write(b"c");
        b.write(b"a");
        b.write(b"bc");
        assert_ne!(a.0, b.0);
    }
}
