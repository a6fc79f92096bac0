//! The perplexity study: runs a set of (tensor-parallel degree, all-reduce mode) settings over
//! windows of text, in parallel over jobs, and reports perplexities against the exact all-reduce.
//! The expert-parallel settings ([`Mode::Ep`]) are compared with the exact (`bf16`) all-to-alls.

use crate::collective::{Backend, ErrorStats, Mode, Scope, Simulated, Spec};
use crate::expert::Leg;
use crate::model::Model;
use serde::Serialize;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One setting of the study.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Run {
    /// Tensor-parallel degree (simulated ranks).
    pub tp: usize,
    /// How the partial sums are reduced.
    pub mode: Mode,
    /// The all-reduces the quantized mode applies to (the others are exact).
    pub scope: Scope,
    /// Whether the quantized all-reduces run on partials rotated group by group (see
    /// [`crate::rotation`]); ignored by the exact modes.
    pub rotate: bool,
    /// Whether the quantized all-reduces take each group's spikes out first and rotate and
    /// quantize the rest without spikes (see [`crate::spike_rotation`]); ignored by the exact
    /// modes. Takes precedence over `rotate`.
    pub spikes_first: bool,
}

impl Run {
    /// A setting whose quantized mode applies to every all-reduce.
    pub fn new(tp: usize, mode: Mode) -> Run {
        Run {
            tp,
            mode,
            scope: Scope::ALL,
            rotate: false,
            spikes_first: false,
        }
    }

    /// The same setting with the rotation of the quantization groups switched on or off.
    pub fn rotated(self, rotate: bool) -> Run {
        Run { rotate, ..self }
    }

    /// The same setting with "spikes first, then rotation" switched on or off.
    pub fn spikes_then_rotated(self, spikes_first: bool) -> Run {
        Run {
            spikes_first,
            ..self
        }
    }

    /// The algorithm's name, with `+ rot` when the groups are rotated and `+ srot` when the
    /// spikes are taken out before the rotation.
    pub fn algorithm(&self) -> String {
        let name = self.mode.algorithm();
        if self.mode.formats().is_none() {
            name.to_string()
        } else if let Mode::Grid(_, p) = self.mode {
            format!("{name} p{:.1}", f64::from(p) / 10.0)
        } else if self.spikes_first {
            format!("{name} + srot")
        } else if self.rotate {
            format!("{name} + rot")
        } else {
            name.to_string()
        }
    }
}

/// The outcome of one setting over all windows.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// The setting.
    pub run: Run,
    /// Sum of the negative log-likelihoods (nats).
    pub nll: f64,
    /// Number of predicted tokens.
    pub tokens: usize,
    /// All-reduce error statistics against the exact sum of the same inputs.
    pub stats: ErrorStats,
    /// Error statistics of the quantized dispatch all-to-alls against the exact `bf16` ones
    /// (expert-parallel settings with a quantized dispatch; empty otherwise).
    pub dispatch: ErrorStats,
    /// The same for the quantized combine all-to-alls.
    pub combine: ErrorStats,
    /// Effective bits per value of (reduce-scatter, all-gather) formats, for quantized modes.
    pub effective_bits: Option<(f64, f64)>,
    /// Time spent in this setting's jobs, summed over threads.
    pub cpu_time: Duration,
}

impl RunResult {
    /// Perplexity: `exp(mean NLL)`.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.tokens as f64).exp()
    }

    /// Mean effective bits per value on the wire (the two steps move equally many values).
    pub fn mean_effective_bits(&self) -> Option<f64> {
        self.effective_bits.map(|(a, b)| (a + b) / 2.0)
    }
}

fn spec(bits: u8, group: u16, spikes: u8) -> Spec {
    Spec {
        bits,
        group,
        spikes,
    }
}

