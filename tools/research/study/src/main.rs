//! `flashcomm-tp-study`: WikiText-2 perplexity of SmolLM2-135M with the tensor-parallel
//! all-reduces, or the expert-parallel dispatch and combine all-to-alls, quantized by the
//! flashcomm codec. See `docs/accuracy-model.md`.

#![forbid(unsafe_code)]

use flashcomm_study::collective::{Codec, Mode, Scope, Simulated};
use flashcomm_study::gguf::Gguf;
use flashcomm_study::model::Model;
use flashcomm_study::study::{self, Run, RunResult};
use flashcomm_study::tokenizer::Tokenizer;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "\
usage: flashcomm-tp-study --model FILE.gguf --text FILE [options]

  --model FILE     the SmolLM2-135M-Instruct GGUF file (ci/get-model.sh fetches it)
  --text FILE      WikiText-2 test set (test.txt)
  --windows N      non-overlapping windows of --ctx tokens from the start of the text [3]
  --ctx N          tokens per window [512]
  --plan NAME      quick | tp2 | tp48 | full | rot | srot | oracle | ep [quick]
  --run SETTING    a single setting, repeatable, replaces --plan:
                   TP:exact, TP:f32, TP:two:B:G:K, TP:one:B:G:K, TP:mixed:BRS:BAG:G:K,
                   TP:oracle:B:G:K (a bound: each group's best approximation with
                   2^B + K distinct values, one-shot), TP:grid:B:G:K:P (one-shot,
                   codes on a grid denser in the middle, exponent P/10), the quantized ones optionally followed by :rot to rotate each group
                   (randomized Hadamard) around the codec, or by :srot to take each
                   group's K spikes out first (kept exactly) and rotate and quantize the
                   rest without spikes (not the oracle or grid), then optionally by @L:S to
                   quantize only some all-reduces (the others stay exact): L is all, N or
                   A-B (layers, inclusive), S is both, o or down;
                   or expert parallelism at TP = 1 (the MLP block's input sent as
                   dispatch, its output as combine, through the codec's all-to-all):
                   ep:f32, ep:exact (bf16), ep:dispatch:B:G:K, ep:combine:B:G:K,
                   ep:both:B:G:K, optionally followed by @L:both
  --threads N      worker threads [available cores]
  --json FILE      also write the results as JSON (rewritten as settings finish)
  --prompt TEXT    prompt of the next-token check [The capital of France is]
  --check-only     only run the next-token check
";

struct Args {
    model: PathBuf,
    text: Option<PathBuf>,
    windows: usize,
    ctx: usize,
    plan: String,
    runs: Vec<Run>,
    threads: usize,
    json: Option<PathBuf>,
    prompt: String,
    check_only: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut model = None;
    let mut a = Args {
        model: PathBuf::new(),
        text: None,
        windows: 3,
        ctx: 512,
        plan: "quick".into(),
        runs: Vec::new(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        json: None,
        prompt: "The capital of France is".into(),
        check_only: false,
    };
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(val()?)),
            "--text" => a.text = Some(PathBuf::from(val()?)),
            "--windows" => a.windows = num(val()?)?,
            "--ctx" => a.ctx = num(val()?)?,
            "--plan" => a.plan = val()?,
            "--run" => a.runs.push(study::parse_run(&val()?)?),
            "--threads" => a.threads = num(val()?)?.max(1),
            "--json" => a.json = Some(PathBuf::from(val()?)),
            "--prompt" => a.prompt = val()?,
            "--check-only" => a.check_only = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    a.model = model.ok_or("--model is required")?;
    if a.text.is_none() && !a.check_only {
        return Err("--text is required".into());
    }
    if a.ctx < 2 || a.windows == 0 {
        return Err("--ctx must be at least 2 and --windows at least 1".into());
    }
    Ok(a)
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn run() -> Result<(), String> {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return Ok(());
        }
        Err(e) => return Err(format!("{e}\n{USAGE}")),
    };
    let t0 = Instant::now();
    let g = Gguf::open(&args.model).map_err(|e| format!("{}: {e}", args.model.display()))?;
    let model = Model::from_gguf(&g)?;
    let tok = Tokenizer::from_gguf(&g)?;
    drop(g);
    eprintln!(
        "loaded {} ({} layers, hidden {}, vocab {}) in {:.1}s",
        args.model.display(),
        model.cfg.layers,
        model.cfg.hidden,
        model.cfg.vocab,
        t0.elapsed().as_secs_f64()
    );

    // Next-token check of the layout (RoPE pairs, GQA): the exact single-rank forward pass.
    let prompt = tok.encode(&args.prompt);
    let single = Simulated::new(1, Mode::F32, &Codec);
    let h = model.hidden_states(&prompt, &single);
    let last = model.logits(flashcomm_study::model::rows(
        &h,
        prompt.len() - 1..prompt.len(),
    ));
    let row = last.row(0);
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    let m = row[order[0]];
    let z: f32 = row.iter().map(|&v| (v - m).exp()).sum();
    let top: Vec<String> = order[..5]
        .iter()
        .map(|&i| {
            format!(
                "{:?} {:.3}",
                tok.decode(&[i as u32]),
                (row[i] - m).exp() / z
            )
        })
        .collect();
    println!(
        "next-token check: {:?} ({} tokens) -> {}",
        args.prompt,
        prompt.len(),
        top.join(", ")
    );
    if args.check_only {
        return Ok(());
    }

    let text_path = args.text.as_ref().expect("checked");
    let text =
        std::fs::read_to_string(text_path).map_err(|e| format!("{}: {e}", text_path.display()))?;
    let t1 = Instant::now();
    let ids = tok.encode(&text);
    if tok.decode(&ids) != text {
        return Err("the tokenizer does not round-trip the text".into());
    }
    let windows: Vec<Vec<u32>> = ids
        .chunks_exact(args.ctx)
        .take(args.windows)
        .map(<[u32]>::to_vec)
        .collect();
    if windows.len() < args.windows {
        return Err(format!(
            "the text has only {} windows of {} tokens",
            windows.len(),
            args.ctx
        ));
    }
    eprintln!(
        "tokenized {} bytes into {} tokens in {:.1}s; {} windows of {} tokens",
        text.len(),
        ids.len(),
        t1.elapsed().as_secs_f64(),
        windows.len(),
        args.ctx
    );

    let runs = if args.runs.is_empty() {
        study::plan(&args.plan)?
    } else {
        args.runs.clone()
    };
    let meta = |wall: f64| {
        vec![
            (
                "model",
                args.model
                    .file_name()
                    .map_or(String::new(), |f| f.to_string_lossy().into_owned()),
            ),
            (
                "text",
                text_path
                    .file_name()
                    .map_or(String::new(), |f| f.to_string_lossy().into_owned()),
            ),
            ("text_tokens", ids.len().to_string()),
            ("windows", windows.len().to_string()),
            ("ctx", args.ctx.to_string()),
            ("threads", args.threads.to_string()),
            ("cpu", cpu_name()),
            ("wall_seconds", format!("{wall:.1}")),
            ("next_token_check", top.join(", ")),
        ]
    };
    let t2 = Instant::now();
    let finished = std::sync::Mutex::new(Vec::<RunResult>::new());
    let on_done = |r: &RunResult| {
        let mut done = finished.lock().expect("progress lock");
        done.push(r.clone());
        let rel = study::relative_change(&done, r)
            .map_or(String::new(), |v| format!(" ({:+.2}%)", v * 100.0));
        eprintln!(
            "[{:>4.0}s] tp{} {:<16} {:<28} ppl {:.3}{rel}  ({:.1}s)",
            t2.elapsed().as_secs_f64(),
            r.run.tp,
            r.run.algorithm(),
            r.run.mode.formats().map_or(String::new(), |(a, b)| {
                let f = if a == b {
                    a.to_string()
                } else {
                    format!("{a} / {b}")
                };
                if r.run.scope == Scope::ALL {
                    f
                } else {
                    format!("{f} @{}", r.run.scope)
                }
            }),
            r.ppl(),
            r.cpu_time.as_secs_f64()
        );
        if let Some(path) = &args.json {
            // Progress only: the final write below reports errors.
            if let Ok(text) = study::json(&done, &meta(t2.elapsed().as_secs_f64())) {
                let _ = std::fs::write(path, text);
            }
        }
    };
    let results = study::evaluate(&model, &Codec, &runs, &windows, args.threads, &on_done)?;
    let wall = t2.elapsed().as_secs_f64();
    println!(
        "\nWikiText-2 test, {} windows x {} tokens ({} predictions per setting), {} threads, {:.0}s\n",
        windows.len(),
        args.ctx,
        results.first().map_or(0, |r| r.tokens),
        args.threads,
        wall
    );
    print!("{}", study::markdown_table(&results));
    let ep = study::markdown_table_ep(&results);
    if !ep.is_empty() {
        println!("\nExpert parallelism (TP = 1), against the exact bf16 all-to-alls\n\n{ep}");
        for (dispatch, combine, name) in [
            (true, true, "dispatch + combine"),
            (true, false, "dispatch only"),
            (false, true, "combine only"),
        ] {
            let p = study::pivot_ep(&results, dispatch, combine);
            if !p.is_empty() {
                println!(
                    "\nEP, {name} quantized: PPL change vs exact (effective bits/value)\n\n{p}"
                );
            }
        }
    }
    let mut tps: Vec<usize> = results
        .iter()
        .filter(|r| !r.run.mode.is_ep())
        .map(|r| r.run.tp)
        .collect();
    tps.dedup();
    for tp in tps {
        for one_shot in [false, true] {
            let p = study::pivot_spikes_first(&results, tp, one_shot);
            if !p.is_empty() {
                let name = if one_shot { "one-shot" } else { "two-step" };
                println!(
                    "\nTP={tp}, {name} + srot: PPL change vs exact (effective bits/value)\n\n{p}"
                );
            }
        }
        for rotate in [false, true] {
            for one_shot in [false, true] {
                let p = study::pivot_rotated(&results, tp, one_shot, rotate);
                if !p.is_empty() {
                    let name = match (one_shot, rotate) {
                        (false, false) => "two-step",
                        (true, false) => "one-shot",
                        (false, true) => "two-step + rot",
                        (true, true) => "one-shot + rot",
                    };
                    println!(
                        "\nTP={tp}, {name}: PPL change vs exact (effective bits/value)\n\n{p}"
                    );
                }
            }
        }
    }
    if let Some(path) = &args.json {
        let text = study::json(&results, &meta(wall)).map_err(|e| format!("JSON: {e}"))?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flashcomm-tp-study: {e}");
            ExitCode::FAILURE
        }
    }
}
