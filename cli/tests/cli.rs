//! The `zerohop` command as a user runs it: `info` and `perf`, their JSON, and
//! the errors a bad flag or environment variable gets. Runs on any host (the
//! mock and tcp transports need nothing).

use std::process::{Command, Output};

fn zerohop(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerohop"));
    c.args(args)
        .env_remove("ZEROHOP_TRANSPORT")
        .env_remove("ZEROHOP_POOL_BYTES");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the zerohop binary runs")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "zerohop failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("valid JSON on stdout")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn info_json_names_every_prerequisite_and_a_choice() {
    let r = json(&zerohop(&["info", "--json"], &[]));
    let prereqs = r["prerequisites"].as_array().expect("a list");
    for name in [
        "cuda-driver",
        "ibverbs-device",
        "hca-live",
        "nic-dmabuf",
        "peermem",
    ] {
        let p = prereqs
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} reported"));
        assert!(
            ["present", "missing", "unknown"].contains(&p["status"].as_str().unwrap()),
            "{p}"
        );
        assert!(
            !p["detail"].as_str().unwrap().is_empty(),
            "a reason for {name}"
        );
    }
    // Auto always finds something: tcp at worst.
    assert!(r["chosen"].is_string(), "{r}");
    assert_eq!(r["preference"], "auto");
}

#[test]
fn perf_over_mock_and_tcp_reports_every_size_copying_and_zero_copy() {
    for transport in ["mock", "tcp"] {
        for zero_copy in [false, true] {
            let mut args = vec![
                "perf",
                "--transport",
                transport,
                "--sizes",
                "64,4k",
                "--iters",
                "200",
                "--stream-bytes",
                "1M",
                "--json",
            ];
            if zero_copy {
                args.push("--zero-copy");
            }
            let r = json(&zerohop(&args, &[("ZEROHOP_POOL_BYTES", "64M")]));
            assert_eq!(r["transport"], transport);
            assert_eq!(r["zero_copy"], zero_copy);
            let rows = r["rows"].as_array().unwrap();
            let sizes: Vec<_> = rows
                .iter()
                .map(|row| row["size"].as_u64().unwrap())
                .collect();
            assert_eq!(sizes, [64, 4096]);
            for row in rows {
                let min = row["lat_min_us"].as_f64().unwrap();
                let p50 = row["lat_p50_us"].as_f64().unwrap();
                let p99 = row["lat_p99_us"].as_f64().unwrap();
                assert!(min > 0.0 && p50 >= min && p99 >= p50, "{row}");
                assert!(row["bw_gb_per_s"].as_f64().unwrap() > 0.0, "{row}");
            }
        }
    }
}

#[test]
fn bad_flags_and_variables_are_errors_that_say_what_is_wrong() {
    /// Arguments, environment, and what the error must name.
    type Case = (
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
        &'static str,
    );
    let cases: [Case; 4] = [
        (
            &["perf", "--transport", "mock", "--sizes", "0"],
            &[],
            "--sizes",
        ),
        (
            &["info"],
            &[("ZEROHOP_TRANSPORT", "infiniband-please")],
            "ZEROHOP_TRANSPORT",
        ),
        (
            &["info"],
            &[("ZEROHOP_POOL_BYTES", "lots")],
            "ZEROHOP_POOL_BYTES",
        ),
        (&["perf", "--transport", "warp-drive"], &[], "warp-drive"),
    ];
    for (args, env, named) in cases {
        let out = zerohop(args, env);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(stderr(&out).contains(named), "{}", stderr(&out));
    }
}

#[test]
fn an_explicit_transport_this_host_lacks_names_what_is_missing() {
    let info = json(&zerohop(&["info", "--json"], &[]));
    let missing = |name: &str| {
        info["prerequisites"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == name && p["status"] != "present")
    };
    if !missing("ibverbs-device") {
        eprintln!("SKIPPED: this host has an RDMA device, gpudirect may run");
        return;
    }
    let out = zerohop(&["perf", "--transport", "gpudirect"], &[]);
    assert!(
        !out.status.success(),
        "gpudirect cannot run without an RDMA device"
    );
    let err = stderr(&out);
    assert!(
        err.contains("gpudirect")
            && (err.contains("ibverbs-device") || err.contains("not compiled")),
        "{err}"
    );
}
