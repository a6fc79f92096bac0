//! The simulated all-reduce: per-rank partial sums are converted to `bf16` (the all-reduce's
//! datatype in serving) and reduced by the codec's CPU reference, exactly or quantized. In the
//! expert-parallel modes ([`Mode::Ep`]) it also simulates the dispatch and combine all-to-alls
//! around every MLP block (see [`crate::expert`]).

use crate::expert::{self, Leg};
use crate::model::{AllReduce, Site};
use crate::rotation::Rotation;
pub use crate::spec::{Backend, ErrorStats, Spec};
use half::bf16;
use std::fmt;
use std::sync::Mutex;

/// How the partial sums are reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// Partials kept in `f32` and summed in `f32` (no `bf16` rounding): a reference for the
    /// model's own accuracy, not an all-reduce that serving would run.
    F32,
    /// The codec's exact (lossless) all-reduce of the `bf16` partials: the baseline.
    Lossless,
    /// Quantized reduce-scatter (format `rs`) followed by a quantized all-gather (format `ag`).
    TwoStep {
        /// Reduce-scatter format.
        rs: Spec,
        /// All-gather format.
        ag: Spec,
    },
    /// Every rank sends its whole quantized partial to every other rank once.
    OneShot(Spec),
    /// A bound, not an all-reduce that could run: the one-shot with every group of every rank's
    /// partial replaced by its best approximation with `2^bits + spikes` distinct values (see
    /// [`crate::oracle`]).
    Oracle(Spec),
    /// The one-shot with the non-uniform code grid of [`crate::grid`], exponent `p / 10`.
    Grid(Spec, u8),
    /// Expert parallelism on the dense model (see [`crate::expert`]): TP = 1 with no all-reduce
    /// (the single rank's product is used as it is, in `f32`), the MLP block's input sent through
    /// the dispatch all-to-all and its output through the combine all-to-all.
    Ep {
        /// The dispatch all-to-all (the MLP block's input).
        dispatch: Leg,
        /// The combine all-to-all (the MLP block's output).
        combine: Leg,
    },
}

impl Mode {
    /// A short name of the algorithm.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Mode::F32 => "f32 sum (no bf16)",
            Mode::Lossless => "exact (bf16)",
            Mode::TwoStep { rs, ag } if rs == ag => "two-step",
            Mode::TwoStep { .. } => "two-step mixed",
            Mode::OneShot(_) => "one-shot",
            Mode::Oracle(_) => "oracle bound",
            Mode::Grid(..) => "one-shot grid",
            Mode::Ep { dispatch, combine } => match (dispatch, combine) {
                (Leg::F32, Leg::F32) => "EP f32 (no bf16)",
                (Leg::Exact, Leg::Exact) => "EP exact (bf16)",
                (Leg::Quantized(_), Leg::Quantized(_)) => "EP dispatch + combine",
                (Leg::Quantized(_), _) => "EP dispatch",
                (_, Leg::Quantized(_)) => "EP combine",
                _ => "EP",
            },
        }
    }

    /// Whether this is an expert-parallel mode.
    pub fn is_ep(&self) -> bool {
        matches!(self, Mode::Ep { .. })
    }

    /// The expert-parallel baseline: both all-to-alls exact in `bf16`.
    pub const EP_EXACT: Mode = Mode::Ep {
        dispatch: Leg::Exact,
        combine: Leg::Exact,
    };

    /// The formats used, or `None` for the exact modes. For an expert-parallel mode: (dispatch,
    /// combine) when both are quantized, the one quantized format twice when only one is.
    pub fn formats(&self) -> Option<(Spec, Spec)> {
        match *self {
            Mode::F32 | Mode::Lossless => None,
            Mode::TwoStep { rs, ag } => Some((rs, ag)),
            Mode::OneShot(f) | Mode::Oracle(f) | Mode::Grid(f, _) => Some((f, f)),
            Mode::Ep { dispatch, combine } => match (dispatch.spec(), combine.spec()) {
                (Some(d), Some(c)) => Some((d, c)),
                (Some(f), None) | (None, Some(f)) => Some((f, f)),
                (None, None) => None,
            },
        }
    }
}

/// The all-reduces that a quantized mode applies to; the others use the exact all-reduce. Used
/// to find which layers the perplexity is most sensitive to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Scope {
    /// First layer whose all-reduces are quantized.
    pub first_layer: usize,
    /// One past the last layer whose all-reduces are quantized.
    pub end_layer: usize,
    /// Whether the attention output projection's all-reduce is quantized.
    pub o_proj: bool,
    /// Whether the MLP down projection's all-reduce is quantized.
    pub down_proj: bool,
}

