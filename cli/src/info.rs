//! `zerohop info`: the probe report. It exits non-zero when the transport
//! asked for (`ZEROHOP_TRANSPORT`) cannot run here.

use serde::Serialize;
use zerohop_core::{pick, Kind, Preference, Status};
use zerohop_std::{probe_host, Config};

#[derive(Serialize)]
struct PrereqReport {
    name: &'static str,
    status: &'static str,
    detail: String,
}

#[derive(Serialize)]
struct InfoReport {
    compiled: Vec<&'static str>,
    prerequisites: Vec<PrereqReport>,
    preference: String,
    chosen: Option<&'static str>,
    skipped: Vec<String>,
    error: Option<String>,
}

pub fn run(json: bool) -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::from_env()?;
    let probe = probe_host();
    let compiled: Vec<_> = Kind::ALL
        .into_iter()
        .filter(|&k| probe.compiled().contains(k))
        .map(Kind::name)
        .collect();
    let prerequisites = probe
        .iter()
        .map(|(p, s)| {
            let (status, detail) = match s {
                Status::Present(d) => ("present", d.to_string()),
                Status::Missing(d) => ("missing", d.to_string()),
                Status::Unknown => (
                    "unknown",
                    "not probed: its backend is not compiled in".to_string(),
                ),
            };
            PrereqReport {
                name: p.name(),
                status,
                detail,
            }
        })
        .collect();
    let choice = pick(config.transport, &probe);
    let report = InfoReport {
        compiled,
        prerequisites,
        preference: match config.transport {
            Preference::Auto => "auto".into(),
            Preference::Only(k) => k.name().into(),
        },
        chosen: choice.as_ref().ok().map(|c| c.kind.name()),
        skipped: choice
            .as_ref()
            .map(|c| c.skipped().map(|s| s.to_string()).collect())
            .unwrap_or_default(),
        error: choice.as_ref().err().map(|e| e.to_string()),
    };
    // A transport asked for that cannot run is a failure of the command,
    // after the report that says why.
    let verdict = match &report.error {
        Some(e) => Err(e.clone().into()),
        None => Ok(()),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return verdict;
    }
    println!("zerohop {}", env!("CARGO_PKG_VERSION"));
    println!("compiled in: {}", report.compiled.join(", "));
    println!("prerequisites:");
    for p in &report.prerequisites {
        println!("  {:<15} {:<8} {}", p.name, p.status, p.detail);
    }
    println!(
        "transport ({}): {}",
        report.preference,
        report.chosen.unwrap_or("none")
    );
    for s in &report.skipped {
        println!("  skipped {s}");
    }
    if let Some(e) = &report.error {
        println!("  {e}");
    }
    verdict
}
