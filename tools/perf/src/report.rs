//! Rows, the nccl-tests-style table, the latency table and the JSON document.
//!
//! A row's first columns are exactly nccl-tests' (`size(B) count(elements) type redop root`, then
//! `time(us) algbw(GB/s) busbw(GB/s) #wrong` for out-of-place and, with `--inplace 1`, again for
//! in-place), so scripts written for nccl-tests read them. flashcomm's columns follow: the error
//! columns of quantized rows (`relL2 maxerr effbits`), time ratios (`vs_nccl`, `vs_copy`,
//! `vs_ref`: over the plain reference AllReduce of the same run, `vs_link`: over the PCIe link's
//! time for the same bytes, with `--transport host`, `vs_best`: flashcomm's rows over the fastest
//! competitor of the same run), and
//! three labels (`impl launch plan`). Columns that do not apply print `N/A`, as nccl-tests does.
//!
//! The `pull-best` rows are derived, not measured: once both pull reference rows of a size are
//! in ([`Table::add`]), the faster one is repeated under that name.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::accuracy::AccuracyStats;
use crate::args::{Collective, Dtype, Launch, RefLaunch, Width};
use crate::sweep::{TimeStats, algbw, busbw};

/// What a row measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// cuMemcpyDtoDAsync of the same bytes on one rank's GPU.
    Copy,
    /// The real NCCL.
    Nccl,
    /// flashcomm, lossless.
    Lossless,
    /// flashcomm, quantized (AllReduce, or the one-step AllGather, ReduceScatter, AllToAll).
    Quant(Width),
    /// The plain reference AllReduce (`--impl reference`), launched per rank or as one grid.
    Reference(RefLaunch),
    /// The pull reference AllReduce (`--impl pull-reference`): one of its two kernels, or the
    /// better of the two at that size (derived).
    Pull(PullRow, RefLaunch),
    /// The host link's ceiling for the same bytes on one rank's GPU: a copy-engine copy into
    /// pinned host memory and back (`--transport host`), the two PCIe crossings every byte of
    /// the host transport makes.
    Link,
    /// The host link with both directions at once: the same bytes copied into pinned host
    /// memory on one stream while as many are copied out of it on another (`--transport host`):
    /// what the link carries when it is busy both ways, as the host transport keeps it.
    LinkBoth,
    /// The host link's latency (`--transport host`): one round trip of a flag through pinned
    /// host memory between two blocks of rank 0's GPU, launched and timed as every row is: the
    /// least a call that waits for a peer across the link can take, at any size.
    LinkRtt,
}

/// Which row of the pull reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PullRow {
    /// The 1-stage kernel (every rank loads and sums all inputs).
    OneStage,
    /// The 2-stage kernel (reduce-scatter and all-gather by loads).
    TwoStage,
    /// The faster of the two at that size, type and launch mode, as measured in the same run.
    Best,
}

impl PullRow {
    /// `1stage`, `2stage`, `best`.
    pub fn name(self) -> &'static str {
        match self {
            PullRow::OneStage => "1stage",
            PullRow::TwoStage => "2stage",
            PullRow::Best => "best",
        }
    }
}

impl Variant {
    /// The `impl` column.
    pub fn label(&self) -> String {
        let grid = |l: &RefLaunch| match l {
            RefLaunch::PerRank => "",
            RefLaunch::Single => "-1grid",
        };
        match self {
            Variant::Copy => "copy".into(),
            Variant::Nccl => "nccl".into(),
            Variant::Lossless => "flashcomm".into(),
            Variant::Quant(w) => format!("flashcomm-q{w}"),
            Variant::Reference(l) => format!("reference{}", grid(l)),
            Variant::Pull(r, l) => format!("pull-{}{}", r.name(), grid(l)),
            Variant::Link => "link".into(),
            Variant::LinkBoth => "link-both".into(),
            Variant::LinkRtt => "link-rtt".into(),
        }
    }

    /// Whether the row is a baseline that rank 0 times alone and that is no collective (the
    /// copy and the link rows).
    pub fn is_baseline(&self) -> bool {
        matches!(
            self,
            Variant::Copy | Variant::Link | Variant::LinkBoth | Variant::LinkRtt
        )
    }

    /// Whether the row is flashcomm's (lossless or quantized).
    pub fn is_flashcomm(&self) -> bool {
        matches!(self, Variant::Lossless | Variant::Quant(_))
    }

    /// Whether the row times every rank in one grid launched by one thread.
    pub fn single_grid(&self) -> bool {
        matches!(
            self,
            Variant::Reference(RefLaunch::Single) | Variant::Pull(_, RefLaunch::Single)
        )
    }

    /// Whether the row repeats another row's measurement (`pull-best`): not counted in the
    /// footer's `#wrong` total.
    pub fn derived(&self) -> bool {
        matches!(self, Variant::Pull(PullRow::Best, _))
    }

    /// Whether the row is a competitor that `vs_best` takes: NCCL and the reference kernels
    /// launched per rank, as an application's ranks launch (one-grid rows measure what per-rank
    /// launching costs; `pull-best` repeats a measured row).
    pub fn competitor(&self) -> bool {
        matches!(
            self,
            Variant::Nccl
                | Variant::Reference(RefLaunch::PerRank)
                | Variant::Pull(PullRow::OneStage | PullRow::TwoStage, RefLaunch::PerRank)
        )
    }
}

/// Codec settings of a quantized row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantInfo {
    /// Widths.
    pub width: Width,
    /// Values per group.
    pub group: u16,
    /// Spikes per group.
    pub spikes: u8,
    /// Wire bits per value of the first (or only) step, metadata included.
    pub effbits_rs: f64,
    /// Wire bits per value of the all-gather step.
    pub effbits_ag: f64,
}

/// One timed and checked measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Measure {
    /// Per-call times.
    pub time: TimeStats,
    /// Wrong elements (`None`: not checked).
    pub wrong: Option<u64>,
    /// Bytes of any rank's result that differ from rank 0's (`None`: not compared).
    pub rank_mismatch_bytes: Option<u64>,
    /// Error statistics of quantized calls.
    pub accuracy: Option<AccuracyStats>,
}

impl Measure {
    /// `#wrong`: checked elements that are wrong plus bytes that differ across ranks.
    pub fn wrong_total(&self) -> Option<u64> {
        match (self.wrong, self.rank_mismatch_bytes) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        }
    }
}

/// A measurement, or why there is none.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Measured.
    Done(Measure),
    /// Not measured (the reason is printed once and kept in the JSON file).
    Skipped(String),
}