/// The settings of a named plan.
///
/// * `tp2`: TP = 2, the f32 and exact references, two-step and one-shot at every width 2..=8,
///   group 32/64/128/256 and spikes 0/2, the mixed 4-bit reduce-scatter + 8-bit all-gather at
///   every group and spikes 0/2, and spikes 4 at widths 2, 3, 4 with groups 32 and 128.
/// * `tp48`: TP = 4 and 8, a smaller sweep: exact; two-step widths 2, 3, 4, 8 at groups 32 and
///   128 with spikes 0/2; one-shot widths 2, 3, 4 at groups 32 and 128 with spikes 2; mixed 4/8
///   at groups 32 and 128 with spikes 2.
/// * `full`: `tp2` then `tp48`.
/// * `rot`: TP = 2, exact, then two-step and one-shot at widths 2, 3, 4, groups 32, 64, 128 and
///   spikes 0/2, each with the rotation of the groups (see [`crate::rotation`]).
/// * `srot`: TP = 2, exact, then one-shot and two-step with 2 spikes taken out before the
///   rotation (see [`crate::spike_rotation`]) at 4-bit g32/g64/g128, 3-bit g32/g64, 2-bit g32.
/// * `oracle`: TP = 2, exact, then the bound of [`crate::oracle`] at widths 2..=6, groups 32 and
///   128, spikes 0 and 2.
/// * `quick`: TP = 2, exact, two-step widths 2, 3, 4, 8 at group 32 with spikes 2, one-shot
///   4-bit and mixed 4/8 at group 32 with spikes 2.
/// * `ep`: expert parallelism (see [`crate::expert`]): the `f32` and exact (`bf16`) all-to-alls,
///   then dispatch and combine both quantized at every width 2..=8, group 32/64/128/256 and
///   spikes 0/2/4, then dispatch alone and combine alone (the other one exact) at every width
///   2..=8, group 32/64/128/256 with spikes 2 and group 32/128 with spikes 0.
pub fn plan(name: &str) -> Result<Vec<Run>, String> {
    let mut runs = Vec::new();
    let two = |b, g, k| Mode::TwoStep {
        rs: spec(b, g, k),
        ag: spec(b, g, k),
    };
    let mixed = |g, k| Mode::TwoStep {
        rs: spec(4, g, k),
        ag: spec(8, g, k),
    };
    match name {
        "tp2" => {
            let tp = 2;
            runs.push(Run::new(tp, Mode::F32));
            runs.push(Run::new(tp, Mode::Lossless));
            for b in 2..=8 {
                for g in [32, 64, 128, 256] {
                    for k in [0, 2] {
                        runs.push(Run::new(tp, two(b, g, k)));
                    }
                }
            }
            for g in [32, 64, 128, 256] {
                for k in [0, 2] {
                    runs.push(Run::new(tp, mixed(g, k)));
                }
            }
            for b in [2, 3, 4] {
                for g in [32, 128] {
                    runs.push(Run::new(tp, two(b, g, 4)));
                }
            }
            for b in 2..=8 {
                for g in [32, 64, 128, 256] {
                    for k in [0, 2] {
                        runs.push(Run::new(tp, Mode::OneShot(spec(b, g, k))));
                    }
                }
            }
        }
        "tp48" => {
            for tp in [4, 8] {
                runs.push(Run::new(tp, Mode::Lossless));
                for b in [2, 3, 4, 8] {
                    for g in [32, 128] {
                        for k in [0, 2] {
                            runs.push(Run::new(tp, two(b, g, k)));
                        }
                    }
                }
                for b in [2, 3, 4] {
                    for g in [32, 128] {
                        runs.push(Run::new(tp, Mode::OneShot(spec(b, g, 2))));
                    }
                }
                for g in [32, 128] {
                    runs.push(Run::new(tp, mixed(g, 2)));
                }
            }
        }
        "rot" => {
            let tp = 2;
            runs.push(Run::new(tp, Mode::Lossless));
            for one_shot in [true, false] {
                for b in [4, 3, 2] {
                    for g in [32, 64, 128] {
                        for k in [0, 2] {
                            let mode = if one_shot {
                                Mode::OneShot(spec(b, g, k))
                            } else {
                                two(b, g, k)
                            };
                            runs.push(Run::new(tp, mode).rotated(true));
                        }
                    }
                }
            }
        }
        "srot" => {
            let tp = 2;
            runs.push(Run::new(tp, Mode::Lossless));
            for one_shot in [true, false] {
                for (b, g) in [(4, 32), (4, 64), (4, 128), (3, 32), (3, 64), (2, 32)] {
                    let mode = if one_shot {
                        Mode::OneShot(spec(b, g, 2))
                    } else {
                        two(b, g, 2)
                    };
                    runs.push(Run::new(tp, mode).spikes_then_rotated(true));
                }
            }
        }
        "oracle" => {
            let tp = 2;
            runs.push(Run::new(tp, Mode::Lossless));
            for b in [2, 3, 4, 5, 6] {
                for g in [32, 128] {
                    for k in [0, 2] {
                        runs.push(Run::new(tp, Mode::Oracle(spec(b, g, k))));
                    }
                }
            }
        }
        "ep" => {
            let ep = |dispatch, combine| Run::new(1, Mode::Ep { dispatch, combine });
            runs.push(ep(Leg::F32, Leg::F32));
            runs.push(ep(Leg::Exact, Leg::Exact));
            for b in 2..=8 {
                for g in [32, 64, 128, 256] {
                    for k in [0, 2, 4] {
                        let f = Leg::Quantized(spec(b, g, k));
                        runs.push(ep(f, f));
                    }
                }
            }
            for dispatch in [true, false] {
                let one = |f: Spec| {
                    let f = Leg::Quantized(f);
                    if dispatch {
                        ep(f, Leg::Exact)
                    } else {
                        ep(Leg::Exact, f)
                    }
                };
                for b in 2..=8 {
                    for g in [32, 64, 128, 256] {
                        runs.push(one(spec(b, g, 2)));
                    }
                    for g in [32, 128] {
                        runs.push(one(spec(b, g, 0)));
                    }
                }
            }
        }
        "full" => {
            runs = plan("tp2")?;
            runs.extend(plan("tp48")?);
        }
        "quick" => {
            let tp = 2;
            runs.push(Run::new(tp, Mode::Lossless));
            for b in [2, 3, 4, 8] {
                runs.push(Run::new(tp, two(b, 32, 2)));
            }
            runs.push(Run::new(tp, Mode::OneShot(spec(4, 32, 2))));
            runs.push(Run::new(tp, mixed(32, 2)));
        }
        other => {
            return Err(format!(
                "unknown plan {other:?} (tp2, tp48, full, quick, rot, srot, oracle, ep)"
            ));
        }
    }
    Ok(runs)
}

