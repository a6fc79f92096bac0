//! `flashcomm-accuracy`: error statistics of the flashcomm codec and its quantized all-reduce on
//! synthetic activations (CPU). Prints markdown tables, or JSON with `--json`.

use std::io::Write as _;
use std::process::ExitCode;

use flashcomm_accuracy::{Parts, Sizes, report, run};

const USAGE: &str = "\
usage: flashcomm-accuracy [--json] [--quick] [--seed N] [--only a|b|c[,..]] [--ranks N]

Error statistics (relative L2 error, SNR in dB, max abs error) of every width 2..8, group size
32..256 and spike count 0/2/4 on
  a  Gaussian values (codec round trip),
  b  heavy-tailed partial sums with outlier channels, a massive activation in one rank,
     delimiter spikes and a cancellation (one-shot and two-step all-reduce; --ranks, default 2),
  c  the partial sums of a tensor-parallel row-linear layer, N = 2, 4, 8 ranks.
Errors are against the exact f64 sum of the ranks' bf16 inputs.

  --json    print every record as JSON instead of markdown tables
  --quick   small data sets (a smoke test, seconds in a debug build)
  --seed N  seed of the data (default 1)
  --only    run only some of the parts
  --ranks N ranks of part b (default 2)
";

fn main() -> ExitCode {
    let mut json = false;
    let mut sizes = Sizes::FULL;
    let mut seed = 1u64;
    let mut parts = Parts {
        gaussian: true,
        heavy: true,
        linear: true,
    };
    let mut ranks = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json = true,
            "--quick" => sizes = Sizes::QUICK,
            "--seed" => match args.next().and_then(|v| v.parse().ok()) {
                Some(s) => seed = s,
                None => return usage("--seed needs a number"),
            },
            "--ranks" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n >= 1 => ranks = Some(n),
                _ => return usage("--ranks needs a number >= 1"),
            },
            "--only" => {
                let Some(list) = args.next() else {
                    return usage("--only needs a list");
                };
                parts = Parts {
                    gaussian: false,
                    heavy: false,
                    linear: false,
                };
                for p in list.split(',') {
                    match p {
                        "a" => parts.gaussian = true,
                        "b" => parts.heavy = true,
                        "c" => parts.linear = true,
                        _ => return usage(&format!("unknown part {p}")),
                    }
                }
            }
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ => return usage(&format!("unknown argument {a}")),
        }
    }
    if let Some(n) = ranks {
        sizes.heavy_ranks = n;
    }
    let sections = run(seed, sizes, parts);
    let text = if json {
        match report::json(&sections) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("flashcomm-accuracy: writing JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        report::markdown(&sections)
    };
    // A closed pipe (`| head`) is not an error worth a panic.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flashcomm-accuracy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("flashcomm-accuracy: {msg}\n\n{USAGE}");
    ExitCode::from(2)
}
