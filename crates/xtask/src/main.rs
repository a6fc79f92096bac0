//! Command line of the development tasks; see the library documentation for the list.

use std::process::ExitCode;

use xtask::{Error, Generated, abi, bindings, envdoc, exports, header, kernels};

fn usage() -> ExitCode {
    eprintln!(
        "usage: cargo run -p xtask -- <task>\n\
         tasks:\n  \
         gen-bindings   run bindgen over the pinned NCCL headers (needs libclang; source .toolchain/env.sh)\n  \
         gen-exports    regenerate the plain forwarders and the support matrix of docs/abi.md\n  \
         gen-env-doc    regenerate the variable table of docs/env.md\n  \
         gen-header     regenerate include/flashcomm.h with cbindgen\n  \
         gen-kernels    regenerate the CUDA ABI header and kernel instantiation list\n  \
         gen-all        all of the above\n  \
         check          fail if any committed generated file is stale (bindings only when headers are found)"
    );
    ExitCode::from(2)
}

fn products(task: &str) -> Result<Vec<Generated>, Error> {
    Ok(match task {
        "gen-bindings" => {
            let paths = bindings::HeaderPaths::from_env().map_err(Error::new)?;
            bindings::outputs(&bindings::generate(&paths)?)
        }
        "gen-exports" => {
            let mut v = exports::outputs()?;
            v.extend(abi::outputs()?);
            v
        }
        "gen-env-doc" => envdoc::outputs()?,
        "gen-header" => header::outputs()?,
        "gen-kernels" => kernels::outputs()?,
        other => return Err(Error::new(format!("unknown task {other}"))),
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [task] = args.as_slice() else {
        return usage();
    };
    let result = match task.as_str() {
        "gen-all" => [
            "gen-bindings",
            "gen-exports",
            "gen-env-doc",
            "gen-header",
            "gen-kernels",
        ]
        .iter()
        .try_for_each(|t| write_all(products(t)?)),
        "check" => check_all(),
        "gen-bindings" | "gen-exports" | "gen-env-doc" | "gen-header" | "gen-kernels" => {
            products(task).and_then(write_all)
        }
        "-h" | "--help" | "help" => return usage(),
        _ => return usage(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write_all(products: Vec<Generated>) -> Result<(), Error> {
    for p in products {
        let changed = p.write()?;
        eprintln!(
            "{} {}",
            if changed { "wrote    " } else { "unchanged" },
            p.path
                .strip_prefix(xtask::repo_root())
                .unwrap_or(&p.path)
                .display()
        );
    }
    Ok(())
}

fn check_all() -> Result<(), Error> {
    let mut stale = Vec::new();
    let mut tasks = vec!["gen-exports", "gen-env-doc", "gen-header", "gen-kernels"];
    match bindings::HeaderPaths::from_env() {
        Ok(_) => tasks.insert(0, "gen-bindings"),
        Err(why) => eprintln!("xtask: skipping the bindings check: {why}"),
    }
    for t in tasks {
        for p in products(t)? {
            if let Some(reason) = p.check()? {
                stale.push(reason);
            }
        }
    }
    if stale.is_empty() {
        eprintln!("xtask: every generated file is current");
        Ok(())
    } else {
        Err(Error::new(stale.join("\n")))
    }
}