impl Outcome {
    /// The measurement, if any.
    pub fn measure(&self) -> Option<&Measure> {
        match self {
            Outcome::Done(m) => Some(m),
            Outcome::Skipped(_) => None,
        }
    }
}

/// One line of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// What was measured.
    pub variant: Variant,
    /// Eager or graph.
    pub launch: Launch,
    /// Element type.
    pub dtype: Dtype,
    /// Collective.
    pub coll: Collective,
    /// Ranks.
    pub nranks: u32,
    /// `size(B)`.
    pub bytes: u64,
    /// `count(elements)`.
    pub count: u64,
    /// Algorithm and protocol flashcomm chose (`oneshot/ll`, ...).
    pub plan: Option<String>,
    /// Codec settings of quantized rows.
    pub quant: Option<QuantInfo>,
    /// Out-of-place.
    pub out: Outcome,
    /// In-place (`None` when not asked for).
    pub inplace: Option<Outcome>,
    /// Out-of-place time over NCCL's at the same size, type and launch mode.
    pub vs_nccl: Option<f64>,
    /// Out-of-place time over the copy baseline's at the same size, type and launch mode.
    pub vs_copy: Option<f64>,
    /// Out-of-place time over the reference AllReduce's at the same size, type and launch mode.
    pub vs_ref: Option<f64>,
    /// Out-of-place time over the host link's for the same bytes, type and launch mode.
    pub vs_link: Option<f64>,
    /// flashcomm's rows: out-of-place time over the fastest competitor's (NCCL, the reference
    /// kernels launched per rank) at the same size, type and launch mode.
    pub vs_best: Option<f64>,
}

impl Row {
    fn redop(&self) -> &'static str {
        match (self.variant, self.coll) {
            (v, _) if v.is_baseline() => "none",
            (_, Collective::AllGather | Collective::AlltoAll) => "none",
            _ => "sum",
        }
    }

    /// algbw of a measurement of this row.
    pub fn algbw(&self, m: &Measure) -> f64 {
        algbw(self.bytes, m.time.median_us)
    }

    /// busbw of a measurement of this row (N/A for the copy and link baselines: they are not
    /// collectives).
    pub fn busbw(&self, m: &Measure) -> Option<f64> {
        (!self.variant.is_baseline())
            .then(|| busbw(self.coll, self.nranks, self.bytes, m.time.median_us))
    }
}

/// Which optional column groups the table has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// In-place columns.
    pub inplace: bool,
    /// relL2, maxerr, effbits.
    pub quant: bool,
    /// vs_nccl.
    pub vs_nccl: bool,
    /// vs_copy.
    pub vs_copy: bool,
    /// vs_ref.
    pub vs_ref: bool,
    /// vs_link.
    pub vs_link: bool,
    /// vs_best.
    pub vs_best: bool,
}

/// nccl-tests-like time: two decimals below 1 ms, one below 100 ms, none above.
pub fn fmt_time(us: f64) -> String {
    if !us.is_finite() {
        "N/A".into()
    } else if us >= 1e5 {
        format!("{us:.0}")
    } else if us >= 1e3 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

fn fmt_sci(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2e}")
    } else {
        "N/A".into()
    }
}

fn fmt_effbits(q: &QuantInfo) -> String {
    if q.width.rs == q.width.ag {
        format!("{:.3}", q.effbits_rs)
    } else {
        format!("{:.3}/{:.3}", q.effbits_rs, q.effbits_ag)
    }
}

const W_SIZE: usize = 12;
const W_COUNT: usize = 12;
const W_TYPE: usize = 9;
const W_OP: usize = 6;
const W_ROOT: usize = 6;
const W_TIME: usize = 9;
const W_BW: usize = 8;
const W_WRONG: usize = 7;
const W_SCI: usize = 9;
const W_EFF: usize = 11;
const W_RATIO: usize = 8;

fn group_cells(row: &Row, o: &Outcome) -> String {
    match o.measure() {
        Some(m) => format!(
            "  {:>W_TIME$} {:>W_BW$.2} {:>W_BW$} {:>W_WRONG$}",
            fmt_time(m.time.median_us),
            row.algbw(m),
            row.busbw(m)
                .map_or_else(|| "N/A".to_string(), |b| format!("{b:.2}")),
            m.wrong_total()
                .map_or_else(|| "N/A".to_string(), |w| w.to_string()),
        ),
        None => format!(
            "  {:>W_TIME$} {:>W_BW$} {:>W_BW$} {:>W_WRONG$}",
            "N/A", "N/A", "N/A", "N/A"
        ),
    }
}

/// The header lines (each starts with `#`).
pub fn header(layout: &Layout) -> Vec<String> {
    let lead = W_SIZE + 2 + W_COUNT + 2 + W_TYPE + 2 + W_OP + 2 + W_ROOT;
    let group_w = 2 + W_TIME + 2 * W_BW + W_WRONG + 3;
    let mut top = format!("#{:lead$}", "");
    top.push_str(&format!("{:>group_w$}", "out-of-place"));
    if layout.inplace {
        top.push_str(&format!("{:>group_w$}", "in-place"));
    }
    let mut names = format!(
        "#{:>w1$}  {:>W_COUNT$}  {:>W_TYPE$}  {:>W_OP$}  {:>W_ROOT$}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        w1 = W_SIZE - 1
    );
    let mut units = format!(
        "#{:>w1$}  {:>W_COUNT$}  {:>W_TYPE$}  {:>W_OP$}  {:>W_ROOT$}",
        "(B)",
        "(elements)",
        "",
        "",
        "",
        w1 = W_SIZE - 1
    );
    let groups = if layout.inplace { 2 } else { 1 };
    for _ in 0..groups {
        names.push_str(&format!(
            "  {:>W_TIME$} {:>W_BW$} {:>W_BW$} {:>W_WRONG$}",
            "time", "algbw", "busbw", "#wrong"
        ));
        units.push_str(&format!(
            "  {:>W_TIME$} {:>W_BW$} {:>W_BW$} {:>W_WRONG$}",
            "(us)", "(GB/s)", "(GB/s)", ""
        ));
    }
    if layout.quant {
        names.push_str(&format!(
            "  {:>W_SCI$} {:>W_SCI$} {:>W_EFF$}",
            "relL2", "maxerr", "effbits"
        ));
        units.push_str(&format!(
            "  {:>W_SCI$} {:>W_SCI$} {:>W_EFF$}",
            "", "", "(b/value)"
        ));
    }
    if layout.vs_nccl {
        names.push_str(&format!(" {:>W_RATIO$}", "vs_nccl"));
        units.push_str(&format!(" {:>W_RATIO$}", "(time)"));
    }
    if layout.vs_copy {
        names.push_str(&format!(" {:>W_RATIO$}", "vs_copy"));
        units.push_str(&format!(" {:>W_RATIO$}", "(time)"));
    }
    if layout.vs_ref {
        names.push_str(&format!(" {:>W_RATIO$}", "vs_ref"));
        units.push_str(&format!(" {:>W_RATIO$}", "(time)"));
    }
    if layout.vs_link {
        names.push_str(&format!(" {:>W_RATIO$}", "vs_link"));
        units.push_str(&format!(" {:>W_RATIO$}", "(time)"));
    }
    if layout.vs_best {
        names.push_str(&format!(" {:>W_RATIO$}", "vs_best"));
        units.push_str(&format!(" {:>W_RATIO$}", "(time)"));
    }
    names.push_str("  impl               launch  plan");
    vec![top, names, units]
}

