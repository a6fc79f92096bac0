//! The cost model: the calibration's measured tables, the agreed model every rank plans with, and
//! the quantized AllReduce's measured times.

use crate::error::Error;

use super::{Algorithm, Collective, Protocol, QuantSpec};

/// Message sizes (bytes of one rank) at which calibration times every (algorithm, protocol):
/// the decode range by factors of 2, then larger points up to the pull area's default reach
/// (16 MiB), where the protocols' bandwidths decide.
pub const CALIB_SIZES: [u64; 11] = [
    4 << 10,
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
];

/// From this message size on, calibration stops timing a combination that was measured more than
/// [`PRUNE_FACTOR`] times slower than the fastest at a size: it will not be chosen at larger
/// sizes either, and timing it there (LL at 16 MiB on 8 ranks takes milliseconds a call) is most of
/// what set-up would otherwise wait for. Below it every combination is timed everywhere: at the
/// smallest sizes a protocol that is slow there may still win later (PULL's fixed cost).
pub const PRUNE_FROM: u64 = 1 << 20;
/// See [`PRUNE_FROM`].
pub const PRUNE_FACTOR: f64 = 3.0;

/// The calibration's table while it is being measured, size by size: which combinations are
/// still timed, and each one's times. Fed the agreed (every rank's maximum) times of each size,
/// so every rank drops the same combinations at the same size and runs the same timed plans.
#[derive(Clone, Debug)]
pub struct Calibration {
    rows: Vec<[f64; CALIB_SIZES.len()]>,
    /// The size index at which a combination was dropped (`None`: still timed).
    dropped: Vec<Option<usize>>,
}

impl Calibration {
    /// A table for `n` combinations, all of them to be timed.
    pub fn new(n: usize) -> Calibration {
        Calibration {
            rows: vec![[0.0; CALIB_SIZES.len()]; n],
            dropped: vec![None; n],
        }
    }

    /// Whether combination `k` is still timed.
    pub fn live(&self, k: usize) -> bool {
        self.dropped[k].is_none()
    }

    /// Every rank's times of one size (as serialized by the caller: `n` little-endian f64 each)
    /// reduced to their element-wise maximum.
    pub fn agree_times(all: &[Vec<u8>], n: usize) -> Result<Vec<f64>, Error> {
        let mut out = vec![0f64; n];
        for b in all {
            if b.len() != 8 * n {
                return Err(Error::Bootstrap(
                    "malformed calibration times from a peer".into(),
                ));
            }
            for (k, t) in out.iter_mut().enumerate() {
                *t = t.max(f64::from_le_bytes(b[8 * k..8 * k + 8].try_into().unwrap()));
            }
        }
        Ok(out)
    }

    /// Records the agreed times of size `i` for the live combinations, then drops those more
    /// than [`PRUNE_FACTOR`] times slower than the fastest, from [`PRUNE_FROM`] on.
    pub fn record(&mut self, i: usize, agreed: &[f64]) {
        let mut fastest = f64::INFINITY;
        for (k, &t) in agreed.iter().enumerate() {
            if self.live(k) {
                self.rows[k][i] = t;
                fastest = fastest.min(t);
            }
        }
        if CALIB_SIZES[i] >= PRUNE_FROM {
            for (k, &t) in agreed.iter().enumerate() {
                if self.live(k) && t > PRUNE_FACTOR * fastest {
                    self.dropped[k] = Some(i);
                }
            }
        }
    }

    /// Stops timing combination `k` from size index `i` on (`i >= 1`: it was timed at the sizes
    /// before), as if it had been dropped at size `i - 1`: for what the pull area cannot serve.
    /// Every rank calls it alike (the arena is agreed).
    pub fn stop(&mut self, k: usize, i: usize) {
        if i > 0 && self.dropped[k].is_none() {
            self.dropped[k] = Some(i - 1);
        }
    }

    /// Combination `k`'s row: measured times, and past the size at which it was dropped, its last
    /// time scaled in proportion to the size (above the linear extension of any time with a fixed
    /// cost, so the estimate errs towards "slower": the planner keeps not choosing it).
    pub fn row(&self, k: usize) -> [f64; CALIB_SIZES.len()] {
        let mut r = self.rows[k];
        if let Some(last) = self.dropped[k] {
            for i in last + 1..CALIB_SIZES.len() {
                r[i] = r[last] * CALIB_SIZES[i] as f64 / CALIB_SIZES[last] as f64;
            }
        }
        r
    }
}