/// Parses one setting: `TP:exact`, `TP:f32`, `TP:two:B:G:K`, `TP:one:B:G:K`,
/// `TP:mixed:BRS:BAG:G:K`, `TP:oracle:B:G:K` (the bound of [`crate::oracle`]) or
/// `TP:grid:B:G:K:P` (the non-uniform grid of [`crate::grid`] with exponent P/10, P in 10..=40), e.g. `2:two:4:32:2`, optionally followed by `:rot` (quantized modes
/// only) to rotate the quantization groups (see [`crate::rotation`]), e.g. `2:one:4:128:2:rot`,
/// or by `:srot` to take each group's spikes out before rotating the rest (see
/// [`crate::spike_rotation`]), e.g. `2:one:4:32:2:srot`, and by `@SCOPE` (see [`Scope::parse`]) to quantize only some all-reduces, e.g.
/// `2:two:4:32:2@0-27:both` or `2:two:4:32:2:rot@0-27:both`.
///
/// The expert-parallel settings (TP = 1, see [`crate::expert`]) are `ep:f32`, `ep:exact`,
/// `ep:dispatch:B:G:K`, `ep:combine:B:G:K` and `ep:both:B:G:K`, optionally followed by
/// `@LAYERS:both` to quantize the all-to-alls of some layers only, e.g. `ep:both:4:128:2@0-27:both`.
pub fn parse_run(s: &str) -> Result<Run, String> {
    let (s, scope) = match s.split_once('@') {
        Some((run, scope)) => (run, Scope::parse(scope)?),
        None => (s, Scope::ALL),
    };
    if let Some(ep) = s.strip_prefix("ep:") {
        return parse_ep(ep, scope);
    }
    let (s, rotate, spikes_first) = if let Some(run) = s.strip_suffix(":srot") {
        (run, false, true)
    } else if let Some(run) = s.strip_suffix(":rot") {
        (run, true, false)
    } else {
        (s, false, false)
    };
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || {
        format!(
            "bad setting {s:?}: use TP:exact, TP:f32, TP:two:B:G:K, TP:one:B:G:K, TP:mixed:BRS:BAG:G:K, TP:oracle:B:G:K or TP:grid:B:G:K:P (P: 10..=40), the quantized ones optionally followed by :rot or (not the oracle or grid) :srot"
        )
    };
    let tp: usize = parts
        .first()
        .and_then(|t| t.parse().ok())
        .filter(|&t| t >= 1)
        .ok_or_else(bad)?;
    let num = |i: usize| -> Result<u16, String> {
        parts.get(i).and_then(|v| v.parse().ok()).ok_or_else(bad)
    };
    let mode = match (parts.get(1).copied(), parts.len()) {
        (Some("exact"), 2) => Mode::Lossless,
        (Some("f32"), 2) => Mode::F32,
        (Some("two"), 5) => {
            let f = spec(num(2)? as u8, num(3)?, num(4)? as u8);
            Mode::TwoStep { rs: f, ag: f }
        }
        (Some("one"), 5) => Mode::OneShot(spec(num(2)? as u8, num(3)?, num(4)? as u8)),
        (Some("oracle"), 5) => Mode::Oracle(spec(num(2)? as u8, num(3)?, num(4)? as u8)),
        (Some("grid"), 6) if (10..=40).contains(&num(5)?) => {
            Mode::Grid(spec(num(2)? as u8, num(3)?, num(4)? as u8), num(5)? as u8)
        }
        (Some("mixed"), 6) => Mode::TwoStep {
            rs: spec(num(2)? as u8, num(4)?, num(5)? as u8),
            ag: spec(num(3)? as u8, num(4)?, num(5)? as u8),
        },
        _ => return Err(bad()),
    };
    if (rotate || spikes_first) && mode.formats().is_none()
        || spikes_first && matches!(mode, Mode::Oracle(_) | Mode::Grid(..))
    {
        return Err(bad());
    }
    Ok(Run {
        tp,
        mode,
        scope,
        rotate,
        spikes_first,
    })
}