/// One table line.
pub fn format_row(layout: &Layout, row: &Row) -> String {
    let mut s = format!(
        "{:>W_SIZE$}  {:>W_COUNT$}  {:>W_TYPE$}  {:>W_OP$}  {:>W_ROOT$}",
        row.bytes,
        row.count,
        row.dtype.long_name(),
        row.redop(),
        -1
    );
    s.push_str(&group_cells(row, &row.out));
    if layout.inplace {
        let na = Outcome::Skipped("N/A".into());
        s.push_str(&group_cells(row, row.inplace.as_ref().unwrap_or(&na)));
    }
    if layout.quant {
        let acc = row.out.measure().and_then(|m| m.accuracy.as_ref());
        let (l2, mx) = acc.map_or(("N/A".to_string(), "N/A".to_string()), |a| {
            (fmt_sci(a.rel_l2), fmt_sci(a.max_err))
        });
        // A row of `--quant-choice auto` that ran the lossless kernels moved no quantized bytes.
        let lossless = row
            .plan
            .as_deref()
            .is_some_and(|p| p.starts_with("lossless:"));
        let eff = match row.quant.as_ref() {
            Some(q) if !lossless => fmt_effbits(q),
            _ => "N/A".to_string(),
        };
        s.push_str(&format!("  {l2:>W_SCI$} {mx:>W_SCI$} {eff:>W_EFF$}"));
    }
    let ratio = |r: Option<f64>| r.map_or("N/A".to_string(), |v| format!("{v:.3}"));
    if layout.vs_nccl {
        s.push_str(&format!(" {:>W_RATIO$}", ratio(row.vs_nccl)));
    }
    if layout.vs_copy {
        s.push_str(&format!(" {:>W_RATIO$}", ratio(row.vs_copy)));
    }
    if layout.vs_ref {
        s.push_str(&format!(" {:>W_RATIO$}", ratio(row.vs_ref)));
    }
    if layout.vs_link {
        s.push_str(&format!(" {:>W_RATIO$}", ratio(row.vs_link)));
    }
    if layout.vs_best {
        s.push_str(&format!(" {:>W_RATIO$}", ratio(row.vs_best)));
    }
    s.push_str(&format!(
        "  {:<17}  {:<6}  {}",
        row.variant.label(),
        row.launch.name(),
        row.plan.as_deref().unwrap_or("-")
    ));
    s
}

/// The rows of a run, with the ratios filled in as rows arrive (the baselines of a size are
/// measured before flashcomm's rows of that size).
#[derive(Debug, Default)]
pub struct Table {
    /// Rows in the order they were measured.
    pub rows: Vec<Row>,
    skip_notes: Vec<String>,
}

impl Table {
    /// Adds a row and returns the lines to print for it: the row, or a one-time note for a
    /// skipped one. A pull reference row whose partner (the other kernel, same size, type and
    /// launch mode) is already in also adds the derived `pull-best` row after it.
    pub fn add(&mut self, layout: &Layout, row: Row) -> Vec<String> {
        let best = match row.variant {
            Variant::Pull(r @ (PullRow::OneStage | PullRow::TwoStage), l) => {
                let partner = Variant::Pull(
                    if r == PullRow::OneStage {
                        PullRow::TwoStage
                    } else {
                        PullRow::OneStage
                    },
                    l,
                );
                self.find(partner, row.dtype, row.bytes, row.launch)
                    .map(|p| best_of(&row, p, l))
            }
            _ => None,
        };
        let mut lines = self.add_one(layout, row);
        if let Some(b) = best {
            lines.extend(self.add_one(layout, b));
        }
        lines
    }

    /// The row of `v` at this type, size and launch mode.
    fn find(&self, v: Variant, dtype: Dtype, bytes: u64, launch: Launch) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.variant == v && r.dtype == dtype && r.bytes == bytes && r.launch == launch)
    }

    fn add_one(&mut self, layout: &Layout, mut row: Row) -> Vec<String> {
        let t = row.out.measure().map(|m| m.time.median_us);
        let time = |r: &Row| r.out.measure().map(|m| m.time.median_us);
        let (dtype, bytes, launch) = (row.dtype, row.bytes, row.launch);
        let base = |v: Variant| self.find(v, dtype, bytes, launch).and_then(time);
        if row.variant != Variant::Nccl {
            row.vs_nccl = t.zip(base(Variant::Nccl)).map(|(a, b)| a / b);
        }
        if row.variant != Variant::Copy {
            row.vs_copy = t.zip(base(Variant::Copy)).map(|(a, b)| a / b);
        }
        let yardstick = Variant::Reference(RefLaunch::PerRank);
        if !matches!(row.variant, Variant::Copy) && row.variant != yardstick {
            row.vs_ref = t.zip(base(yardstick)).map(|(a, b)| a / b);
        }
        if !matches!(
            row.variant,
            Variant::Copy | Variant::Link | Variant::LinkRtt
        ) {
            row.vs_link = t.zip(base(Variant::Link)).map(|(a, b)| a / b);
        }
        if row.variant.is_flashcomm() {
            let best = self
                .rows
                .iter()
                .filter(|r| {
                    r.variant.competitor()
                        && r.dtype == dtype
                        && r.bytes == bytes
                        && r.launch == launch
                })
                .filter_map(time)
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))));
            row.vs_best = t.zip(best).map(|(a, b)| a / b);
        }
        let lines = match &row.out {
            Outcome::Done(_) => vec![format_row(layout, &row)],
            Outcome::Skipped(why) => {
                let note = format!(
                    "# {} {}: skipped: {why}",
                    row.variant.label(),
                    row.dtype.long_name()
                );
                if self.skip_notes.contains(&note) {
                    Vec::new()
                } else {
                    self.skip_notes.push(note.clone());
                    vec![note]
                }
            }
        };
        self.rows.push(row);
        lines
    }

    /// Total of `#wrong` over every measurement (derived rows repeat a measured row's).
    pub fn wrong_total(&self) -> u64 {
        self.rows
            .iter()
            .filter(|r| !r.variant.derived())
            .flat_map(|r| std::iter::once(&r.out).chain(r.inplace.iter()))
            .filter_map(|o| o.measure().and_then(Measure::wrong_total))
            .sum()
    }

    /// Footer lines in nccl-tests' words, one average per variant and launch mode.
    pub fn footer(&self) -> Vec<String> {
        let wrong = self.wrong_total();
        let mut out = vec![format!(
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        )];
        let mut avg: BTreeMap<(String, &'static str), (f64, usize)> = BTreeMap::new();
        for r in &self.rows {
            for o in std::iter::once(&r.out).chain(r.inplace.iter()) {
                if let Some(b) = o.measure().and_then(|m| r.busbw(m)) {
                    let e = avg
                        .entry((r.variant.label(), r.launch.name()))
                        .or_insert((0.0, 0));
                    e.0 += b;
                    e.1 += 1;
                }
            }
        }
        for ((label, launch), (sum, n)) in avg {
            out.push(format!(
                "# Avg bus bandwidth    : {:.4}  ({label}, {launch})",
                sum / n as f64
            ));
        }
        out
    }
}

