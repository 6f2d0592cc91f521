//! `zerohop`: what this host supports (`info`) and how fast it is (`perf`).

mod idle;
mod info;
mod perf;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "zerohop",
    version,
    about = "Messages that land where the GPU reads them"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Probe report: each prerequisite present or missing (with why), and the transport auto-pick chooses.
    Info {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Latency (ping-pong) and bandwidth (streaming) over a message-size sweep.
    Perf(perf::PerfArgs),
}

/// Raises this process's descriptor limit to its hard limit: a listener
/// serving a thousand peers needs more than the usual soft limit of 1024.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit out-pointer; raising the soft limit up to the
    // hard one needs no privilege and changes nothing else.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("ZEROHOP_LOG", "warn"))
        .init();
    raise_fd_limit();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info { json } => info::run(json),
        Command::Perf(args) => perf::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zerohop: {e}");
            ExitCode::FAILURE
        }
    }
}