/// Parses the part of an expert-parallel setting after `ep:`.
fn parse_ep(s: &str, scope: Scope) -> Result<Run, String> {
    let bad = || {
        format!(
            "bad setting \"ep:{s}\": use ep:f32, ep:exact, ep:dispatch:B:G:K, ep:combine:B:G:K or ep:both:B:G:K, optionally followed by @LAYERS:both"
        )
    };
    if !(scope.o_proj && scope.down_proj) {
        return Err(bad());
    }
    let parts: Vec<&str> = s.split(':').collect();
    let format = || -> Result<Leg, String> {
        let num = |i: usize| -> Result<u16, String> {
            parts.get(i).and_then(|v| v.parse().ok()).ok_or_else(bad)
        };
        let (b, g, k) = (num(1)?, num(2)?, num(3)?);
        let narrow = |v: u16| u8::try_from(v).map_err(|_| bad());
        Ok(Leg::Quantized(spec(narrow(b)?, g, narrow(k)?)))
    };
    let (dispatch, combine) = match (parts[0], parts.len()) {
        ("f32", 1) => (Leg::F32, Leg::F32),
        ("exact", 1) => (Leg::Exact, Leg::Exact),
        ("dispatch", 4) => (format()?, Leg::Exact),
        ("combine", 4) => (Leg::Exact, format()?),
        ("both", 4) => (format()?, format()?),
        _ => return Err(bad()),
    };
    Ok(Run {
        scope,
        ..Run::new(1, Mode::Ep { dispatch, combine })
    })
}

/// Evaluates every setting over every window with `threads` worker threads (jobs are
/// (setting, window) pairs taken in order). `on_done` is called, from a worker thread, as soon as
/// a setting has all its windows. Results come back in the order of `runs`.
pub fn evaluate(
    model: &Model,
    backend: &dyn Backend,
    runs: &[Run],
    windows: &[Vec<u32>],
    threads: usize,
    on_done: &(dyn Fn(&RunResult) + Sync),
) -> Result<Vec<RunResult>, String> {
    let mut results = Vec::with_capacity(runs.len());
    for &run in runs {
        let effective_bits = match run.mode.formats() {
            None => None,
            Some((rs, ag)) => Some((backend.effective_bits(rs)?, backend.effective_bits(ag)?)),
        };
        results.push(RunResult {
            run,
            nll: 0.0,
            tokens: 0,
            stats: ErrorStats::default(),
            dispatch: ErrorStats::default(),
            combine: ErrorStats::default(),
            effective_bits,
            cpu_time: Duration::ZERO,
        });
    }
    let state = Mutex::new((results, vec![0usize; runs.len()]));
    let next = AtomicUsize::new(0);
    let jobs = runs.len() * windows.len();
    std::thread::scope(|threads_scope| {
        for _ in 0..threads.max(1) {
            threads_scope.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= jobs {
                        break;
                    }
                    let (r, w) = (j / windows.len(), j % windows.len());
                    let start = Instant::now();
                    let ar = Simulated::new(runs[r].tp, runs[r].mode, backend)
                        .with_scope(runs[r].scope)
                        .with_rotation(runs[r].rotate)
                        .with_spikes_first(runs[r].spikes_first)
                        .with_row(model.cfg.hidden);
                    let (nll, n) = model.nll(&windows[w], &ar);
                    let elapsed = start.elapsed();
                    let mut st = state.lock().expect("results lock");
                    let (results, done) = &mut *st;
                    let res = &mut results[r];
                    res.nll += nll;
                    res.tokens += n;
                    res.stats.merge(&ar.stats());
                    res.dispatch.merge(&ar.dispatch_stats());
                    res.combine.merge(&ar.combine_stats());
                    res.cpu_time += elapsed;
                    done[r] += 1;
                    if done[r] == windows.len() {
                        on_done(res);
                    }
                }
            });
        }
    });
    Ok(state.into_inner().expect("results lock").0)
}

