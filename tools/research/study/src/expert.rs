//! Expert parallelism simulated on the dense model: the two all-to-alls of an MoE layer, dispatch
//! and combine, applied to the MLP block of every layer.
//!
//! SmolLM2 is dense, so its MLP plays the part of the one expert every token is routed to (top-1
//! routing, gate weight 1), and the model otherwise runs at TP = 1, with no all-reduce. In every
//! layer:
//!
//! * **dispatch**: the MLP block's input, the RMS-normalized hidden state of each token
//!   (`ffn_norm` applied), `[tokens × hidden]`, is what each token sends to the rank that holds
//!   its expert;
//! * **combine**: the MLP block's output (after `down_proj`), `[tokens × hidden]`, is what the
//!   expert's rank sends back, to be added to the residual stream.
//!
//! Each leg is one [`Leg`]: unrounded `f32` (the plain model), the exact all-to-all of the `bf16`
//! values (the all-to-all's datatype in serving: the values are rounded to `bf16` and arrive
//! unchanged), or the codec's quantized all-to-all: the `bf16` values sent to one peer are encoded
//! once as a buffer of their own and decoded by that peer (one round trip,
//! `flashcomm_codec::reference::alltoall_quant`).
//!
//! **The per-peer block.** All tokens of a window go to the one expert, so the block one rank
//! sends to the expert's rank is the whole `[tokens × hidden]` buffer, row-major, one contiguous
//! buffer. The codec cuts it into blocks of 1024 values and each block into groups of `G`
//! consecutive values, over the flattened rows. With hidden = 576: where `G` divides 576 (32 and
//! 64), and since `G` also divides 1024, every group lies inside one token's vector, so each
//! token's round trip depends only on its own values and not on which other tokens share the
//! block; at `G` = 128 and 256 (576 = 4.5 × 128 = 2.25 × 256) groups straddle two tokens, as the
//! kernel's would, and a token's round trip also depends on its neighbour in the block.

use crate::spec::{Backend, ErrorStats, Spec};
use half::bf16;
use std::fmt;

/// How one all-to-all of the expert-parallel simulation moves its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Leg {
    /// Not rounded at all: the plain `f32` model (a reference, not an all-to-all that serving
    /// would run).
    F32,
    /// The exact all-to-all of `bf16` values: each value rounded to `bf16`, received unchanged.
    Exact,
    /// The codec's quantized all-to-all: the `bf16` per-peer block encoded once with this format
    /// and decoded by the receiver.
    Quantized(Spec),
}

impl Leg {
    /// The format of a quantized leg.
    pub fn spec(self) -> Option<Spec> {
        match self {
            Leg::Quantized(f) => Some(f),
            Leg::F32 | Leg::Exact => None,
        }
    }
}

impl fmt::Display for Leg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Leg::F32 => write!(f, "f32"),
            Leg::Exact => write!(f, "bf16"),
            Leg::Quantized(s) => write!(f, "{s}"),
        }
    }
}

/// Sends one per-peer block (`[tokens × hidden]`, row-major, `f32`) through `leg` and returns what
/// the receiver holds, in `f32`. `quantize` false runs a quantized leg as the exact one (a layer
/// outside the setting's scope); its call still counts, with no error.
///
/// For a quantized leg, `stats` gathers the error against the exact `bf16` all-to-all (the
/// values rounded to `bf16`): squared errors and references (also without the first `row`
/// values, the first token, when `row > 0`), the largest error, the largest `|input|`, and the
/// largest ratio of an error to the codec's own per-element bound. The other legs leave `stats`
/// alone.
///
/// # Errors
///
/// When the backend has no quantized all-to-all.
pub fn send(
    backend: &dyn Backend,
    leg: Leg,
    quantize: bool,
    block: Vec<f32>,
    row: usize,
    stats: &mut ErrorStats,
) -> Result<Vec<f32>, String> {
    let f = match leg {
        Leg::F32 => return Ok(block),
        Leg::Exact => {
            return Ok(block
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect());
        }
        Leg::Quantized(f) => f,
    };
    let exact: Vec<bf16> = block.iter().map(|&v| bf16::from_f32(v)).collect();
    let (out, bound) = if quantize {
        backend.all_to_all_block(f, &exact)?
    } else {
        (exact.clone(), vec![0.0; exact.len()])
    };
    if out.len() != exact.len() || bound.len() != exact.len() {
        return Err("the all-to-all changed the block's length".into());
    }
    let mut local = ErrorStats {
        calls: 1,
        max_abs_input: block.iter().fold(0f64, |a, &v| a.max(f64::from(v).abs())),
        ..ErrorStats::default()
    };
    for (i, ((&q, &e), &b)) in out.iter().zip(&exact).zip(&bound).enumerate() {
        let (q, e) = (f64::from(q.to_f32()), f64::from(e.to_f32()));
        let d = q - e;
        local.sq_err += d * d;
        local.sq_ref += e * e;
        if row > 0 && i >= row {
            local.sq_err_rest += d * d;
            local.sq_ref_rest += e * e;
        }
        local.max_abs_err = local.max_abs_err.max(d.abs());
        let over = if d == 0.0 {
            0.0
        } else if b > 0.0 {
            d.abs() / b
        } else {
            f64::INFINITY
        };
        local.max_err_over_bound = local.max_err_over_bound.max(over);
    }
    stats.merge(&local);
    Ok(out.into_iter().map(bf16::to_f32).collect())
}
