//! `zerohop`: what this host supports (`info`) and how fast it is (`perf`).

mod info;
mod perf;
mod transports;

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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("ZEROHOP_LOG", "warn"))
        .init();
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