/// The baseline of a setting, if it was run: the exact all-reduce at the same TP degree, or
/// for an expert-parallel setting the exact (`bf16`) all-to-alls.
fn baseline<'a>(results: &'a [RunResult], run: &Run) -> Option<&'a RunResult> {
    if run.mode.is_ep() {
        results.iter().find(|r| r.run.mode == Mode::EP_EXACT)
    } else {
        results
            .iter()
            .find(|r| r.run.tp == run.tp && r.run.mode == Mode::Lossless)
    }
}

/// The relative perplexity change the product aims for at a payload width, if any.
pub fn target(bits: u8) -> Option<f64> {
    match bits {
        2 => Some(0.15),
        3 => Some(0.03),
        4 => Some(0.01),
        _ => None,
    }
}

/// Relative change of a result's perplexity against the exact all-reduce at its TP degree (for
/// an expert-parallel setting: against the exact all-to-alls).
pub fn relative_change(results: &[RunResult], r: &RunResult) -> Option<f64> {
    baseline(results, &r.run).map(|b| r.ppl() / b.ppl() - 1.0)
}

fn target_cell(results: &[RunResult], r: &RunResult) -> String {
    if r.run.scope != Scope::ALL {
        return String::new();
    }
    let (Some((rs, _)), Some(rel)) = (r.run.mode.formats(), relative_change(results, r)) else {
        return String::new();
    };
    match target(rs.bits) {
        Some(t) if rel <= t => format!("met (≤{:.0}%)", t * 100.0),
        Some(t) => format!("missed (≤{:.0}%)", t * 100.0),
        None => String::new(),
    }
}

/// The results of the tensor-parallel settings as a markdown table (empty when there are none;
/// the expert-parallel settings are in [`markdown_table_ep`]).
pub fn markdown_table(results: &[RunResult]) -> String {
    let tp: Vec<&RunResult> = results.iter().filter(|r| !r.run.mode.is_ep()).collect();
    if tp.is_empty() {
        return String::new();
    }
    let scoped = tp.iter().any(|r| r.run.scope != Scope::ALL);
    let mut s = String::new();
    s.push_str("| TP | all-reduce | bits (RS/AG) | group | spikes |");
    if scoped {
        s.push_str(" quantized ARs (layers:sites) |");
    }
    s.push_str(" eff. bits/value | PPL | Δ vs exact | AR rel. L2 err | target |\n");
    s.push_str("|---:|---|---|---:|---:|");
    if scoped {
        s.push_str("---|");
    }
    s.push_str("---:|---:|---:|---:|---|\n");
    for r in tp {
        let (bits, group, spikes) = match r.run.mode.formats() {
            None => ("-".to_string(), "-".to_string(), "-".to_string()),
            Some((rs, ag)) if rs == ag => (
                rs.bits.to_string(),
                rs.group.to_string(),
                rs.spikes.to_string(),
            ),
            Some((rs, ag)) => (
                format!("{}/{}", rs.bits, ag.bits),
                rs.group.to_string(),
                rs.spikes.to_string(),
            ),
        };
        let eff = r
            .mean_effective_bits()
            .map_or("16 (bf16)".to_string(), |e| format!("{e:.3}"));
        let eff = if r.run.mode == Mode::F32 {
            "32 (f32)".to_string()
        } else {
            eff
        };
        let rel = relative_change(results, r).map_or(String::new(), change_cell);
        let l2 = if r.run.mode.formats().is_some() {
            format!("{:.2e}", r.stats.rel_l2())
        } else {
            String::new()
        };
        let scope = if scoped {
            format!(" {} |", r.run.scope)
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "| {} | {} | {bits} | {group} | {spikes} |{scope} {eff} | {:.3} | {rel} | {l2} | {} |",
            r.run.tp,
            r.run.algorithm(),
            r.ppl(),
            target_cell(results, r)
        );
    }
    s
}

