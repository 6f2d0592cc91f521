//! Configuration from the environment: malformed values are errors that name
//! the variable, never silent defaults.
//!
//! The Go package's variables are read where zerohop's are unset:
//! `ZAP_TRANSPORT` (its `default` is tcp) and `ZAP_UMA_POOL_BYTES` (0: no
//! budget, which here means the host's physical memory).

use std::fmt;

use zerohop_core::Preference;

/// Environment configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// `ZEROHOP_TRANSPORT` (else `ZAP_TRANSPORT`): auto, gpudirect, rdma,
    /// uma, shm, tcp, mock (trimmed, case-insensitive; the Go package's `default` is tcp).
    pub transport: Preference,
    /// `ZEROHOP_POOL_BYTES` (else `ZAP_UMA_POOL_BYTES`, where 0 means no
    /// budget: the host's physical memory): the pool budget (default 4 GiB).
    /// Plain bytes or a binary suffix: `512M`, `4GiB`, `64k`.
    pub pool_bytes: usize,
    /// `ZEROHOP_SHM_SINGLE_COPY_FROM`: same-host messages of this many
    /// bytes and up are read straight out of the sender's memory, smaller
    /// ones go through the ring (default 32 KiB; see
    /// [`ShmConfig::single_copy_from`](crate::shm::ShmConfig::single_copy_from)).
    pub shm_single_copy_from: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            transport: Preference::Auto,
            pool_bytes: 4 << 30,
            shm_single_copy_from: crate::shm::ShmConfig::default().single_copy_from,
        }
    }
}

/// A malformed environment variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What was expected.
    pub expected: &'static str,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={:?} is invalid: expected {}",
            self.var, self.value, self.expected
        )
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads `ZEROHOP_TRANSPORT` and `ZEROHOP_POOL_BYTES` (or the Go
    /// package's `ZAP_TRANSPORT` and `ZAP_UMA_POOL_BYTES` where those are
    /// unset); unset means default.
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`from_env`](Self::from_env), from any lookup (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        if let Some(v) = get("ZEROHOP_TRANSPORT") {
            c.transport = Preference::parse(&v).map_err(|_| ConfigError {
                var: "ZEROHOP_TRANSPORT",
                value: v.clone(),
                expected: "one of auto, gpudirect, rdma, uma, shm, tcp, mock",
            })?;
        } else if let Some(v) = get("ZAP_TRANSPORT") {
            c.transport = match v.trim().to_ascii_lowercase().as_str() {
                "default" => Preference::Only(zerohop_core::Kind::Tcp),
                _ => Preference::parse(&v).map_err(|_| ConfigError {
                    var: "ZAP_TRANSPORT",
                    value: v.clone(),
                    expected: "one of default (tcp), auto, gpudirect, rdma, uma, shm, tcp",
                })?,
            };
        }
        if let Some(v) = get("ZEROHOP_POOL_BYTES") {
            c.pool_bytes = parse_bytes(&v).filter(|&n| n > 0).ok_or(ConfigError {
                var: "ZEROHOP_POOL_BYTES",
                value: v.clone(),
                expected: "a positive byte count, optionally with k/M/G (binary) suffix, e.g. 512M or 4GiB",
            })?;
        } else if let Some(v) = get("ZAP_UMA_POOL_BYTES") {
            c.pool_bytes = match parse_bytes(&v) {
                Some(0) => physical_memory(),
                Some(n) => n,
                None => {
                    return Err(ConfigError {
                        var: "ZAP_UMA_POOL_BYTES",
                        value: v.clone(),
                        expected:
                            "a byte count (0: no budget), optionally with k/M/G (binary) suffix",
                    })
                }
            };
        }
        if let Some(v) = get("ZEROHOP_SHM_SINGLE_COPY_FROM") {
            c.shm_single_copy_from = parse_bytes(&v).ok_or(ConfigError {
                var: "ZEROHOP_SHM_SINGLE_COPY_FROM",
                value: v.clone(),
                expected: "a byte count, optionally with k/M/G (binary) suffix, e.g. 32k or 2M",
            })?;
        }
        Ok(c)
    }
}

/// The host's physical memory in bytes: what "no budget" is bounded by.
/// 4 GiB where the system does not say.
pub fn physical_memory() -> usize {
    // SAFETY: sysconf reads a system constant; it has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (usize::try_from(pages), usize::try_from(page)) {
        (Ok(n), Ok(p)) if n > 0 && p > 0 => n.saturating_mul(p),
        _ => 4 << 30,
    }
}

