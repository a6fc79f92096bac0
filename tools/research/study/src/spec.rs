//! The words every part of the study shares: a quantization format ([`Spec`]), the all-reduce
//! implementations the simulations call ([`Backend`]) and the error statistics they gather
//! ([`ErrorStats`]). It imports nothing of the study: every other module may use it.

use half::bf16;
use std::fmt;

/// A quantization format for `bf16` values: payload bits, group size and spikes per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Spec {
    /// Payload bits per value (2..=8).
    pub bits: u8,
    /// Values sharing one range (32, 64, 128, 256).
    pub group: u16,
    /// Extreme values per group kept exactly (0, 2, 4).
    pub spikes: u8,
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b{} g{} k{}", self.bits, self.group, self.spikes)
    }
}

/// The all-reduce implementations the study can call. The real one is the codec crate's CPU
/// reference; tests use a simpler stand-in.
pub trait Backend: Sync {
    /// Exact sum of the `bf16` inputs, rounded to `bf16`.
    fn lossless(&self, inputs: &[&[bf16]]) -> Vec<bf16>;
    /// Quantized two-step (reduce-scatter, all-gather) all-reduce.
    fn two_step(&self, rs: Spec, ag: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String>;
    /// Quantized one-shot all-reduce.
    fn one_shot(&self, f: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String>;
    /// Bits on the wire per value of a `bf16` format, payload and metadata included.
    fn effective_bits(&self, f: Spec) -> Result<f64, String>;
    /// One-shot all-reduce with each group's spikes taken out first and the rest rotated (see
    /// `spike_rotation`). Not available by default.
    fn one_shot_spikes_rotated(&self, f: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String> {
        let _ = (f, inputs);
        Err("this backend has no all-reduce with spikes first, then rotation".into())
    }
    /// Two-step all-reduce with each group's spikes taken out first and the rest rotated (see
    /// `spike_rotation`). Not available by default.
    fn two_step_spikes_rotated(
        &self,
        rs: Spec,
        ag: Spec,
        inputs: &[&[bf16]],
    ) -> Result<Vec<bf16>, String> {
        let _ = (rs, ag, inputs);
        Err("this backend has no all-reduce with spikes first, then rotation".into())
    }
    /// One per-peer block of a quantized all-to-all: the `bf16` values encoded once with `f` as
    /// a buffer of their own and decoded by the receiver. Returns the received values and the
    /// codec's per-element bound on their error. Not available by default.
    fn all_to_all_block(&self, f: Spec, block: &[bf16]) -> Result<(Vec<bf16>, Vec<f64>), String> {
        let _ = (f, block);
        Err("this backend has no quantized all-to-all".into())
    }
}

/// Error statistics of the quantized all-reduce against the exact sum of the same inputs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ErrorStats {
    /// Sum over calls and elements of `(q - exact)^2`.
    pub sq_err: f64,
    /// Sum over calls and elements of `exact^2`.
    pub sq_ref: f64,
    /// Largest `|q - exact|`.
    pub max_abs_err: f64,
    /// Largest `|partial|` seen in any rank's input.
    pub max_abs_input: f64,
    /// Number of all-reduce calls.
    pub calls: u64,
    /// [`ErrorStats::sq_err`] over the values after the first row of each buffer (the tokens
    /// after position 0, where the model's massive activations are), when the row length is
    /// known (see `collective::Simulated::with_row`).
    pub sq_err_rest: f64,
    /// [`ErrorStats::sq_ref`] over the same values.
    pub sq_ref_rest: f64,
    /// Largest ratio of `|q - exact|` to the codec's predicted per-element bound (infinite for
    /// an error where the bound is 0). Gathered by the expert-parallel all-to-alls only (see
    /// `expert::send`); at most 1 when the codec keeps its bound.
    pub max_err_over_bound: f64,
}

impl ErrorStats {
    /// Relative L2 error over all calls.
    pub fn rel_l2(&self) -> f64 {
        if self.sq_ref > 0.0 {
            (self.sq_err / self.sq_ref).sqrt()
        } else {
            0.0
        }
    }

    /// Relative L2 error over all calls without the first row of each buffer (0 when the row
    /// length is unknown).
    pub fn rel_l2_rest(&self) -> f64 {
        if self.sq_ref_rest > 0.0 {
            (self.sq_err_rest / self.sq_ref_rest).sqrt()
        } else {
            0.0
        }
    }

    /// Merges another set of statistics into this one.
    pub fn merge(&mut self, o: &ErrorStats) {
        self.sq_err += o.sq_err;
        self.sq_ref += o.sq_ref;
        self.sq_err_rest += o.sq_err_rest;
        self.sq_ref_rest += o.sq_ref_rest;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
        self.max_abs_input = self.max_abs_input.max(o.max_abs_input);
        self.max_err_over_bound = self.max_err_over_bound.max(o.max_err_over_bound);
        self.calls += o.calls;
    }
}