/// The results of the expert-parallel settings as a markdown table (empty when there are none):
/// the quantized all-to-alls, their format and effective bits per value (of each quantized
/// all-to-all; an exact one moves 16), the perplexity and its change against the exact
/// all-to-alls, and each quantized all-to-all's relative L2 error against the exact one.
pub fn markdown_table_ep(results: &[RunResult]) -> String {
    let ep: Vec<&RunResult> = results.iter().filter(|r| r.run.mode.is_ep()).collect();
    if ep.is_empty() {
        return String::new();
    }
    let scoped = ep.iter().any(|r| r.run.scope != Scope::ALL);
    let mut s = String::new();
    s.push_str("| EP all-to-alls | bits | group | spikes |");
    if scoped {
        s.push_str(" quantized layers |");
    }
    s.push_str(
        " eff. bits/value | PPL | Δ vs exact | dispatch rel. L2 err | combine rel. L2 err | target |\n",
    );
    s.push_str("|---|---:|---:|---:|");
    if scoped {
        s.push_str("---|");
    }
    s.push_str("---:|---:|---:|---:|---:|---|\n");
    let l2 = |st: &ErrorStats| {
        if st.calls > 0 {
            format!("{:.2e}", st.rel_l2())
        } else {
            String::new()
        }
    };
    for r in ep {
        let Mode::Ep { dispatch, combine } = r.run.mode else {
            continue;
        };
        let (bits, group, spikes, eff) = match r.run.mode.formats() {
            Some((d, c)) if d == c => (
                d.bits.to_string(),
                d.group.to_string(),
                d.spikes.to_string(),
                r.mean_effective_bits()
                    .map_or(String::new(), |e| format!("{e:.3}")),
            ),
            Some((d, c)) => (
                format!("{}/{}", d.bits, c.bits),
                format!("{}/{}", d.group, c.group),
                format!("{}/{}", d.spikes, c.spikes),
                r.effective_bits
                    .map_or(String::new(), |(a, b)| format!("{a:.3}/{b:.3}")),
            ),
            None if dispatch == Leg::F32 && combine == Leg::F32 => {
                ("-".into(), "-".into(), "-".into(), "32 (f32)".into())
            }
            None => ("-".into(), "-".into(), "-".into(), "16 (bf16)".into()),
        };
        let rel = relative_change(results, r).map_or(String::new(), change_cell);
        let scope = if scoped {
            let layers = r.run.scope.to_string();
            let layers = layers.strip_suffix(":both").unwrap_or(&layers).to_string();
            format!(" {layers} |")
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "| {} | {bits} | {group} | {spikes} |{scope} {eff} | {:.3} | {rel} | {} | {} | {} |",
            r.run.algorithm(),
            r.ppl(),
            l2(&r.dispatch),
            l2(&r.combine),
            target_cell(results, r)
        );
    }
    s
}

/// Pivot tables of the relative perplexity change (percent) for one algorithm at one TP degree:
/// a row per width, a column per (group, spikes). Empty when no such results exist. Settings
/// with rotated groups are left out (see [`pivot_rotated`]).
pub fn pivot(results: &[RunResult], tp: usize, one_shot: bool) -> String {
    pivot_rotated(results, tp, one_shot, false)
}

/// [`pivot`] of the settings with (`rotate`) or without rotated groups (spikes not taken out
/// first).
pub fn pivot_rotated(results: &[RunResult], tp: usize, one_shot: bool, rotate: bool) -> String {
    pivot_where(results, tp, one_shot, rotate, false)
}

/// [`pivot`] of the settings whose spikes are taken out before the rotation.
pub fn pivot_spikes_first(results: &[RunResult], tp: usize, one_shot: bool) -> String {
    pivot_where(results, tp, one_shot, false, true)
}

