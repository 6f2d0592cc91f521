//! Configuration from the environment: malformed values are errors that name
//! the variable, never silent defaults.

use std::fmt;

use zerohop_core::Preference;

/// Environment configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// `ZEROHOP_TRANSPORT`: auto, gpudirect, rdma, uma, tcp, mock (trimmed, case-insensitive).
    pub transport: Preference,
    /// `ZEROHOP_POOL_BYTES`: the pool budget (default 4 GiB). Plain bytes or a
    /// binary suffix: `512M`, `4GiB`, `64k`.
    pub pool_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            transport: Preference::Auto,
            pool_bytes: 4 << 30,
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
    /// Reads `ZEROHOP_TRANSPORT` and `ZEROHOP_POOL_BYTES`; unset means default.
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
                expected: "one of auto, gpudirect, rdma, uma, tcp, mock",
            })?;
        }
        if let Some(v) = get("ZEROHOP_POOL_BYTES") {
            c.pool_bytes = parse_bytes(&v).filter(|&n| n > 0).ok_or(ConfigError {
                var: "ZEROHOP_POOL_BYTES",
                value: v.clone(),
                expected: "a positive byte count, optionally with k/M/G (binary) suffix, e.g. 512M or 4GiB",
            })?;
        }
        Ok(c)
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
    fn byte_suffixes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("4GiB"), Some(4 << 30));
        assert_eq!(parse_bytes("1 g"), Some(1 << 30));
        assert_eq!(parse_bytes("2MB"), Some(2 << 20));
        assert_eq!(parse_bytes("k"), None);
    }
}