impl Scope {
    /// Every all-reduce of every layer.
    pub const ALL: Scope = Scope {
        first_layer: 0,
        end_layer: usize::MAX,
        o_proj: true,
        down_proj: true,
    };

    /// Parses `LAYERS:SITES`: `LAYERS` is `all`, `N` or `A-B` (inclusive), `SITES` is `both`,
    /// `o` or `down`. Example: `0-27:both`.
    pub fn parse(s: &str) -> Result<Scope, String> {
        let bad =
            || format!("bad scope {s:?}: use LAYERS:SITES, e.g. all:both, 0-27:both, 11:down");
        let (layers, sites) = s.split_once(':').ok_or_else(bad)?;
        let num = |v: &str| v.parse::<usize>().map_err(|_| bad());
        let (first_layer, end_layer) = match layers.split_once('-') {
            _ if layers == "all" => (0, usize::MAX),
            Some((a, b)) => (num(a)?, num(b)? + 1),
            None => (num(layers)?, num(layers)? + 1),
        };
        let (o_proj, down_proj) = match sites {
            "both" => (true, true),
            "o" => (true, false),
            "down" => (false, true),
            _ => return Err(bad()),
        };
        Ok(Scope {
            first_layer,
            end_layer,
            o_proj,
            down_proj,
        })
    }

    /// Whether the all-reduce of `site` in `layer` is quantized.
    pub fn contains(&self, layer: usize, site: Site) -> bool {
        (self.first_layer..self.end_layer).contains(&layer)
            && match site {
                Site::OProj => self.o_proj,
                Site::DownProj => self.down_proj,
            }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sites = match (self.o_proj, self.down_proj) {
            (true, true) => "both",
            (true, false) => "o",
            (false, true) => "down",
            (false, false) => "none",
        };
        match (self.first_layer, self.end_layer) {
            (0, usize::MAX) => write!(f, "all:{sites}"),
            (a, usize::MAX) => write!(f, "{a}-:{sites}"),
            (a, b) if b == a + 1 => write!(f, "{a}:{sites}"),
            (a, b) => write!(f, "{a}-{}:{sites}", b.saturating_sub(1)),
        }
    }
}

/// An [`AllReduce`] over `ranks` simulated ranks with a given [`Mode`].
pub struct Simulated<'a> {
    ranks: usize,
    mode: Mode,
    backend: &'a dyn Backend,
    scope: Scope,
    rotation: Option<Rotation>,
    spikes_first: bool,
    row: usize,
    stats: Mutex<ErrorStats>,
    dispatch_stats: Mutex<ErrorStats>,
    combine_stats: Mutex<ErrorStats>,
}

impl<'a> Simulated<'a> {
    /// A simulated all-reduce.
    pub fn new(ranks: usize, mode: Mode, backend: &'a dyn Backend) -> Simulated<'a> {
        Simulated {
            ranks,
            mode,
            backend,
            scope: Scope::ALL,
            rotation: None,
            spikes_first: false,
            row: 0,
            stats: Mutex::new(ErrorStats::default()),
            dispatch_stats: Mutex::new(ErrorStats::default()),
            combine_stats: Mutex::new(ErrorStats::default()),
        }
    }

    /// With `rotate`, the quantized all-reduces run on rotated partials (see [`crate::rotation`]):
    /// every rank rotates its `bf16` partial group by group (the reduce-scatter format's group
    /// size) and rounds it to `bf16`, the all-reduce runs unchanged, and its result is rotated
    /// back and rounded to `bf16`. The exact modes are not rotated.
    pub fn with_rotation(mut self, rotate: bool) -> Simulated<'a> {
        self.rotation = match self.mode.formats() {
            Some((rs, _)) if rotate => Some(Rotation::new(rs.group.into())),
            _ => None,
        };
        self
    }

