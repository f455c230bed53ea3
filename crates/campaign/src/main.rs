//! `campaign`: a randomized fault campaign against idemproxy. It starts a
//! store topology, proxy replicas, an upstream that journals every
//! execution and clients that retry; a nemesis drawn from the seed breaks
//! things while they run; then every fault heals, every key is asked once
//! more, and a checker reads the history: at most one execution per key,
//! every answer the execution's, every 2xx replayed, every key settled.
//!
//! Exit status: 0 when the checker finds no violation, 1 when it finds one,
//! 2 when the campaign could not run (a store that does not start, a
//! missing binary).

mod check;
mod clients;
mod history;
mod nemesis;
mod procs;
mod record;
mod relay;
mod rng;
mod run;
mod timeline;
mod topology;
mod upstream;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "campaign",
    version,
    about = "A randomized fault campaign against idemproxy: nothing may run twice",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: run::Options,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Checks a recorded history again (DIR/history.jsonl) and prints the report.
    Check {
        history: PathBuf,
        /// Also write summary.json and timeline.svg into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The journaling upstream (the campaign starts it; not for people).
    #[command(hide = true)]
    Upstream {
        #[arg(long)]
        port: u16,
        #[arg(long)]
        journal: PathBuf,
    },
}

/// "60s", "500ms", "30m", "1h", "1m30s".
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let mut total = 0u64;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err("an empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("invalid duration \"{text}\": expected e.g. 60s, 500ms, 30m"))?;
        let too_long = || format!("invalid duration \"{text}\": too long");
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let ms = match &rest[..unit] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => {
                return Err(format!(
                    "invalid duration \"{text}\": units are ms, s, m, h"
                ))
            }
        };
        total = n
            .checked_mul(ms)
            .and_then(|v| total.checked_add(v))
            .filter(|&v| v <= 365 * 24 * 3_600_000)
            .ok_or_else(too_long)?;
        rest = &rest[unit..];
    }
    Ok(Duration::from_millis(total))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Upstream { port, journal }) => match upstream::run(port, journal) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("upstream: {e}");
                ExitCode::from(2)
            }
        },
        Some(Command::Check { history, out }) => run::check_file(&history, out.as_deref()),
        None => run::main(cli.run),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_read_as_the_proxy_writes_them() {
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("6000000000000h").is_err());
    }
}