/// Candidates whose predicted time is within this factor of the fastest count as ties, and a
/// tie goes to the first in a fixed order (one-shot before two-shot, LL before BLOCK): noise
/// between two nearly equal plans then cannot flip the choice from one calibration to the next,
/// and the plan chosen is never more than this factor slower than the best one predicted.
pub const TIE_FACTOR: f64 = 1.03;

/// Whether a calibration table holds a measured time (positive and finite; 0: not measured).
fn measured(t: f64) -> bool {
    t > 0.0 && t.is_finite()
}

/// A time from a row measured at [`CALIB_SIZES`]: piecewise linear between the measured sizes,
/// the last segment's slope (never negative) beyond the largest. A row may leave its smallest
/// sizes unmeasured (0); from its first measured size on every entry must be measured. `None`
/// below the first measured size (unless that is the smallest of all, whose time then holds
/// below it too), or when fewer than two sizes are measured.
pub(super) fn interpolate(row: &[f64; CALIB_SIZES.len()], bytes: u64) -> Option<f64> {
    let first = row.iter().position(|&t| measured(t))?;
    let last = CALIB_SIZES.len() - 1;
    if first == last || !row[first..].iter().all(|&t| measured(t)) {
        return None;
    }
    if bytes <= CALIB_SIZES[first] {
        return (first == 0 || bytes == CALIB_SIZES[first]).then_some(row[first]);
    }
    // The segment that holds `bytes` (the last one beyond the largest size).
    let i = CALIB_SIZES
        .iter()
        .position(|&s| bytes <= s)
        .unwrap_or(last)
        .max(first + 1);
    let (x0, x1) = (CALIB_SIZES[i - 1] as f64, CALIB_SIZES[i] as f64);
    let slope = ((row[i] - row[i - 1]) / (x1 - x0)).max(0.0);
    Some(row[i - 1] + slope * (bytes as f64 - x0))
}

/// Protocols the cost model has a row for (every one of [`Protocol::ALL`]).
const NPROTO: usize = Protocol::ALL.len();

/// The latency model per (algorithm, protocol), in microseconds for a message of `bytes` bytes
/// per rank: the times measured at [`CALIB_SIZES`] when calibrated (piecewise linear between
/// them, the last segment's slope beyond the largest, the smallest's time below it), otherwise
/// a linear model `t = a + b * bytes`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Fixed cost in microseconds, indexed [algorithm][protocol].
    pub a_us: [[f64; NPROTO]; 2],
    /// Cost per byte in microseconds, indexed [algorithm][protocol].
    pub b_us_per_byte: [[f64; NPROTO]; 2],
    /// Measured microseconds at [`CALIB_SIZES`], indexed [algorithm][protocol][size]; a row
    /// with any entry that is not positive is not used (the linear model applies).
    pub table_us: [[[f64; CALIB_SIZES.len()]; NPROTO]; 2],
    /// Measured microseconds of ReduceScatter, AllGather and AllToAll per protocol at
    /// [`CALIB_SIZES`] of the whole buffer (the ReduceScatter's input, the AllGather's output,
    /// the AllToAll's buffer, as nccl-tests counts them), indexed [collective][protocol][size]
    /// ([`MOVES`]); a row with any entry that is not positive was not measured.
    pub moves_us: [[[f64; CALIB_SIZES.len()]; NPROTO]; MOVES.len()],
    /// Whether the constants were measured on this machine (false: defaults).
    pub calibrated: bool,
}

/// The collectives with rows of their own in [`CostModel::moves_us`], in its order.
pub const MOVES: [Collective; 3] = [
    Collective::ReduceScatter,
    Collective::AllGather,
    Collective::AlltoAll,
];

/// Bytes of a serialized [`CostModel`].
const MODEL_BYTES: usize = 8
    * (2 * NPROTO * 2 + 2 * NPROTO * CALIB_SIZES.len() + MOVES.len() * NPROTO * CALIB_SIZES.len());

/// Position of `coll` in [`MOVES`].
fn move_index(coll: Collective) -> Option<usize> {
    MOVES.iter().position(|&c| c == coll)
}