    /// With `on`, the quantized all-reduces take each group's spikes out of the unrotated group
    /// first, keep them exactly, and rotate and quantize the rest without spikes (see
    /// [`crate::spike_rotation`]; the backend's `*_spikes_rotated` all-reduces). Takes precedence
    /// over [`Simulated::with_rotation`]. The exact modes are not affected.
    pub fn with_spikes_first(mut self, on: bool) -> Simulated<'a> {
        self.spikes_first = on;
        self
    }

    /// Restricts the quantized mode to some all-reduces; the others are exact. In the
    /// expert-parallel modes only the layers count: outside them, a quantized all-to-all is
    /// exact (`bf16`).
    pub fn with_scope(mut self, scope: Scope) -> Simulated<'a> {
        self.scope = scope;
        self
    }

    /// Sets the row length of the buffers (the hidden size: a buffer is `[tokens, hidden]`), so
    /// that the statistics also report the error without the first token.
    pub fn with_row(mut self, row: usize) -> Simulated<'a> {
        self.row = row;
        self
    }

    /// The statistics gathered so far.
    pub fn stats(&self) -> ErrorStats {
        *self.stats.lock().expect("stats lock")
    }

    /// The statistics of the quantized dispatch all-to-alls so far (expert-parallel modes).
    pub fn dispatch_stats(&self) -> ErrorStats {
        *self.dispatch_stats.lock().expect("stats lock")
    }

    /// The statistics of the quantized combine all-to-alls so far (expert-parallel modes).
    pub fn combine_stats(&self) -> ErrorStats {
        *self.combine_stats.lock().expect("stats lock")
    }

    fn all_to_all(
        &self,
        layer: usize,
        leg: Leg,
        block: Vec<f32>,
        stats: &Mutex<ErrorStats>,
    ) -> Vec<f32> {
        let quantize = (self.scope.first_layer..self.scope.end_layer).contains(&layer);
        let mut local = ErrorStats::default();
        let out = expert::send(self.backend, leg, quantize, block, self.row, &mut local)
            .unwrap_or_else(|e| panic!("all-to-all {leg} failed: {e}"));
        stats.lock().expect("stats lock").merge(&local);
        out
    }
}

impl AllReduce for Simulated<'_> {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_reduce(&self, layer: usize, site: Site, partials: &[Vec<f32>]) -> Vec<f32> {
        let max_in = partials
            .iter()
            .flat_map(|p| p.iter())
            .fold(0f32, |a, &v| a.max(v.abs()));
        if matches!(self.mode, Mode::F32 | Mode::Ep { .. }) {
            let mut sum = partials[0].clone();
            for p in &partials[1..] {
                sum.iter_mut().zip(p).for_each(|(a, &b)| *a += b);
            }
            let mut st = self.stats.lock().expect("stats lock");
            st.max_abs_input = st.max_abs_input.max(max_in.into());
            st.calls += 1;
            return sum;
        }
        let b16: Vec<Vec<bf16>> = partials
            .iter()
            .map(|p| p.iter().map(|&v| bf16::from_f32(v)).collect())
            .collect();
        let inputs: Vec<&[bf16]> = b16.iter().map(Vec::as_slice).collect();
        let exact = self.backend.lossless(&inputs);
        let mode = if self.scope.contains(layer, site) {
            self.mode
        } else {
            Mode::Lossless
        };
        let spikes_first = self.spikes_first && mode != Mode::Lossless;
        let rotation = self
            .rotation
            .as_ref()
            .filter(|_| mode != Mode::Lossless && !spikes_first);
        let rotated: Option<Vec<Vec<bf16>>> = rotation.map(|r| {
            b16.iter()
                .map(|p| {
                    let mut v: Vec<f32> = p.iter().map(|x| x.to_f32()).collect();
                    r.forward(&mut v);
                    v.into_iter().map(bf16::from_f32).collect()
                })
                .collect()
        });
        let rotated_inputs: Option<Vec<&[bf16]>> = rotated
            .as_ref()
            .map(|r| r.iter().map(Vec::as_slice).collect());
        let ar_inputs = rotated_inputs.as_deref().unwrap_or(&inputs);
        let out = match mode {
            Mode::F32 | Mode::Lossless | Mode::Ep { .. } => Ok(exact.clone()),
            Mode::TwoStep { rs, ag } if spikes_first => {
                self.backend.two_step_spikes_rotated(rs, ag, &inputs)
            }
            Mode::OneShot(f) if spikes_first => self.backend.one_shot_spikes_rotated(f, &inputs),
            Mode::Oracle(f) => Ok(crate::oracle::one_shot(f, ar_inputs)),
            Mode::Grid(f, p) => Ok(crate::grid::one_shot(f, f64::from(p) / 10.0, ar_inputs)),
            Mode::TwoStep { rs, ag } => self.backend.two_step(rs, ag, ar_inputs),
            Mode::OneShot(f) => self.backend.one_shot(f, ar_inputs),
        }
        .unwrap_or_else(|e| panic!("all-reduce {:?} failed: {e}", self.mode));
        let out = match rotation {
            Some(r) => {
                let mut v: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
                r.inverse(&mut v);
                v.into_iter().map(bf16::from_f32).collect()
            }
            None => out,
        };
        assert_eq!(out.len(), exact.len(), "all-reduce changed the length");
        let mut local = ErrorStats {
            max_abs_input: max_in.into(),
            calls: 1,
            ..ErrorStats::default()
        };
        for (i, (&q, &e)) in out.iter().zip(&exact).enumerate() {
            let (q, e) = (f64::from(q.to_f32()), f64::from(e.to_f32()));
            let d = q - e;
            local.sq_err += d * d;
            local.sq_ref += e * e;
            if self.row > 0 && i >= self.row {
                local.sq_err_rest += d * d;
                local.sq_ref_rest += e * e;
            }
            local.max_abs_err = local.max_abs_err.max(d.abs());
        }
        self.stats.lock().expect("stats lock").merge(&local);
        out.iter().map(|v| v.to_f32()).collect()
    }

    fn dispatch(&self, layer: usize, input: Vec<f32>) -> Vec<f32> {
        match self.mode {
            Mode::Ep { dispatch, .. } => {
                self.all_to_all(layer, dispatch, input, &self.dispatch_stats)
            }
            _ => input,
        }
    }

    fn combine(&self, layer: usize, output: Vec<f32>) -> Vec<f32> {
        match self.mode {
            Mode::Ep { combine, .. } => {
                self.all_to_all(layer, combine, output, &self.combine_stats)
            }
            _ => output,
        }
    }
}