/// The `pull-best` row of two pull reference rows of one size, type and launch mode: the faster
/// measured one under the derived name (its plan says which kernel it was), with the ratios left
/// for [`Table::add`] to fill in.
fn best_of(a: &Row, b: &Row, launch: RefLaunch) -> Row {
    let t = |r: &Row| r.out.measure().map(|m| m.time.median_us);
    let pick = match (t(a), t(b)) {
        (Some(x), Some(y)) => Some(if y < x { b } else { a }),
        (Some(_), None) => Some(a),
        (None, Some(_)) => Some(b),
        (None, None) => None,
    };
    let mut row = pick.unwrap_or(a).clone();
    if pick.is_none() {
        row.out = Outcome::Skipped("neither pull reference kernel was measured".into());
        row.plan = None;
    }
    row.variant = Variant::Pull(PullRow::Best, launch);
    row.vs_nccl = None;
    row.vs_copy = None;
    row.vs_ref = None;
    row.vs_link = None;
    row.vs_best = None;
    row
}

/// One line of the latency table (`--preset latency`).
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyRow {
    /// Message bytes.
    pub bytes: u64,
    /// flashcomm, eager, median per call.
    pub fc_eager: Option<f64>,
    /// Copy, eager.
    pub copy_eager: Option<f64>,
    /// flashcomm, graph, per call.
    pub fc_graph: Option<f64>,
    /// Copy, graph.
    pub copy_graph: Option<f64>,
}

/// Builds the latency table from lossless flashcomm rows and copy rows (first datatype only).
pub fn latency_rows(rows: &[Row]) -> Vec<LatencyRow> {
    let Some(dtype) = rows.first().map(|r| r.dtype) else {
        return Vec::new();
    };
    let mut sizes: Vec<u64> = rows
        .iter()
        .filter(|r| r.dtype == dtype)
        .map(|r| r.bytes)
        .collect();
    sizes.dedup();
    let find = |bytes: u64, v: Variant, l: Launch| {
        rows.iter()
            .find(|r| r.dtype == dtype && r.bytes == bytes && r.variant == v && r.launch == l)
            .and_then(|r| r.out.measure())
            .map(|m| m.time.median_us)
    };
    sizes
        .into_iter()
        .map(|b| LatencyRow {
            bytes: b,
            fc_eager: find(b, Variant::Lossless, Launch::Eager),
            copy_eager: find(b, Variant::Copy, Launch::Eager),
            fc_graph: find(b, Variant::Lossless, Launch::Graph),
            copy_graph: find(b, Variant::Copy, Launch::Graph),
        })
        .collect()
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).map(|(a, b)| a / b)
}

/// Formats the latency table.
pub fn format_latency(title: &str, rows: &[LatencyRow]) -> Vec<String> {
    let cell = |v: Option<f64>| v.map_or("N/A".to_string(), fmt_time);
    let r = |v: Option<f64>| v.map_or("N/A".to_string(), |x| format!("{x:.2}"));
    let mut out = vec![
        format!("# {title}"),
        format!(
            "#{:>11}  {:>12}  {:>12}  {:>7}  {:>12}  {:>12}  {:>7}",
            "size(B)", "fc eager", "copy eager", "ratio", "fc graph", "copy graph", "ratio"
        ),
        format!(
            "#{:>11}  {:>12}  {:>12}  {:>7}  {:>12}  {:>12}  {:>7}",
            "", "(us/call)", "(us/call)", "fc/copy", "(us/call)", "(us/call)", "fc/copy"
        ),
    ];
    for l in rows {
        out.push(format!(
            "{:>12}  {:>12}  {:>12}  {:>7}  {:>12}  {:>12}  {:>7}",
            l.bytes,
            cell(l.fc_eager),
            cell(l.copy_eager),
            r(ratio(l.fc_eager, l.copy_eager)),
            cell(l.fc_graph),
            cell(l.copy_graph),
            r(ratio(l.fc_graph, l.copy_graph)),
        ));
    }
    out
}

/// A measurement in the JSON file. Times and bandwidths that are not finite are written as `null`
/// (serde_json's rule for non-finite floats).
#[derive(Serialize)]
#[serde(untagged)]
enum OutcomeJson<'a> {
    Skipped {
        skipped: &'a str,
    },
    Done {
        time_us: f64,
        time_us_mean: f64,
        time_us_min: f64,
        time_us_max: f64,
        samples: usize,
        algbw_gbs: f64,
        busbw_gbs: Option<f64>,
        wrong: Option<u64>,
        wrong_elements: Option<u64>,
        rank_mismatch_bytes: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        accuracy: Option<AccuracyJson>,
    },
}

/// Error statistics of a quantized measurement in the JSON file.
#[derive(Serialize)]
struct AccuracyJson {
    checked_values: u64,
    rel_l2: f64,
    max_err: f64,
    outside_bound: u64,
    ref_mismatch: u64,
    /// Bytes that differ from the CPU reference (one-step quantized collectives, whose `#wrong`
    /// counts them; absent for AllReduce).
    #[serde(skip_serializing_if = "Option::is_none")]
    ref_mismatch_bytes: Option<u64>,
}