impl CostModel {
    /// Defaults for `nranks` ranks, used until calibration runs (or when it is disabled). They
    /// encode the structure: LL halves the density but saves a fence per frame; two-shot moves
    /// 2(N-1)/N of the message per rank instead of N-1 but takes two steps. The PULL protocols
    /// get a fixed cost no push plan reaches: they are chosen by measurement only.
    pub fn default_for(nranks: u32) -> CostModel {
        let n = nranks.max(1) as f64;
        let link = 150_000.0; // bytes per microsecond a rank can push (150 GB/s)
        let one = (n - 1.0).max(1.0) / link;
        let two = 2.0 * (n - 1.0).max(1.0) / n / link;
        CostModel {
            a_us: [[3.0, 6.0, 1e6, 1e6], [5.0, 10.0, 1e6, 1e6]],
            b_us_per_byte: [[2.0 * one, one, one, one], [2.0 * two, two, two, two]],
            table_us: [[[0.0; CALIB_SIZES.len()]; NPROTO]; 2],
            moves_us: [[[0.0; CALIB_SIZES.len()]; NPROTO]; MOVES.len()],
            calibrated: false,
        }
    }

    /// Predicted microseconds of `coll` (one of [`MOVES`]) with `proto` for a whole buffer of
    /// `bytes` bytes, where its own row was measured (`None` otherwise).
    pub fn predict_move(&self, coll: Collective, proto: Protocol, bytes: u64) -> Option<f64> {
        let row = &self.moves_us[move_index(coll)?][proto.index()];
        if row.iter().all(|&t| measured(t)) {
            interpolate(row, bytes)
        } else {
            None
        }
    }

    /// Whether `coll` has measured rows of its own: its push protocols were timed (they always
    /// apply), so the planner weighs its measured protocols and leaves the others out.
    pub fn moves_measured(&self, coll: Collective) -> bool {
        Protocol::PUSH
            .iter()
            .all(|&p| self.predict_move(coll, p, CALIB_SIZES[0]).is_some())
    }

    /// Records the times of `coll` with `proto` measured at [`CALIB_SIZES`].
    pub fn set_move_measured(
        &mut self,
        coll: Collective,
        proto: Protocol,
        us: [f64; CALIB_SIZES.len()],
    ) {
        if let Some(c) = move_index(coll) {
            self.moves_us[c][proto.index()] = us;
        }
    }

    /// Predicted microseconds.
    pub fn predict(&self, algo: Algorithm, proto: Protocol, bytes: u64) -> f64 {
        let row = &self.table_us[algo.index()][proto.index()];
        if row.iter().all(|&t| measured(t))
            && let Some(t) = interpolate(row, bytes)
        {
            return t;
        }
        self.a_us[algo.index()][proto.index()]
            + self.b_us_per_byte[algo.index()][proto.index()] * bytes as f64
    }

    /// Records the times measured at [`CALIB_SIZES`] for one combination (and the linear model
    /// through the smallest and largest, for whoever reads `a` and `b`).
    pub fn set_measured(&mut self, algo: Algorithm, proto: Protocol, us: [f64; CALIB_SIZES.len()]) {
        let last = CALIB_SIZES.len() - 1;
        self.fit(
            algo,
            proto,
            (CALIB_SIZES[0], us[0]),
            (CALIB_SIZES[last], us[last]),
        );
        self.table_us[algo.index()][proto.index()] = us;
    }

    /// Fits `a` and `b` of one combination from two measurements (bytes, microseconds).
    pub fn fit(&mut self, algo: Algorithm, proto: Protocol, small: (u64, f64), large: (u64, f64)) {
        let b = ((large.1 - small.1) / (large.0 as f64 - small.0 as f64)).max(1e-9);
        let a = (small.1 - b * small.0 as f64).max(0.0);
        self.a_us[algo.index()][proto.index()] = a;
        self.b_us_per_byte[algo.index()][proto.index()] = b;
    }