/// Effective bits per value of a `bf16` format by the wire-format rule of `docs/codec.md`
/// (block of 1024 values: 16-byte header, payload, range table, spike values and positions,
/// padded to 16 bytes). Used by the stand-in backend; the study reports the codec's own value.
pub fn spec_effective_bits(f: Spec) -> f64 {
    let groups = 1024 / f.group as usize;
    let k = f.spikes as usize;
    let bytes = 16 + 128 * f.bits as usize + groups * 2 * 2 + groups * k * 2 + groups * k;
    (bytes.div_ceil(16) * 16) as f64 * 8.0 / 1024.0
}

/// A backend with an exact all-reduce only (sum in `f32` in rank order, rounded to `bf16`);
/// quantized modes are refused. Used by tests that do not exercise the codec.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExactOnly;

impl Backend for ExactOnly {
    fn lossless(&self, inputs: &[&[bf16]]) -> Vec<bf16> {
        (0..inputs[0].len())
            .map(|i| bf16::from_f32(inputs.iter().fold(0f32, |a, x| a + x[i].to_f32())))
            .collect()
    }

    fn two_step(&self, _: Spec, _: Spec, _: &[&[bf16]]) -> Result<Vec<bf16>, String> {
        Err("the exact-only backend has no quantized all-reduce".into())
    }

    fn one_shot(&self, _: Spec, _: &[&[bf16]]) -> Result<Vec<bf16>, String> {
        Err("the exact-only backend has no quantized all-reduce".into())
    }

    fn effective_bits(&self, f: Spec) -> Result<f64, String> {
        Ok(spec_effective_bits(f))
    }
}

/// The codec crate's CPU reference all-reduces, the executable specification of the wire format.
#[derive(Debug, Default, Clone, Copy)]
pub struct Codec;

fn format(f: Spec) -> Result<flashcomm_codec::Format, String> {
    flashcomm_codec::Format::new(flashcomm_codec::DType::Bf16, f.bits, f.group, f.spikes)
        .map_err(|e| e.to_string())
}

impl Backend for Codec {
    fn lossless(&self, inputs: &[&[bf16]]) -> Vec<bf16> {
        flashcomm_codec::reference::allreduce_lossless(inputs)
    }

    fn two_step(&self, rs: Spec, ag: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String> {
        Ok(flashcomm_codec::reference::allreduce_twostep(
            format(rs)?,
            format(ag)?,
            inputs,
        ))
    }

    fn one_shot(&self, f: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String> {
        Ok(flashcomm_codec::reference::allreduce_oneshot(
            format(f)?,
            inputs,
        ))
    }

    fn effective_bits(&self, f: Spec) -> Result<f64, String> {
        Ok(format(f)?.effective_bits())
    }

    fn one_shot_spikes_rotated(&self, f: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String> {
        crate::spike_rotation::one_shot(f, inputs)
    }

    fn two_step_spikes_rotated(
        &self,
        rs: Spec,
        ag: Spec,
        inputs: &[&[bf16]],
    ) -> Result<Vec<bf16>, String> {
        crate::spike_rotation::two_step(rs, ag, inputs)
    }

    fn all_to_all_block(&self, f: Spec, block: &[bf16]) -> Result<(Vec<bf16>, Vec<f64>), String> {
        // AllToAll over one rank: its one per-peer block is the whole input, encoded once as a
        // buffer of its own and decoded by the receiver.
        let out = flashcomm_codec::reference::alltoall_quant(format(f)?, &[block])
            .pop()
            .ok_or("the all-to-all returned no output")?;
        Ok((out.values, out.bound))
    }
}