fn pivot_where(
    results: &[RunResult],
    tp: usize,
    one_shot: bool,
    rotate: bool,
    spikes_first: bool,
) -> String {
    let pick = |b: u8, g: u16, k: u8| {
        results.iter().find(|r| {
            r.run.tp == tp
                && r.run.scope == Scope::ALL
                && r.run.spikes_first == spikes_first
                && (spikes_first || r.run.rotate == rotate)
                && match r.run.mode {
                    Mode::OneShot(f) => one_shot && f == spec(b, g, k),
                    Mode::TwoStep { rs, ag } => !one_shot && rs == ag && rs == spec(b, g, k),
                    _ => false,
                }
        })
    };
    pivot_by(results, pick)
}

/// Pivot table of the expert-parallel settings (all layers) that quantize the dispatch
/// all-to-all (`dispatch`), the combine all-to-all (`combine`), or both with the same format,
/// the other one exact. Empty when no such results exist.
pub fn pivot_ep(results: &[RunResult], dispatch: bool, combine: bool) -> String {
    let pick = |b: u8, g: u16, k: u8| {
        let f = Leg::Quantized(spec(b, g, k));
        let leg = |on: bool| if on { f } else { Leg::Exact };
        let want = Mode::Ep {
            dispatch: leg(dispatch),
            combine: leg(combine),
        };
        results
            .iter()
            .find(|r| r.run.scope == Scope::ALL && r.run.mode == want)
    };
    if !dispatch && !combine {
        return String::new();
    }
    pivot_by(results, pick)
}

/// A pivot table: a row per width, a column per (group, spikes) for which `pick` finds a result.
fn pivot_by<'a>(
    results: &[RunResult],
    pick: impl Fn(u8, u16, u8) -> Option<&'a RunResult>,
) -> String {
    let cols: Vec<(u16, u8)> = [32u16, 64, 128, 256]
        .into_iter()
        .flat_map(|g| [0u8, 2, 4].into_iter().map(move |k| (g, k)))
        .filter(|&(g, k)| (2..=8).any(|b| pick(b, g, k).is_some()))
        .collect();
    if cols.is_empty() {
        return String::new();
    }
    let mut s = String::from("| bits |");
    for (g, k) in &cols {
        let _ = write!(s, " g{g} k{k} |");
    }
    s.push_str("\n|---:|");
    s.push_str(&"---:|".repeat(cols.len()));
    s.push('\n');
    for b in 2..=8u8 {
        if !cols.iter().any(|&(g, k)| pick(b, g, k).is_some()) {
            continue;
        }
        let _ = write!(s, "| {b} |");
        for &(g, k) in &cols {
            match pick(b, g, k).and_then(|r| relative_change(results, r).map(|v| (v, r))) {
                Some((v, r)) => {
                    let _ = write!(
                        s,
                        " {} ({:.3}) |",
                        change_cell(v),
                        r.mean_effective_bits().unwrap_or(0.0)
                    );
                }
                None => s.push_str(" |"),
            }
        }
        s.push('\n');
    }
    s
}

/// A relative change for a table cell: a percentage up to +100%, a ratio of perplexities above.
pub fn change_cell(v: f64) -> String {
    if v < 1.0 {
        format!("{:+.2}%", v * 100.0)
    } else if v < 99.0 {
        format!("×{:.1}", v + 1.0)
    } else {
        format!("×{:.0}", v + 1.0)
    }
}

/// A quantized step's format in the JSON file.
#[derive(Serialize)]
struct JsonSpec {
    bits: u8,
    group: u16,
    spikes: u8,
}

impl From<Spec> for JsonSpec {
    fn from(f: Spec) -> JsonSpec {
        JsonSpec {
            bits: f.bits,
            group: f.group,
            spikes: f.spikes,
        }
    }
}

/// One quantized all-to-all's statistics in the JSON file (see [`crate::expert::send`]).
#[derive(Serialize)]
struct JsonLeg {
    format: JsonSpec,
    effective_bits: Option<f64>,
    rel_l2_error: f64,
    rel_l2_error_after_first_token: f64,
    max_abs_error: f64,
    max_abs_input: f64,
    max_error_over_codec_bound: f64,
    calls: u64,
}

/// The expert-parallel part of a setting's result: each all-to-all's leg (`f32`, `bf16`, or the
/// quantized leg's statistics).
#[derive(Serialize)]
struct JsonEp {
    dispatch: serde_json::Value,
    combine: serde_json::Value,
}