    /// Serializes for the exchange between ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(MODEL_BYTES);
        for i in 0..2 {
            for j in 0..NPROTO {
                v.extend_from_slice(&self.a_us[i][j].to_le_bytes());
                v.extend_from_slice(&self.b_us_per_byte[i][j].to_le_bytes());
            }
        }
        for i in 0..2 {
            for j in 0..NPROTO {
                for t in self.table_us[i][j] {
                    v.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        for rows in &self.moves_us {
            for row in rows {
                for t in row {
                    v.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        v
    }

    /// The element-wise maximum of every rank's model: one model all ranks agree on.
    pub fn agree(models: &[Vec<u8>]) -> Result<CostModel, Error> {
        let mut m = CostModel {
            a_us: [[0.0; NPROTO]; 2],
            b_us_per_byte: [[0.0; NPROTO]; 2],
            table_us: [[[0.0; CALIB_SIZES.len()]; NPROTO]; 2],
            moves_us: [[[0.0; CALIB_SIZES.len()]; NPROTO]; MOVES.len()],
            calibrated: true,
        };
        for bytes in models {
            if bytes.len() != MODEL_BYTES {
                return Err(Error::Bootstrap("malformed cost model from a peer".into()));
            }
            let f = |k: usize| f64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().unwrap());
            for i in 0..2 {
                for j in 0..NPROTO {
                    let k = (i * NPROTO + j) * 2;
                    m.a_us[i][j] = m.a_us[i][j].max(f(k));
                    m.b_us_per_byte[i][j] = m.b_us_per_byte[i][j].max(f(k + 1));
                    let base = 2 * NPROTO * 2 + (i * NPROTO + j) * CALIB_SIZES.len();
                    for (s, t) in m.table_us[i][j].iter_mut().enumerate() {
                        *t = t.max(f(base + s));
                    }
                }
            }
            let mut k = 2 * NPROTO * 2 + 2 * NPROTO * CALIB_SIZES.len();
            for rows in &mut m.moves_us {
                for row in rows.iter_mut() {
                    for t in row.iter_mut() {
                        *t = t.max(f(k));
                        k += 1;
                    }
                }
            }
        }
        Ok(m)
    }
}

/// The measured times of the quantized AllReduce with one codec setting: bf16 (f16 has the same
/// wire format sizes) at [`CALIB_SIZES`], one row per algorithm (indexed by
/// `Algorithm::index`); 0 where not measured (two-step below [`QUANT_TWO_STEP_MIN_BLOCKS`](super::QUANT_TWO_STEP_MIN_BLOCKS) or
/// with fewer codec blocks than ranks, where it is never planned).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantModel {
    /// The codec setting measured.
    pub spec: QuantSpec,
    /// Microseconds, indexed [algorithm][size].
    pub table_us: [[f64; CALIB_SIZES.len()]; 2],
}

/// Bytes of a serialized [`QuantModel`]'s table.
const QUANT_MODEL_BYTES: usize = 8 * 2 * CALIB_SIZES.len();

impl QuantModel {
    /// Predicted microseconds of `algo` for a message of `bytes` bytes per rank, where measured
    /// ([`interpolate`]).
    pub fn predict(&self, algo: Algorithm, bytes: u64) -> Option<f64> {
        interpolate(&self.table_us[algo.index()], bytes)
    }

    /// Serializes the tables of `models` (in their order) for the exchange between ranks.
    pub fn to_bytes(models: &[QuantModel]) -> Vec<u8> {
        let mut v = Vec::with_capacity(QUANT_MODEL_BYTES * models.len());
        for m in models {
            for row in &m.table_us {
                for t in row {
                    v.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        v
    }

    /// The element-wise maximum of every rank's tables for `specs` (every rank measured the same
    /// settings in the same order): one set of models all ranks agree on.
    pub fn agree(specs: &[QuantSpec], tables: &[Vec<u8>]) -> Result<Vec<QuantModel>, Error> {
        let mut models: Vec<QuantModel> = specs
            .iter()
            .map(|&spec| QuantModel {
                spec,
                table_us: [[0.0; CALIB_SIZES.len()]; 2],
            })
            .collect();
        for bytes in tables {
            if bytes.len() != QUANT_MODEL_BYTES * specs.len() {
                return Err(Error::Bootstrap(
                    "malformed quantized cost model from a peer".into(),
                ));
            }
            let f = |k: usize| f64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().unwrap());
            let mut k = 0;
            for m in &mut models {
                for row in &mut m.table_us {
                    for t in row.iter_mut() {
                        *t = t.max(f(k));
                        k += 1;
                    }
                }
            }
        }
        Ok(models)
    }
}