impl<'a> OutcomeJson<'a> {
    fn of(row: &Row, o: &'a Outcome) -> Self {
        match o {
            Outcome::Skipped(why) => OutcomeJson::Skipped { skipped: why },
            Outcome::Done(m) => OutcomeJson::Done {
                time_us: m.time.median_us,
                time_us_mean: m.time.mean_us,
                time_us_min: m.time.min_us,
                time_us_max: m.time.max_us,
                samples: m.time.samples,
                algbw_gbs: row.algbw(m),
                busbw_gbs: row.busbw(m),
                wrong: m.wrong_total(),
                wrong_elements: m.wrong,
                rank_mismatch_bytes: m.rank_mismatch_bytes,
                accuracy: m.accuracy.as_ref().map(|a| AccuracyJson {
                    checked_values: a.checked,
                    rel_l2: a.rel_l2,
                    max_err: a.max_err,
                    outside_bound: a.outside_bound,
                    ref_mismatch: a.ref_mismatch,
                    ref_mismatch_bytes: (row.coll != Collective::AllReduce)
                        .then_some(a.ref_mismatch_bytes),
                }),
            },
        }
    }
}

/// A row in the JSON file: nccl-tests' fields, then flashcomm's.
#[derive(Serialize)]
pub struct RowJson<'a> {
    #[serde(rename = "impl")]
    implementation: String,
    launch: &'static str,
    collective: &'static str,
    #[serde(rename = "type")]
    dtype: &'static str,
    redop: &'static str,
    root: i32,
    nranks: u32,
    size_bytes: u64,
    count: u64,
    plan: Option<&'a str>,
    out_of_place: OutcomeJson<'a>,
    in_place: Option<OutcomeJson<'a>>,
    vs_nccl: Option<f64>,
    vs_copy: Option<f64>,
    vs_ref: Option<f64>,
    vs_link: Option<f64>,
    vs_best: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    quant: Option<QuantJson>,
}

/// Codec settings of a quantized row in the JSON file.
#[derive(Serialize)]
struct QuantJson {
    rs_bits: u8,
    ag_bits: u8,
    group: u16,
    spikes: u8,
    effbits_rs: f64,
    effbits_ag: f64,
}

/// A row as JSON.
pub fn row_json(row: &Row) -> RowJson<'_> {
    RowJson {
        implementation: row.variant.label(),
        launch: row.launch.name(),
        collective: row.coll.name(),
        dtype: row.dtype.long_name(),
        redop: row.redop(),
        root: -1,
        nranks: row.nranks,
        size_bytes: row.bytes,
        count: row.count,
        plan: row.plan.as_deref(),
        out_of_place: OutcomeJson::of(row, &row.out),
        in_place: row.inplace.as_ref().map(|o| OutcomeJson::of(row, o)),
        vs_nccl: row.vs_nccl,
        vs_copy: row.vs_copy,
        vs_ref: row.vs_ref,
        vs_link: row.vs_link,
        vs_best: row.vs_best,
        quant: row.quant.map(|q| QuantJson {
            rs_bits: q.width.rs,
            ag_bits: q.width.ag,
            group: q.group,
            spikes: q.spikes,
            effbits_rs: q.effbits_rs,
            effbits_ag: q.effbits_ag,
        }),
    }
}

/// A row of the latency table in the JSON file.
#[derive(Serialize)]
struct LatencyJson {
    size_bytes: u64,
    fc_eager_us: Option<f64>,
    copy_eager_us: Option<f64>,
    ratio_eager: Option<f64>,
    fc_graph_us: Option<f64>,
    copy_graph_us: Option<f64>,
    ratio_graph: Option<f64>,
}

/// The summary at the end of the JSON file.
#[derive(Serialize)]
struct SummaryJson {
    wrong_total: u64,
    ok: bool,
}

/// The whole JSON document: settings, rows, the latency table (when built) and the summary.
#[derive(Serialize)]
pub struct Document<'a, S> {
    tool: &'static str,
    version: &'static str,
    settings: S,
    rows: Vec<RowJson<'a>>,
    latency: Option<Vec<LatencyJson>>,
    summary: SummaryJson,
}