fn json_leg(leg: Leg, st: &ErrorStats, eff: Option<f64>) -> serde_json::Value {
    match leg {
        Leg::F32 => "f32".into(),
        Leg::Exact => "bf16".into(),
        Leg::Quantized(f) => serde_json::to_value(JsonLeg {
            format: f.into(),
            effective_bits: eff,
            rel_l2_error: st.rel_l2(),
            rel_l2_error_after_first_token: st.rel_l2_rest(),
            max_abs_error: st.max_abs_err,
            max_abs_input: st.max_abs_input,
            max_error_over_codec_bound: st.max_err_over_bound,
            calls: st.calls,
        })
        .unwrap_or(serde_json::Value::Null),
    }
}

/// One setting's result in the JSON file. Non-finite numbers are written as `null` (serde_json's
/// rule), as are the fields that do not apply to the setting.
#[derive(Serialize)]
struct JsonResult {
    tp: usize,
    algorithm: &'static str,
    rotation: bool,
    spikes_first: bool,
    grid_exponent: Option<f64>,
    scope: String,
    rs: Option<JsonSpec>,
    ag: Option<JsonSpec>,
    effective_bits_rs: Option<f64>,
    effective_bits_ag: Option<f64>,
    effective_bits: Option<f64>,
    ppl: f64,
    nll_sum: f64,
    tokens: usize,
    relative_change: Option<f64>,
    ar_rel_l2_error: f64,
    ar_rel_l2_error_after_first_token: f64,
    ar_max_abs_error: f64,
    max_abs_partial: f64,
    allreduce_calls: u64,
    cpu_seconds: f64,
    /// Only for the expert-parallel settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    ep: Option<JsonEp>,
}

/// The run metadata, written as the first keys of the JSON object in the order given.
struct JsonMeta<'a>(&'a [(&'a str, String)]);

impl Serialize for JsonMeta<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

#[derive(Serialize)]
struct JsonDoc<'a> {
    #[serde(flatten)]
    meta: JsonMeta<'a>,
    results: Vec<JsonResult>,
}

/// The results as JSON (an object with the run metadata and one entry per setting).
///
/// # Errors
///
/// Only if serde_json fails to serialize (it does not for these plain structs).
pub fn json(results: &[RunResult], meta: &[(&str, String)]) -> Result<String, serde_json::Error> {
    let rows = results
        .iter()
        .map(|r| {
            let ep = match r.run.mode {
                Mode::Ep { dispatch, combine } => Some(JsonEp {
                    dispatch: json_leg(dispatch, &r.dispatch, r.effective_bits.map(|e| e.0)),
                    combine: json_leg(combine, &r.combine, r.effective_bits.map(|e| e.1)),
                }),
                _ => None,
            };
            // The expert-parallel settings have no quantized all-reduce: their formats are
            // those of `ep`.
            let formats = r.run.mode.formats().filter(|_| ep.is_none());
            JsonResult {
                tp: r.run.tp,
                algorithm: r.run.mode.algorithm(),
                rotation: r.run.rotate,
                spikes_first: r.run.spikes_first,
                grid_exponent: match r.run.mode {
                    Mode::Grid(_, p) => Some(f64::from(p) / 10.0),
                    _ => None,
                },
                scope: r.run.scope.to_string(),
                rs: formats.map(|(rs, _)| rs.into()),
                ag: formats.map(|(_, ag)| ag.into()),
                effective_bits_rs: r.effective_bits.filter(|_| ep.is_none()).map(|e| e.0),
                effective_bits_ag: r.effective_bits.filter(|_| ep.is_none()).map(|e| e.1),
                effective_bits: r.mean_effective_bits(),
                ppl: r.ppl(),
                nll_sum: r.nll,
                tokens: r.tokens,
                relative_change: relative_change(results, r),
                ar_rel_l2_error: r.stats.rel_l2(),
                ar_rel_l2_error_after_first_token: r.stats.rel_l2_rest(),
                ar_max_abs_error: r.stats.max_abs_err,
                max_abs_partial: r.stats.max_abs_input,
                allreduce_calls: r.stats.calls,
                // Milliseconds are all the precision a CPU time needs.
                cpu_seconds: (r.cpu_time.as_secs_f64() * 1e3).round() / 1e3,
                ep,
            }
        })
        .collect();
    let doc = JsonDoc {
        meta: JsonMeta(meta),
        results: rows,
    };
    serde_json::to_string_pretty(&doc).map(|t| t + "\n")
}