/// Parses `123`, `64k`, `512M`, `4GiB`, `1 g` (binary multiples; trimmed,
/// case-insensitive). `None` when malformed or out of range.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(digits_end);
    let n: usize = digits.parse().ok()?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1usize << shift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerohop_core::Kind;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn defaults_when_unset() {
        assert_eq!(Config::from_lookup(env(&[])), Ok(Config::default()));
        assert_eq!(Config::default().pool_bytes, 4 << 30);
    }

    #[test]
    fn reads_both_variables() {
        let c = Config::from_lookup(env(&[
            ("ZEROHOP_TRANSPORT", " TCP "),
            ("ZEROHOP_POOL_BYTES", "512M"),
        ]))
        .unwrap();
        assert_eq!(c.transport, Preference::Only(Kind::Tcp));
        assert_eq!(c.pool_bytes, 512 << 20);
        assert_eq!(c.shm_single_copy_from, 32 << 10, "the default");
        let c = Config::from_lookup(env(&[("ZEROHOP_SHM_SINGLE_COPY_FROM", "2M")])).unwrap();
        assert_eq!(c.shm_single_copy_from, 2 << 20);
        let e = Config::from_lookup(env(&[("ZEROHOP_SHM_SINGLE_COPY_FROM", "half")])).unwrap_err();
        assert_eq!(e.var, "ZEROHOP_SHM_SINGLE_COPY_FROM");
    }

    #[test]
    fn malformed_values_name_the_variable() {
        let e = Config::from_lookup(env(&[("ZEROHOP_TRANSPORT", "infiniband")])).unwrap_err();
        assert_eq!(e.var, "ZEROHOP_TRANSPORT");
        assert!(e
            .to_string()
            .contains("ZEROHOP_TRANSPORT=\"infiniband\" is invalid"));
        for bad in [
            "",
            "lots",
            "-1",
            "0",
            "12X",
            "99999999999999999999",
            "4 GiB GiB",
        ] {
            let e = Config::from_lookup(env(&[("ZEROHOP_POOL_BYTES", bad)])).unwrap_err();
            assert_eq!(e.var, "ZEROHOP_POOL_BYTES", "{bad:?}");
        }
    }

    #[test]
    fn the_go_packages_variables_are_read_where_zerohops_are_unset() {
        let c = Config::from_lookup(env(&[("ZAP_TRANSPORT", "default")])).unwrap();
        assert_eq!(c.transport, Preference::Only(Kind::Tcp));
        let c = Config::from_lookup(env(&[("ZAP_TRANSPORT", " UMA ")])).unwrap();
        assert_eq!(c.transport, Preference::Only(Kind::Uma));
        let c = Config::from_lookup(env(&[("ZAP_UMA_POOL_BYTES", "256M")])).unwrap();
        assert_eq!(c.pool_bytes, 256 << 20);
        let c = Config::from_lookup(env(&[("ZAP_UMA_POOL_BYTES", "0")])).unwrap();
        assert_eq!(c.pool_bytes, physical_memory());
        assert!(physical_memory() >= 1 << 30, "a host with at least 1 GiB");
        // zerohop's own variables win.
        let c = Config::from_lookup(env(&[
            ("ZEROHOP_TRANSPORT", "auto"),
            ("ZAP_TRANSPORT", "default"),
            ("ZEROHOP_POOL_BYTES", "1M"),
            ("ZAP_UMA_POOL_BYTES", "0"),
        ]))
        .unwrap();
        assert_eq!((c.transport, c.pool_bytes), (Preference::Auto, 1 << 20));
        for (var, bad) in [
            ("ZAP_TRANSPORT", "carrier-pigeon"),
            ("ZAP_UMA_POOL_BYTES", "-1"),
        ] {
            let e = Config::from_lookup(env(&[(var, bad)])).unwrap_err();
            assert_eq!(e.var, var);
        }
    }

    #[test]
    fn byte_suffixes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("4GiB"), Some(4 << 30));
        assert_eq!(parse_bytes("1 g"), Some(1 << 30));
        assert_eq!(parse_bytes("2MB"), Some(2 << 20));
        assert_eq!(parse_bytes("k"), None);
    }
}