/// The whole JSON document: settings, rows, the latency table (when built) and the summary.
pub fn document<'a, S: Serialize>(
    settings: S,
    table: &'a Table,
    latency: Option<&[LatencyRow]>,
) -> Document<'a, S> {
    let lat = latency.map(|rows| {
        rows.iter()
            .map(|l| LatencyJson {
                size_bytes: l.bytes,
                fc_eager_us: l.fc_eager,
                copy_eager_us: l.copy_eager,
                ratio_eager: ratio(l.fc_eager, l.copy_eager),
                fc_graph_us: l.fc_graph,
                copy_graph_us: l.copy_graph,
                ratio_graph: ratio(l.fc_graph, l.copy_graph),
            })
            .collect()
    });
    Document {
        tool: "flashcomm-perf",
        version: env!("CARGO_PKG_VERSION"),
        settings,
        rows: table.rows.iter().map(row_json).collect(),
        latency: lat,
        summary: SummaryJson {
            wrong_total: table.wrong_total(),
            ok: table.wrong_total() == 0,
        },
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{Value, json};

    pub(crate) fn measure(t: f64, wrong: u64) -> Measure {
        Measure {
            time: TimeStats::of(&[t, t, t]),
            wrong: Some(wrong),
            rank_mismatch_bytes: Some(0),
            accuracy: None,
        }
    }

    pub(crate) fn row(variant: Variant, launch: Launch, bytes: u64, t: f64) -> Row {
        Row {
            variant,
            launch,
            dtype: Dtype::Bf16,
            coll: Collective::AllReduce,
            nranks: 8,
            bytes,
            count: bytes / 2,
            plan: Some("oneshot/ll".into()),
            quant: None,
            out: Outcome::Done(measure(t, 0)),
            inplace: None,
            vs_nccl: None,
            vs_copy: None,
            vs_ref: None,
            vs_link: None,
            vs_best: None,
        }
    }

    const PLAIN: Layout = Layout {
        inplace: false,
        quant: false,
        vs_nccl: false,
        vs_copy: false,
        vs_ref: false,
        vs_link: false,
        vs_best: false,
    };

    #[test]
    fn plain_table_has_nccl_tests_columns() {
        let h = header(&PLAIN);
        assert_eq!(h.len(), 3);
        assert!(h.iter().all(|l| l.starts_with('#')));
        let names: Vec<&str> = h[1].trim_start_matches('#').split_whitespace().collect();
        assert_eq!(
            names,
            vec![
                "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                "impl", "launch", "plan"
            ]
        );
        assert!(h[2].contains("(B)") && h[2].contains("(elements)") && h[2].contains("(GB/s)"));
        let line = format_row(
            &PLAIN,
            &row(Variant::Lossless, Launch::Eager, 1 << 20, 10.0),
        );
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f[0], "1048576");
        assert_eq!(f[1], "524288");
        assert_eq!(f[2], "bfloat16");
        assert_eq!(f[3], "sum");
        assert_eq!(f[4], "-1");
        assert_eq!(f[5], "10.00");
        assert_eq!(f[6], "104.86");
        assert_eq!(f[7], "183.50", "busbw = algbw * 2 * 7 / 8");
        assert_eq!(f[8], "0");
        assert_eq!(&f[9..], &["flashcomm", "eager", "oneshot/ll"]);
        // Columns line up with the header: the size ends where "size" ends.
        assert_eq!(
            h[1].find("size").unwrap() + 4,
            line.find("1048576").unwrap() + 7
        );
    }

    #[test]
    fn times_are_formatted_like_nccl_tests() {
        assert_eq!(fmt_time(9.876), "9.88");
        assert_eq!(fmt_time(1234.56), "1234.6");
        assert_eq!(fmt_time(123_456.7), "123457");
        assert_eq!(fmt_time(f64::NAN), "N/A");
    }

    #[test]
    fn full_layout_with_quant_inplace_and_ratios() {
        let layout = Layout {
            inplace: true,
            quant: true,
            vs_nccl: true,
            vs_copy: true,
            vs_ref: false,
            vs_link: false,
            vs_best: false,
        };
        let h = header(&layout);
        assert!(h[0].contains("out-of-place") && h[0].contains("in-place"));
        let names: Vec<&str> = h[1].trim_start_matches('#').split_whitespace().collect();
        assert_eq!(names.iter().filter(|n| **n == "#wrong").count(), 2);
        for col in ["relL2", "maxerr", "effbits", "vs_nccl", "vs_copy"] {
            assert!(names.contains(&col), "{col}");
        }
        let mut t = Table::default();
        assert_eq!(
            t.add(&layout, row(Variant::Copy, Launch::Eager, 4096, 2.0))
                .len(),
            1
        );
        t.add(&layout, row(Variant::Nccl, Launch::Eager, 4096, 8.0));
        let mut q = row(
            Variant::Quant(Width { rs: 4, ag: 8 }),
            Launch::Eager,
            4096,
            4.0,
        );
        q.quant = Some(QuantInfo {
            width: Width { rs: 4, ag: 8 },
            group: 128,
            spikes: 2,
            effbits_rs: 4.75,
            effbits_ag: 8.75,
        });
        if let Outcome::Done(m) = &mut q.out {
            m.accuracy = Some(AccuracyStats {
                checked: 2048,
                rel_l2: 0.0123,
                max_err: 0.5,
                outside_bound: 0,
                ref_mismatch: 0,
                ..AccuracyStats::default()
            });
        }
        q.inplace = Some(Outcome::Skipped("N/A".into()));
        let lines = t.add(&layout, q);
        let f: Vec<&str> = lines[0].split_whitespace().collect();
        // out-of-place group, in-place group (N/A), relL2, maxerr, effbits, vs_nccl, vs_copy.
        assert_eq!(&f[9..13], &["N/A", "N/A", "N/A", "N/A"]);
        assert_eq!(f[13], "1.23e-2");
        assert_eq!(f[14], "5.00e-1");
        assert_eq!(f[15], "4.750/8.750");
        assert_eq!(f[16], "0.500", "4 us against NCCL's 8 us");
        assert_eq!(f[17], "2.000", "4 us against the copy's 2 us");
        assert_eq!(f[18], "flashcomm-q4/8");
        // Every numeric column ends where its header name ends; the labels start together.
        let ends = |l: &str| -> Vec<(usize, usize)> {
            let mut v = Vec::new();
            let mut start = None;
            for (i, c) in l.char_indices().chain(std::iter::once((l.len(), ' '))) {
                match (c.is_whitespace() || c == '#', start) {
                    (false, None) => start = Some(i),
                    (true, Some(s0)) => {
                        v.push((s0, i));
                        start = None;
                    }
                    _ => {}
                }
            }
            v
        };
        let (hn, rn) = (ends(&h[1]), ends(&lines[0]));
        assert_eq!(hn.len(), rn.len());
        for k in 0..18 {
            assert_eq!(hn[k].1, rn[k].1, "column {k} of {}", h[1]);
        }
        assert_eq!(hn[18].0, rn[18].0, "impl label");
        // Baselines are matched on launch mode too.
        let g = t.add(&layout, row(Variant::Lossless, Launch::Graph, 4096, 3.0));
        assert!(g[0].split_whitespace().nth(16) == Some("N/A"));
    }

    #[test]
    fn skipped_rows_print_one_note_and_count_nothing() {
        let mut t = Table::default();
        let mut r = row(
            Variant::Quant(Width { rs: 4, ag: 4 }),
            Launch::Eager,
            4096,
            1.0,
        );
        r.out = Outcome::Skipped("kernels are not in this build".into());
        let first = t.add(&PLAIN, r.clone());
        assert_eq!(first.len(), 1);
        assert!(first[0].starts_with("# flashcomm-q4 bfloat16: skipped: kernels"));
        r.bytes = 8192;
        assert!(t.add(&PLAIN, r).is_empty());
        assert_eq!(t.wrong_total(), 0);
        assert!(t.footer()[0].ends_with("0 OK"));
    }

    #[test]
    fn footer_counts_wrong_and_averages_busbw() {
        let mut t = Table::default();
        t.add(&PLAIN, row(Variant::Lossless, Launch::Eager, 1 << 20, 10.0));
        let mut bad = row(Variant::Lossless, Launch::Eager, 2 << 20, 10.0);
        bad.out = Outcome::Done(Measure {
            rank_mismatch_bytes: Some(2),
            ..measure(10.0, 3)
        });
        t.add(&PLAIN, bad);
        assert_eq!(t.wrong_total(), 5);
        let f = t.footer();
        assert_eq!(f[0], "# Out of bounds values : 5 FAILED");
        assert!(
            f[1].starts_with("# Avg bus bandwidth    : 275.2"),
            "{}",
            f[1]
        );
        assert!(f[1].ends_with("(flashcomm, eager)"));
        // The copy baseline has no bus bandwidth.
        let mut c = Table::default();
        c.add(&PLAIN, row(Variant::Copy, Launch::Eager, 1 << 20, 10.0));
        assert_eq!(c.footer().len(), 1);
        assert!(format_row(&PLAIN, &c.rows[0]).split_whitespace().nth(7) == Some("N/A"));
    }

    #[test]
    fn rows_carry_their_ratio_to_the_host_link() {
        let layout = Layout {
            vs_link: true,
            ..PLAIN
        };
        assert!(header(&layout)[1].contains("vs_link"));
        let mut t = Table::default();
        t.add(&layout, row(Variant::Link, Launch::Graph, 1 << 20, 40.0));
        t.add(
            &layout,
            row(Variant::Lossless, Launch::Graph, 1 << 20, 50.0),
        );
        assert_eq!(t.rows[0].vs_link, None, "the link has no ratio to itself");
        assert_eq!(t.rows[1].vs_link, Some(1.25));
        assert_eq!(t.rows[0].busbw(t.rows[0].out.measure().unwrap()), None);
        assert_eq!(row_json(&t.rows[1]).vs_link, Some(1.25));
    }

    #[test]
    fn rows_carry_their_ratio_to_the_reference() {
        let layout = Layout {
            vs_ref: true,
            ..PLAIN
        };
        assert!(header(&layout)[1].contains("vs_ref"));
        let mut t = Table::default();
        t.add(
            &layout,
            row(
                Variant::Reference(RefLaunch::PerRank),
                Launch::Graph,
                8192,
                4.0,
            ),
        );
        t.add(&layout, row(Variant::Lossless, Launch::Graph, 8192, 3.0));
        t.add(&layout, row(Variant::Lossless, Launch::Graph, 16384, 3.0));
        assert_eq!(
            t.rows[0].vs_ref, None,
            "the reference has no ratio to itself"
        );
        assert_eq!(t.rows[1].vs_ref, Some(0.75));
        assert_eq!(t.rows[2].vs_ref, None, "no reference row of that size");
        assert!(format_row(&layout, &t.rows[1]).contains("0.750"));
        assert_eq!(row_json(&t.rows[1]).vs_ref, Some(0.75));
    }

    #[test]
    fn competitor_labels() {
        use RefLaunch::{PerRank, Single};
        let labels: Vec<String> = [
            Variant::Reference(PerRank),
            Variant::Reference(Single),
            Variant::Pull(PullRow::OneStage, PerRank),
            Variant::Pull(PullRow::TwoStage, PerRank),
            Variant::Pull(PullRow::Best, PerRank),
            Variant::Pull(PullRow::TwoStage, Single),
            Variant::Pull(PullRow::Best, Single),
        ]
        .iter()
        .map(Variant::label)
        .collect();
        assert_eq!(
            labels,
            [
                "reference",
                "reference-1grid",
                "pull-1stage",
                "pull-2stage",
                "pull-best",
                "pull-2stage-1grid",
                "pull-best-1grid"
            ]
        );
        // Every label fits the impl column.
        assert!(labels.iter().all(|l| l.len() <= 17));
        assert!(Variant::Pull(PullRow::Best, Single).derived());
        assert!(!Variant::Pull(PullRow::OneStage, Single).derived());
        assert!(Variant::Reference(Single).single_grid());
        assert!(!Variant::Pull(PullRow::OneStage, PerRank).single_grid());
        for v in [
            Variant::Nccl,
            Variant::Reference(PerRank),
            Variant::Pull(PullRow::OneStage, PerRank),
            Variant::Pull(PullRow::TwoStage, PerRank),
        ] {
            assert!(v.competitor(), "{v:?}");
        }
        for v in [
            Variant::Copy,
            Variant::Lossless,
            Variant::Reference(Single),
            Variant::Pull(PullRow::Best, PerRank),
            Variant::Pull(PullRow::OneStage, Single),
        ] {
            assert!(!v.competitor(), "{v:?}");
        }
    }

    #[test]
    fn pull_best_is_the_faster_kernel_and_counted_once() {
        let layout = Layout {
            vs_ref: true,
            vs_best: true,
            ..PLAIN
        };
        let h = header(&layout);
        assert!(h[1].contains("vs_ref") && h[1].contains("vs_best"));
        let one = Variant::Pull(PullRow::OneStage, RefLaunch::PerRank);
        let two = Variant::Pull(PullRow::TwoStage, RefLaunch::PerRank);
        let mut t = Table::default();
        t.add(
            &layout,
            row(
                Variant::Reference(RefLaunch::PerRank),
                Launch::Graph,
                8192,
                8.0,
            ),
        );
        let mut a = row(one, Launch::Graph, 8192, 5.0);
        a.plan = Some("1stage/g1".into());
        a.out = Outcome::Done(measure(5.0, 2));
        assert_eq!(t.add(&layout, a).len(), 1, "no partner yet");
        let mut b = row(two, Launch::Graph, 8192, 6.0);
        b.plan = Some("2stage/g1".into());
        let lines = t.add(&layout, b);
        assert_eq!(lines.len(), 2, "the 2-stage row, then pull-best");
        let best = &t.rows[3];
        assert_eq!(
            best.variant,
            Variant::Pull(PullRow::Best, RefLaunch::PerRank)
        );
        assert_eq!(best.plan.as_deref(), Some("1stage/g1"), "the faster kernel");
        assert_eq!(best.out.measure().unwrap().time.median_us, 5.0);
        assert_eq!(best.vs_ref, Some(0.625));
        assert!(lines[1].contains("pull-best") && lines[1].contains("1stage/g1"));
        // The 1-stage row's 2 wrong elements count once, not again through pull-best.
        assert_eq!(t.wrong_total(), 2);
        // flashcomm's rows: vs_best over the fastest competitor (the 1-stage's 5 us).
        t.add(&layout, row(Variant::Lossless, Launch::Graph, 8192, 4.0));
        let fc = t.rows.last().unwrap();
        assert_eq!(fc.vs_best, Some(0.8));
        assert_eq!(fc.vs_ref, Some(0.5));
        assert!(format_row(&layout, fc).contains("0.800"));
        assert_eq!(row_json(fc).vs_best, Some(0.8));
        // Competitors have no vs_best; a flashcomm row without competitors neither.
        assert!(t.rows[..4].iter().all(|r| r.vs_best.is_none()));
        t.add(&layout, row(Variant::Lossless, Launch::Eager, 8192, 4.0));
        assert_eq!(t.rows.last().unwrap().vs_best, None);
        // The footer averages pull-best like the others.
        assert!(t.footer().iter().any(|l| l.ends_with("(pull-best, graph)")));
    }

    #[test]
    fn pull_best_with_a_skipped_kernel_and_one_grid_rows() {
        let layout = Layout {
            vs_best: true,
            ..PLAIN
        };
        let mut t = Table::default();
        let mut a = row(
            Variant::Pull(PullRow::TwoStage, RefLaunch::Single),
            Launch::Eager,
            4096,
            3.0,
        );
        a.out = Outcome::Skipped("too small".into());
        t.add(&layout, a);
        t.add(
            &layout,
            row(
                Variant::Pull(PullRow::OneStage, RefLaunch::Single),
                Launch::Eager,
                4096,
                7.0,
            ),
        );
        let best = t.rows.last().unwrap();
        assert_eq!(best.variant.label(), "pull-best-1grid");
        assert_eq!(best.out.measure().unwrap().time.median_us, 7.0);
        // One-grid rows are no competitor of vs_best: a flashcomm row finds none.
        t.add(&layout, row(Variant::Nccl, Launch::Graph, 4096, 9.0));
        t.add(&layout, row(Variant::Lossless, Launch::Eager, 4096, 4.0));
        assert_eq!(t.rows.last().unwrap().vs_best, None);
        // NCCL alone is the best competitor where it is the only one.
        t.add(&layout, row(Variant::Lossless, Launch::Graph, 4096, 4.5));
        assert_eq!(t.rows.last().unwrap().vs_best, Some(0.5));
        // Neither kernel measured: pull-best says so.
        let mut u = Table::default();
        for r in [PullRow::OneStage, PullRow::TwoStage] {
            let mut x = row(Variant::Pull(r, RefLaunch::PerRank), Launch::Eager, 64, 1.0);
            x.out = Outcome::Skipped("no".into());
            u.add(&layout, x);
        }
        assert_eq!(u.rows.len(), 3);
        assert!(matches!(&u.rows[2].out, Outcome::Skipped(w) if w.contains("neither")));
    }

    #[test]
    fn latency_table_pairs_flashcomm_with_the_copy() {
        let rows = vec![
            row(Variant::Copy, Launch::Eager, 8192, 2.0),
            row(Variant::Lossless, Launch::Eager, 8192, 6.0),
            row(Variant::Copy, Launch::Graph, 8192, 1.0),
            row(Variant::Lossless, Launch::Graph, 8192, 4.0),
            row(Variant::Copy, Launch::Eager, 16384, 2.5),
        ];
        let l = latency_rows(&rows);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].fc_eager, Some(6.0));
        assert_eq!(l[0].copy_graph, Some(1.0));
        assert_eq!(l[1].fc_eager, None);
        let text = format_latency("title", &l);
        assert_eq!(text[0], "# title");
        let f: Vec<&str> = text[3].split_whitespace().collect();
        assert_eq!(
            f,
            vec!["8192", "6.00", "2.00", "3.00", "4.00", "1.00", "4.00"]
        );
        assert!(text[4].contains("N/A"));
    }

    #[test]
    fn json_document_shape() {
        let mut t = Table::default();
        let layout = PLAIN;
        t.add(&layout, row(Variant::Copy, Launch::Eager, 4096, 2.0));
        t.add(&layout, row(Variant::Lossless, Launch::Eager, 4096, 4.0));
        let mut s = row(
            Variant::Quant(Width { rs: 2, ag: 2 }),
            Launch::Eager,
            4096,
            1.0,
        );
        s.out = Outcome::Skipped("no kernels".into());
        t.add(&layout, s);
        let lat = latency_rows(&t.rows);
        let doc = document(json!({ "ranks": 8, "mode": "virtual" }), &t, Some(&lat));
        let text = serde_json::to_string_pretty(&doc).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["tool"], "flashcomm-perf");
        assert_eq!(back["settings"]["ranks"], 8);
        let rows = back["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 3);
        let r = &rows[1];
        for key in [
            "impl",
            "launch",
            "collective",
            "type",
            "redop",
            "root",
            "nranks",
            "size_bytes",
            "count",
            "plan",
            "out_of_place",
            "in_place",
            "vs_nccl",
            "vs_copy",
            "vs_best",
        ] {
            assert!(r.get(key).is_some(), "row key {key}");
        }
        assert_eq!(r["impl"], "flashcomm");
        assert_eq!(r["out_of_place"]["time_us"], 4.0);
        assert_eq!(r["out_of_place"]["wrong"], 0);
        assert_eq!(r["vs_copy"], 2.0);
        assert!(r["in_place"].is_null());
        assert_eq!(rows[2]["out_of_place"]["skipped"], "no kernels");
        assert_eq!(back["latency"][0]["ratio_eager"], 2.0);
        assert_eq!(back["summary"]["wrong_total"], 0);
        assert_eq!(back["summary"]["ok"], true);
    }
    #[test]
    fn json_of_quantized_rows_of_every_collective() {
        let q = |coll: Collective| {
            let mut r = row(
                Variant::Quant(Width { rs: 4, ag: 4 }),
                Launch::Eager,
                1 << 20,
                10.0,
            );
            r.coll = coll;
            r.quant = Some(QuantInfo {
                width: Width { rs: 4, ag: 4 },
                group: 128,
                spikes: 2,
                effbits_rs: 4.75,
                effbits_ag: 4.75,
            });
            if let Outcome::Done(m) = &mut r.out {
                m.wrong = Some(3);
                m.rank_mismatch_bytes = None;
                m.accuracy = Some(AccuracyStats {
                    checked: 4096,
                    outside_bound: 1,
                    ref_mismatch: 1,
                    ref_mismatch_bytes: 2,
                    ..AccuracyStats::default()
                });
            }
            serde_json::to_value(row_json(&r)).unwrap()
        };
        let a2a = q(Collective::AlltoAll);
        assert_eq!(a2a["collective"], Collective::AlltoAll.name());
        assert_eq!(a2a["impl"], "flashcomm-q4");
        assert_eq!(a2a["redop"], "none");
        assert_eq!(
            (&a2a["quant"]["rs_bits"], &a2a["quant"]["ag_bits"]),
            (&json!(4), &json!(4))
        );
        assert_eq!(a2a["out_of_place"]["wrong"], 3);
        assert_eq!(a2a["out_of_place"]["accuracy"]["ref_mismatch_bytes"], 2);
        // busbw of AllToAll: (n-1)/n.
        let busbw = a2a["out_of_place"]["busbw_gbs"].as_f64().unwrap();
        assert!((busbw - 104.8576 * 0.875).abs() < 1e-9, "{busbw}");
        let rs = q(Collective::ReduceScatter);
        assert_eq!(rs["redop"], "sum");
        assert_eq!(rs["out_of_place"]["accuracy"]["ref_mismatch_bytes"], 2);
        // AllReduce rows keep their fields as they were.
        let ar = q(Collective::AllReduce);
        assert!(
            ar["out_of_place"]["accuracy"]
                .get("ref_mismatch_bytes")
                .is_none()
        );
        assert_eq!(ar["out_of_place"]["accuracy"]["ref_mismatch"], 1);
    }
}
