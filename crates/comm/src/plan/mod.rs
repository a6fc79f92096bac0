//! Pure planning: the arena geometry, how a call is cut into chunks, and the cost-guided choice
//! of algorithm and protocol. Nothing here touches the GPU, so every rank computes the same plan
//! from the same inputs, and everything here is unit-tested on the CPU.
//!
//! `arena` lays out the arena and cuts a message into blocks and chunks, `cost` holds the cost
//! model (the calibration's tables, lossless and quantized), `select` chooses the plan of a
//! call. This file holds the words of a plan (collective, element type, protocol, algorithm,
//! forced or automatic choice, codec settings) and the [`Plan`] itself.

use crate::error::Error;

mod arena;
pub mod copy;
mod cost;
mod select;

pub use arena::{
    Arena, LL_BLOCK_THREADS, LL_THREAD_BYTES, PULL_ONESHOT_BLOCK_BYTES, PULL_PIECE_BLOCK_BYTES,
    PULL_TWOSHOT_BLOCK_BYTES, chunk_for, grid_for, pull_shape, shape_for, shard_elems,
};
pub use cost::{
    CALIB_SIZES, Calibration, CostModel, MOVES, PRUNE_FACTOR, PRUNE_FROM, QuantModel, TIE_FACTOR,
};
pub use select::{plan, plan_quant, plan_quant_op, quant_pays, quant_shape};

/// The kind of a collective: the tree's one collective enum. flashcomm's kernels implement
/// AllReduce, ReduceScatter, AllGather and AllToAll ([`Collective::KERNELS`]); the communicator
/// refuses the other kinds.
pub use flashcomm_codec::Collective;

/// Element types of the reducing collectives: the codec's, the one datatype enum of the tree.
pub use flashcomm_codec::DType as DataType;
/// How readiness travels with the data, the AllReduce algorithms, a forced or automatic choice
/// and whether quantizing must pay: the codec crate's words, declared there once.
pub use flashcomm_codec::{Algorithm, Choice, HostCopy, Protocol, QuantChoice};

/// Codec settings of a quantized AllReduce (the wire format of docs/codec.md): the width of the
/// first step (the only step of one-shot), the width of the all-gather step of two-step, the group
/// size and the spikes kept per group. The same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Bits per value of the reduce-scatter step (and of one-shot): 2..=8.
    pub rs_bits: u8,
    /// Bits per value of the all-gather step: 2..=8 (equal to `rs_bits`, or 8).
    pub ag_bits: u8,
    /// Values per group: 32, 64, 128 or 256.
    pub group: u16,
    /// Extreme values kept exactly per group: 0, 2 or 4.
    pub spikes: u8,
}

impl QuantSpec {
    /// Checks the combination (the kernels exist for equal widths and for an 8-bit all-gather).
    pub fn new(rs_bits: u8, ag_bits: u8, group: u16, spikes: u8) -> Result<QuantSpec, Error> {
        let ok_bits = |b: u8| (2..=8).contains(&b);
        if !ok_bits(rs_bits) || !ok_bits(ag_bits) {
            return Err(Error::InvalidArgument(format!(
                "quantization widths {rs_bits}/{ag_bits}: allowed 2..=8"
            )));
        }
        if ag_bits != rs_bits && ag_bits != 8 {
            return Err(Error::Unsupported(format!(
                "quantization widths {rs_bits}/{ag_bits}: the all-gather width must equal the reduce-scatter width or be 8"
            )));
        }
        if ![32, 64, 128, 256].contains(&group) {
            return Err(Error::InvalidArgument(format!(
                "group size {group}: allowed 32, 64, 128, 256"
            )));
        }
        if ![0, 2, 4].contains(&spikes) {
            return Err(Error::InvalidArgument(format!(
                "spikes {spikes}: allowed 0, 2, 4"
            )));
        }
        Ok(QuantSpec {
            rs_bits,
            ag_bits,
            group,
            spikes,
        })
    }
}

impl QuantSpec {
    /// Whether kernels exist for this pair of widths (the catalogue's
    /// `QUANT_TWOSTEP_BITS`: equal widths, or an 8-bit all-gather after a 2-, 3- or 4-bit
    /// reduce-scatter).
    pub fn has_kernels(&self) -> bool {
        flashcomm_kernels::catalog::twostep_pair(self.rs_bits, self.ag_bits).is_some()
    }

    /// Whether kernels quantize `coll` with these settings: AllReduce's two steps as
    /// [`QuantSpec::has_kernels`] says; ReduceScatter, AllGather and AllToAll, one step at
    /// `rs_bits`, at every width; no other kind.
    pub fn has_kernels_for(&self, coll: Collective) -> bool {
        match coll {
            Collective::AllReduce => self.has_kernels(),
            c => Collective::KERNELS.contains(&c),
        }
    }

    /// The codec format of one step.
    pub fn format(&self, dtype: DataType, bits: u8) -> Result<flashcomm_codec::Format, Error> {
        flashcomm_codec::Format::new(dtype, bits, self.group, self.spikes)
            .map_err(|e| Error::InvalidArgument(format!("codec format: {e:?}")))
    }
}

/// Values per codec block.
pub const CODEC_BLOCK_VALUES: u64 = 1024;
/// Threads per block of the quantized kernels.
pub const QUANT_THREADS: u32 = 256;
/// Codec blocks below which a quantized AllReduce is one-shot whatever the cost model says
/// (64: 128 KiB of bf16). Two-step's three dependent steps cost more than one-shot's extra
/// decoding there, and the model, which scales the lossless rows by the compressed bytes, picked
/// two-step at 64 KiB now and then (host transport, 2 ranks, 4-bit: 78 us against one-shot's 44).
/// At 256 KiB it is not so: 8 ranks on the host transport, one-shot took 1.5-3x two-step's time
/// (docs/experiments.md, "A chunk's codec blocks shared by a block's warps").
pub const QUANT_TWO_STEP_MIN_BLOCKS: u64 = 64;

/// Everything a launch needs besides buffers: chosen variant and geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The collective.
    pub coll: Collective,
    /// AllReduce algorithm (one-shot for the others).
    pub algo: Algorithm,
    /// Protocol.
    pub proto: Protocol,
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub threads: u32,
    /// Sub-slot bytes.
    pub sub_bytes: u64,
    /// Payload bytes per chunk.
    pub chunk_bytes: u64,
    /// The lossless AllReduce moved by the copy engines on the host transport
    /// ([`copy`], `FLASHCOMM_HOST_COPY`) instead of the kernel of the other fields, which the
    /// call would have taken otherwise.
    pub copy_engines: bool,
    /// Two-shot shard elements (0 otherwise).
    pub shard_elems: u64,
    /// Codec settings when the call is quantized.
    pub quant: Option<QuantSpec>,
}

#[cfg(test)]
mod tests {
    use super::cost::interpolate;
    use super::*;
    use crate::abi::{
        FRAME_BYTES, FRAME_PAYLOAD, LL_LINE, PULL_FLAG_BYTES, PULL_MAX_BLOCKS, THREADS,
    };

    #[test]
    fn arena_fits_cap_and_is_aligned() {
        for n in 1..=8 {
            let a = Arena::new(n, 64 << 20).unwrap();
            assert!(a.total_bytes <= 64 << 20);
            assert_eq!(a.slot_bytes % (64 * 1024), 0);
            assert_eq!(a.half_bytes, 2 * a.region_bytes);
            assert!(a.max_grid() >= 16);
        }
        assert!(Arena::new(9, 64 << 20).is_err());
        assert!(Arena::new(8, 1 << 20).is_err());
    }

    #[test]
    fn alltoall_grids_are_sized_for_the_whole_message() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        for per_peer in [1u64 << 10, 32 << 10] {
            let count = per_peer / 2;
            let a2a = plan(
                &a,
                &m,
                Collective::AlltoAll,
                count,
                2,
                64,
                Choice::Auto,
                Choice::Auto,
            );
            let (grid, _) = shape_for(a2a.proto, per_peer * 8, 64.min(a.max_grid()));
            assert_eq!(a2a.grid, grid, "{per_peer} bytes per peer");
            assert!(a2a.grid > shape_for(a2a.proto, per_peer, 64).0 || a2a.grid == 64);
            assert!(
                a2a.chunk_bytes * u64::from(a2a.grid) >= per_peer,
                "every byte has a block"
            );
        }
    }

    #[test]
    fn chunking_fits_sub_slots() {
        let a = Arena::new(8, 64 << 20).unwrap();
        for grid in [1, 7, 16, 64, a.max_grid()] {
            let (sub, chunk) = a.chunking(Protocol::Ll, grid);
            assert!(2 * grid as u64 * sub <= a.ll_bytes);
            assert_eq!(chunk * 2, sub);
            assert_eq!(chunk % 8, 0);
            let (sub, chunk) = a.chunking(Protocol::Block, grid);
            assert!(2 * grid as u64 * sub <= a.block_bytes());
            assert_eq!(a.area_offset(Protocol::Block) % FRAME_BYTES % 16, 0);
            assert_eq!(sub % FRAME_BYTES, 0);
            assert_eq!(chunk, sub / FRAME_BYTES * FRAME_PAYLOAD);
        }
    }

    #[test]
    fn launch_shapes_use_whole_blocks() {
        // (bytes, max_grid) -> (grid, threads)
        assert_eq!(shape_for(Protocol::Ll, 8 << 10, 66), (4, 256));
        assert_eq!(shape_for(Protocol::Ll, 64 << 10, 66), (32, 256));
        assert_eq!(shape_for(Protocol::Ll, 128 << 10, 66), (64, 256));
        assert_eq!(shape_for(Protocol::Ll, 256 << 10, 66), (66, 512));
        assert_eq!(shape_for(Protocol::Ll, 100, 66), (1, 256));
        assert_eq!(shape_for(Protocol::Block, 8 << 10, 66), (1, THREADS));
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        for bytes in [8u64 << 10, 64 << 10, 1 << 20] {
            let p = plan(
                &a,
                &m,
                Collective::AllReduce,
                bytes / 2,
                2,
                16,
                Choice::Force(Algorithm::OneShot),
                Choice::Force(Protocol::Ll),
            );
            assert!(p.grid <= 16 && p.threads <= THREADS && p.threads.is_multiple_of(32));
            assert!(p.sub_bytes >= LL_LINE);
            // Every block has work, and one round covers the message unless a chunk is as
            // large as a sub-slot carries.
            assert!(p.chunk_bytes * (p.grid as u64 - 1) < bytes);
            let capacity = a.chunking(Protocol::Ll, p.grid).1;
            assert!(p.chunk_bytes * p.grid as u64 >= bytes || p.chunk_bytes == capacity);
        }
    }

    #[test]
    fn chunks_spread_the_message_over_the_grid() {
        assert_eq!(chunk_for(8 << 10, 8, 1 << 20), 1024);
        assert_eq!(chunk_for(100, 1, 1 << 20), 112);
        assert_eq!(chunk_for(1 << 30, 4, 1 << 20), 1 << 20);
        assert_eq!(chunk_for(0, 4, 1 << 20), 16);
    }

    #[test]
    fn shards_are_aligned_and_never_empty() {
        for n in 1..=8u32 {
            for count in [1u64, 7, 8, 63, 64, 1000, 4097, 1 << 20] {
                for elem in [2u64, 4] {
                    if let Some(s) = shard_elems(count, n, elem) {
                        assert_eq!((s * elem) % 16, 0);
                        assert!(
                            (n as u64 - 1) * s < count,
                            "last shard empty n={n} count={count}"
                        );
                        assert!(n as u64 * s >= count);
                    }
                }
            }
        }
        assert!(shard_elems(8, 8, 2).is_none());
        assert!(shard_elems(1 << 20, 8, 2).is_some());
    }

    #[test]
    fn selector_prefers_ll_one_shot_small_and_two_shot_block_large() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        let small = plan(
            &a,
            &m,
            Collective::AllReduce,
            4096,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        assert_eq!(
            (small.algo, small.proto),
            (Algorithm::OneShot, Protocol::Ll)
        );
        let large = plan(
            &a,
            &m,
            Collective::AllReduce,
            64 << 20,
            2,
            16,
            Choice::Auto,
            Choice::Auto,
        );
        assert_eq!(
            (large.algo, large.proto),
            (Algorithm::TwoShot, Protocol::Block)
        );
        let forced = plan(
            &a,
            &m,
            Collective::AllReduce,
            64 << 20,
            2,
            16,
            Choice::Force(Algorithm::OneShot),
            Choice::Force(Protocol::Ll),
        );
        assert_eq!(
            (forced.algo, forced.proto),
            (Algorithm::OneShot, Protocol::Ll)
        );
        // two-shot forced on a count too small for shards falls back to one-shot
        let tiny = plan(
            &a,
            &m,
            Collective::AllReduce,
            3,
            2,
            16,
            Choice::Force(Algorithm::TwoShot),
            Choice::Auto,
        );
        assert_eq!(tiny.algo, Algorithm::OneShot);
    }

    #[test]
    fn quantized_plans() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let m = CostModel::default_for(8);
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        // Fewer codec blocks than ranks: two-step impossible.
        let p = plan_quant(
            &a,
            &m,
            None,
            4000,
            DataType::Bf16,
            q,
            16,
            Choice::Force(Algorithm::TwoShot),
        )
        .unwrap();
        assert_eq!(p.algo, Algorithm::OneShot);
        let p = plan_quant(&a, &m, None, 64 << 20, DataType::Bf16, q, 16, Choice::Auto).unwrap();
        assert_eq!(
            (p.algo, p.proto, p.quant),
            (Algorithm::TwoShot, Protocol::Block, Some(q))
        );
        assert!(p.sub_bytes >= FRAME_BYTES);
        assert!(plan_quant(&a, &m, None, 1000, DataType::F32, q, 16, Choice::Auto).is_err());
        assert!(!QuantSpec::new(5, 8, 128, 2).unwrap().has_kernels());
        assert!(QuantSpec::new(4, 8, 128, 2).unwrap().has_kernels());
        assert!(QuantSpec::new(4, 6, 128, 2).is_err());
        assert!(QuantSpec::new(1, 1, 128, 2).is_err());
        assert!(QuantSpec::new(4, 4, 100, 2).is_err());
        assert!(QuantSpec::new(4, 4, 128, 3).is_err());
    }

    #[test]
    fn quantized_chunks_give_every_block_work() {
        // (ranks, values): the kernels cut a message (one-shot), a shard (two-step) or a peer's
        // block (one-step collectives) into chunks of `sub_bytes / FRAME_BYTES` frames, and
        // block b takes chunks b, b + grid, ...: every block must get one, and a chunk must
        // fit its sub-slot.
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        let m = CostModel::default_for(2);
        let per_frame = FRAME_PAYLOAD / q.format(DataType::Bf16, 4).unwrap().block_bytes() as u64;
        for n in [2u32, 4, 8] {
            let a = Arena::new(n, 64 << 20).unwrap();
            for values in [1u64 << 15, 1 << 19, 1 << 21, 1 << 23, 1 << 27] {
                for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                    let p = plan_quant(
                        &a,
                        &m,
                        None,
                        values,
                        DataType::Bf16,
                        q,
                        66,
                        Choice::Force(algo),
                    )
                    .unwrap();
                    let nb = values.div_ceil(CODEC_BLOCK_VALUES);
                    let blocks = if p.algo == Algorithm::TwoShot {
                        nb.div_ceil(n as u64)
                    } else {
                        nb
                    };
                    let frames = blocks.div_ceil(per_frame);
                    let per = p.sub_bytes / FRAME_BYTES;
                    let chunks = frames.div_ceil(per);
                    assert!(
                        chunks >= p.grid as u64,
                        "{n} ranks, {values} values, {algo:?}: {p:?}"
                    );
                    assert!(per * FRAME_BYTES <= a.chunking(Protocol::Block, p.grid).0);
                }
                for coll in [
                    Collective::AllGather,
                    Collective::ReduceScatter,
                    Collective::AlltoAll,
                ] {
                    let p =
                        plan_quant_op(&a, coll, values / n as u64, DataType::Bf16, q, 66).unwrap();
                    let frames = (values / n as u64)
                        .div_ceil(CODEC_BLOCK_VALUES)
                        .div_ceil(per_frame);
                    let chunks = frames.div_ceil(p.sub_bytes / FRAME_BYTES);
                    assert!(
                        chunks >= p.grid as u64,
                        "{coll} {n} ranks, {values} values: {p:?}"
                    );
                    assert!(p.sub_bytes <= a.chunking(Protocol::Block, p.grid).0);
                }
            }
        }
    }

    #[test]
    fn calibrated_table_drives_the_choice_and_ties_are_stable() {
        let a = Arena::new(8, 64 << 20).unwrap();
        let mut m = CostModel::default_for(8);
        let n = CALIB_SIZES.len();
        // One-shot LL best up to 48 KiB, two-shot BLOCK beyond; the others never.
        let mut ll = [0.0; CALIB_SIZES.len()];
        let mut blk2 = [0.0; CALIB_SIZES.len()];
        for i in 0..n {
            ll[i] = 4.0 + CALIB_SIZES[i] as f64 / 4000.0;
            blk2[i] = 15.0 + CALIB_SIZES[i] as f64 / 40000.0;
        }
        m.set_measured(Algorithm::OneShot, Protocol::Ll, ll);
        m.set_measured(Algorithm::TwoShot, Protocol::Block, blk2);
        let slow = CALIB_SIZES.map(|s| 1e3 + s as f64 / 100.0);
        m.set_measured(Algorithm::OneShot, Protocol::Block, slow);
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, slow);
        let pick = |bytes: u64| {
            let p = plan(
                &a,
                &m,
                Collective::AllReduce,
                bytes / 2,
                2,
                64,
                Choice::Auto,
                Choice::Auto,
            );
            (p.algo, p.proto)
        };
        assert_eq!(pick(8 << 10), (Algorithm::OneShot, Protocol::Ll));
        assert_eq!(pick(32 << 10), (Algorithm::OneShot, Protocol::Ll));
        assert_eq!(pick(64 << 10), (Algorithm::TwoShot, Protocol::Block));
        assert_eq!(pick(256 << 10), (Algorithm::TwoShot, Protocol::Block));
        assert_eq!(pick(64 << 20), (Algorithm::TwoShot, Protocol::Block));
        // Interpolation between measured points, the smallest point below the range.
        let t = m.predict(Algorithm::OneShot, Protocol::Ll, 6 << 10);
        assert!(t > ll[0] && t < ll[1]);
        assert_eq!(m.predict(Algorithm::OneShot, Protocol::Ll, 100), ll[0]);
        // Within TIE_FACTOR the fixed order decides: a slightly faster two-shot loses.
        let mut tie = m;
        tie.set_measured(Algorithm::TwoShot, Protocol::Ll, ll.map(|t| t / 1.02));
        assert_eq!(
            {
                let p = plan(
                    &a,
                    &tie,
                    Collective::AllReduce,
                    4096,
                    2,
                    64,
                    Choice::Auto,
                    Choice::Auto,
                );
                (p.algo, p.proto)
            },
            (Algorithm::OneShot, Protocol::Ll)
        );
        // The table survives the exchange.
        let back = CostModel::agree(&[m.to_bytes()]).unwrap();
        assert_eq!(back.table_us, m.table_us);
    }

    #[test]
    fn agreed_model_is_the_elementwise_max() {
        let mut a = CostModel::default_for(4);
        let mut b = CostModel::default_for(4);
        a.fit(
            Algorithm::OneShot,
            Protocol::Ll,
            (1000, 5.0),
            (100_000, 20.0),
        );
        b.fit(
            Algorithm::OneShot,
            Protocol::Ll,
            (1000, 6.0),
            (100_000, 15.0),
        );
        let m = CostModel::agree(&[a.to_bytes(), b.to_bytes()]).unwrap();
        assert!(m.calibrated);
        assert!(m.a_us[0][0] >= a.a_us[0][0] && m.a_us[0][0] >= b.a_us[0][0]);
        assert_eq!(
            CostModel::agree(&[a.to_bytes(), b.to_bytes()]).unwrap(),
            CostModel::agree(&[b.to_bytes(), a.to_bytes()]).unwrap()
        );
    }

    #[test]
    fn a_forced_quantized_one_shot_stays_one_shot_past_two_rounds() {
        // From the kernel's block barrier before a shared round (docs/experiments.md, "The
        // quantized one-shot's third round"), a one-shot of any number of rounds is planned as
        // asked.
        let a = Arena::new(2, 64 << 20).unwrap();
        let q = QuantSpec::new(8, 8, 128, 2).unwrap();
        let m = CostModel::default_for(2);
        let forced = Choice::Force(Algorithm::OneShot);
        for count in [2u64 << 20, 8 << 20, 32 << 20] {
            let p = plan_quant(&a, &m, None, count, DataType::Bf16, q, 66, forced).unwrap();
            assert_eq!(p.algo, Algorithm::OneShot, "{count}");
        }
    }

    /// A calibrated lossless model of one row (one-shot LL at `lossless(bytes)` us; the other
    /// combinations slower) and the quantized model of `q` at `one(bytes)` / `two(bytes)` us
    /// (two-step measured from 128 KiB, as the calibration does).
    fn models(
        q: QuantSpec,
        lossless: impl Fn(u64) -> f64,
        one: impl Fn(u64) -> f64,
        two: impl Fn(u64) -> f64,
    ) -> (CostModel, QuantModel) {
        let mut m = CostModel::default_for(2);
        m.set_measured(Algorithm::OneShot, Protocol::Ll, CALIB_SIZES.map(&lossless));
        let slow = CALIB_SIZES.map(|s| 2.0 * lossless(s));
        m.set_measured(Algorithm::OneShot, Protocol::Block, slow);
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, slow);
        m.set_measured(Algorithm::TwoShot, Protocol::Block, slow);
        m.calibrated = true;
        let mut qm = QuantModel {
            spec: q,
            table_us: [CALIB_SIZES.map(&one), CALIB_SIZES.map(&two)],
        };
        for (i, &s) in CALIB_SIZES.iter().enumerate() {
            if s / 2 / CODEC_BLOCK_VALUES < QUANT_TWO_STEP_MIN_BLOCKS {
                qm.table_us[Algorithm::TwoShot.index()][i] = 0.0;
            }
        }
        (m, qm)
    }

    #[test]
    fn rows_measured_from_a_size_on_interpolate_there_only() {
        let mut row = CALIB_SIZES.map(|s| s as f64 / 1000.0);
        assert_eq!(interpolate(&row, 1), Some(row[0]));
        row[0] = 0.0;
        row[1] = 0.0;
        // Below the first measured size: not measured; at it and beyond: the table's values.
        assert_eq!(interpolate(&row, CALIB_SIZES[1]), None);
        assert_eq!(interpolate(&row, CALIB_SIZES[2]), Some(row[2]));
        let mid = (CALIB_SIZES[2] + CALIB_SIZES[3]) / 2;
        let t = interpolate(&row, mid).unwrap();
        assert!(t > row[2] && t < row[3]);
        // Beyond the largest: the last slope.
        let last = CALIB_SIZES.len() - 1;
        let far = interpolate(&row, 2 * CALIB_SIZES[last]).unwrap();
        assert!((far - 2.0 * row[last]).abs() < 1e-9);
        // A hole after the first measured size, or one measured size: not used.
        row[5] = 0.0;
        assert_eq!(interpolate(&row, CALIB_SIZES[6]), None);
        let mut one = [0.0; CALIB_SIZES.len()];
        one[last] = 3.0;
        assert_eq!(interpolate(&one, CALIB_SIZES[last]), None);
        assert_eq!(interpolate(&[0.0; CALIB_SIZES.len()], 4096), None);
    }

    #[test]
    fn quantized_calls_run_lossless_where_quantizing_does_not_pay() {
        let a = Arena::new(2, 64 << 20).unwrap();
        let q = QuantSpec::new(4, 4, 128, 2).unwrap();
        // The shape measured on the host transport (docs/perf.md, "The PCIe machine"): lossless
        // cheaper at the small sizes (64 KiB, 256 KiB), quantized cheaper from 1 MiB; two-step
        // cheaper at large sizes.
        let (m, qm) = models(
            q,
            |s| 30.0 + s as f64 / 5000.0,
            |s| 70.0 + s as f64 / 12000.0,
            |s| 90.0 + s as f64 / 16000.0,
        );
        let choose = |bytes: u64, measured: Option<&QuantModel>, model: &CostModel| {
            let count = bytes / 2;
            let quant = plan_quant(
                &a,
                model,
                measured,
                count,
                DataType::Bf16,
                q,
                66,
                Choice::Auto,
            )
            .unwrap();
            let lossless = plan(
                &a,
                model,
                Collective::AllReduce,
                count,
                2,
                66,
                Choice::Auto,
                Choice::Auto,
            );
            let pays = quant_pays(model, &lossless, measured, &quant, bytes);
            (pays, quant.algo)
        };
        assert_eq!(choose(64 << 10, Some(&qm), &m), (false, Algorithm::OneShot));
        assert_eq!(
            choose(256 << 10, Some(&qm), &m),
            (false, Algorithm::OneShot)
        );
        assert_eq!(choose(4 << 20, Some(&qm), &m), (true, Algorithm::TwoShot));
        assert_eq!(choose(4 << 20, Some(&qm), &m), (true, Algorithm::TwoShot));
        // Without a measurement of these settings, or without calibration: quantized as asked,
        // the algorithm from the lossless model's scaled bytes.
        assert!(choose(64 << 10, None, &m).0);
        let mut uncalibrated = m;
        uncalibrated.calibrated = false;
        assert!(choose(64 << 10, Some(&qm), &uncalibrated).0);
        // A tie (within TIE_FACTOR) goes to lossless, and between the quantized algorithms to
        // one-shot.
        let (m, qm) = models(
            q,
            |s| 50.0 + s as f64 / 1e4,
            |s| 49.0 + s as f64 / 1e4,
            |s| 48.5 + s as f64 / 1e4,
        );
        assert_eq!(choose(1 << 20, Some(&qm), &m), (false, Algorithm::OneShot));
        // The measured times decide between the algorithms, not the lossless model's scaled
        // bytes (which, at two ranks, see the same bytes for both and keep one-shot).
        let (m, qm) = models(
            q,
            |s| 1e3 + s as f64,
            |s| 20.0 + s as f64 / 1e4,
            |s| 10.0 + s as f64 / 1e6,
        );
        assert_eq!(choose(4 << 20, Some(&qm), &m), (true, Algorithm::TwoShot));
        assert_eq!(choose(4 << 20, None, &m), (true, Algorithm::OneShot));
        // Two-step's smallest message (64 codec blocks, the last one partial), below the first
        // size it was timed at: one-shot, even where two-step would be faster beyond.
        let just_above = ((QUANT_TWO_STEP_MIN_BLOCKS - 1) * CODEC_BLOCK_VALUES + 1) * 2;
        assert!(just_above < 128 << 10);
        assert_eq!(choose(just_above, Some(&qm), &m).1, Algorithm::OneShot);
        assert_eq!(choose(128 << 10, Some(&qm), &m).1, Algorithm::TwoShot);
    }

    #[test]
    fn quantized_models_agree_as_the_elementwise_max() {
        let q4 = QuantSpec::new(4, 4, 128, 2).unwrap();
        let q8 = QuantSpec::new(8, 8, 128, 2).unwrap();
        let (_, a4) = models(q4, |_| 1.0, |s| s as f64 / 1e3, |s| s as f64 / 2e3);
        let (_, b4) = models(q4, |_| 1.0, |s| s as f64 / 1e3 + 1.0, |s| s as f64 / 4e3);
        let (_, a8) = models(q8, |_| 1.0, |s| s as f64 / 5e2, |s| s as f64 / 5e2);
        let specs = [q4, q8];
        let agreed = QuantModel::agree(
            &specs,
            &[
                QuantModel::to_bytes(&[a4, a8]),
                QuantModel::to_bytes(&[b4, a8]),
            ],
        )
        .unwrap();
        assert_eq!(agreed.len(), 2);
        assert_eq!((agreed[0].spec, agreed[1].spec), (q4, q8));
        assert_eq!(agreed[0].table_us[0], b4.table_us[0]);
        assert_eq!(agreed[0].table_us[1], a4.table_us[1]);
        assert_eq!(agreed[1].table_us, a8.table_us);
        // No settings: nothing to agree on; a peer's table of another length is refused.
        assert_eq!(QuantModel::agree(&[], &[Vec::new()]).unwrap(), Vec::new());
        assert!(QuantModel::agree(&specs, &[QuantModel::to_bytes(&[a4])]).is_err());
    }

    #[test]
    fn quant_shape_is_the_plan_before_the_round_rule() {
        // plan_quant's plans are quant_shape's; at 16 MiB, 8-bit, 2 ranks on 66 blocks, the
        // one-shot (which the GPU test runs through quant_shape) takes 4 rounds of 11-frame
        // chunks (33 codec blocks) and its last chunk, on block 50 in round 3, has 8 codec
        // blocks in 3 frames: the case that gave wrong values before the kernel's barrier.
        let a = Arena::new(2, 64 << 20).unwrap();
        let q = QuantSpec::new(8, 8, 128, 2).unwrap();
        let m = CostModel::default_for(2);
        for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
            for count in [1000, 2 << 20, 8 << 20] {
                let forced = Choice::Force(algo);
                let p = plan_quant(&a, &m, None, count, DataType::Bf16, q, 66, forced).unwrap();
                let (s, _) = quant_shape(&a, count, DataType::Bf16, q, 66, p.algo).unwrap();
                assert_eq!(p, s, "{algo:?} {count}");
            }
        }
        let (p, rounds) =
            quant_shape(&a, 8 << 20, DataType::Bf16, q, 66, Algorithm::OneShot).unwrap();
        assert_eq!(p.algo, Algorithm::OneShot);
        assert_eq!((p.grid, p.sub_bytes / FRAME_BYTES, rounds), (66, 11, 4));
        let k = p.sub_bytes / FRAME_BYTES * 3;
        let nb = (8u64 << 20) / CODEC_BLOCK_VALUES;
        let last = nb.div_ceil(k) - 1;
        assert_eq!((last % 66, last / 66, nb - last * k), (50, 3, 8));
    }

    #[test]
    fn pull_plans_are_forced_or_measured_and_cover_the_message() {
        let mut a = Arena::with_pull(4, 64 << 20, 32 << 20).unwrap();
        assert_eq!(a.pull_half_bytes, 16 << 20);
        assert_eq!(a.total_bytes, a.pull_offset + PULL_FLAG_BYTES + (32 << 20));
        let m = CostModel::default_for(4);
        let ar = |a: &Arena, m: &CostModel, bytes: u64, algo, proto| {
            plan(a, m, Collective::AllReduce, bytes / 2, 2, 64, algo, proto)
        };
        // The default model never picks a PULL protocol.
        for bytes in [8u64 << 10, 1 << 20, 16 << 20] {
            assert!(!ar(&a, &m, bytes, Choice::Auto, Choice::Auto).proto.pulls());
        }
        // Forced: taken where the pull area holds the call, with every block working.
        for bytes in [16u64, 8 << 10, 100_002, 1 << 20, 16 << 20] {
            for algo in Algorithm::ALL {
                let p = ar(
                    &a,
                    &m,
                    bytes,
                    Choice::Force(algo),
                    Choice::Force(Protocol::Pull),
                );
                assert_eq!(p.proto, Protocol::Pull, "{bytes} {algo:?}");
                assert!(p.grid >= 1 && p.grid <= PULL_MAX_BLOCKS && p.grid <= 64);
                assert_eq!(p.chunk_bytes % 16, 0);
                assert_eq!(p.sub_bytes, a.pull_half_bytes);
                let over = if p.algo == Algorithm::TwoShot {
                    p.shard_elems * 2
                } else {
                    bytes
                };
                assert!(p.chunk_bytes * p.grid as u64 >= over, "{p:?}");
                assert!(p.chunk_bytes * (p.grid as u64 - 1) < over, "{p:?}");
            }
        }
        // Too large for the pull area: the push protocols take it.
        let big = ar(
            &a,
            &m,
            32 << 20,
            Choice::Auto,
            Choice::Force(Protocol::Pull),
        );
        assert!(!big.proto.pulls());
        // The other collectives run by loads, one chunk of every piece per block, while the pull
        // area holds what a rank stages (ReduceScatter and AllToAll: N pieces, each rounded up
        // to 16 bytes).
        for coll in [
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AlltoAll,
        ] {
            for count in [1u64, 7, 4096, 1 << 20] {
                let forced = plan(
                    &a,
                    &m,
                    coll,
                    count,
                    2,
                    64,
                    Choice::Auto,
                    Choice::Force(Protocol::Pull),
                );
                assert_eq!(forced.proto, Protocol::Pull, "{coll} {count}");
                assert_eq!(forced.algo, Algorithm::OneShot);
                assert_eq!(forced.shard_elems, 0);
                let piece = count * 2;
                assert!(
                    forced.chunk_bytes * forced.grid as u64 >= piece,
                    "{forced:?}"
                );
                assert!(forced.chunk_bytes * (forced.grid as u64 - 1) < piece.max(1));
                // The default model (uncalibrated) never picks PULL.
                let auto = plan(&a, &m, coll, count, 2, 64, Choice::Auto, Choice::Auto);
                assert!(!auto.proto.pulls(), "{coll} {count}");
            }
            // 4 pieces of 4 MiB fill a staging half of 16 MiB; rounded up, they do not.
            let per = if coll == Collective::AllGather {
                8 << 20
            } else {
                2 << 20
            };
            let fits = plan(
                &a,
                &m,
                coll,
                per,
                2,
                64,
                Choice::Auto,
                Choice::Force(Protocol::Pull),
            );
            assert_eq!(fits.proto, Protocol::Pull, "{coll}");
            let over = plan(
                &a,
                &m,
                coll,
                per + 1,
                2,
                64,
                Choice::Auto,
                Choice::Force(Protocol::Pull),
            );
            assert!(!over.proto.pulls(), "{coll}");
        }
        // Direct only where peers can read the user's buffers; elsewhere it is the staged PULL.
        let d = ar(
            &a,
            &m,
            64 << 10,
            Choice::Auto,
            Choice::Force(Protocol::Direct),
        );
        assert_eq!(d.proto, Protocol::Pull);
        a.direct = true;
        let d = ar(
            &a,
            &m,
            64 << 10,
            Choice::Auto,
            Choice::Force(Protocol::Direct),
        );
        assert_eq!(d.proto, Protocol::Direct);
        // Without a pull area, no PULL protocol at all.
        let none = Arena::with_pull(4, 64 << 20, 0).unwrap();
        assert_eq!(
            none.total_bytes,
            Arena::new(4, 64 << 20).unwrap().total_bytes
        );
        assert!(
            !ar(
                &none,
                &m,
                8 << 10,
                Choice::Auto,
                Choice::Force(Protocol::Pull)
            )
            .proto
            .pulls()
        );
    }

    #[test]
    fn measured_pull_wins_where_it_is_faster() {
        let mut a = Arena::with_pull(8, 64 << 20, 32 << 20).unwrap();
        a.direct = true;
        let mut m = CostModel::default_for(8);
        // LL fastest small, direct two-shot fastest large, staged pull in between.
        let row = |f: &dyn Fn(f64) -> f64| CALIB_SIZES.map(|s| f(s as f64));
        m.set_measured(Algorithm::OneShot, Protocol::Ll, row(&|s| 3.0 + s / 2e4));
        m.set_measured(Algorithm::OneShot, Protocol::Block, row(&|s| 6.0 + s / 4e4));
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, row(&|s| 5.0 + s / 3e4));
        m.set_measured(Algorithm::TwoShot, Protocol::Block, row(&|s| 8.0 + s / 8e4));
        m.set_measured(Algorithm::OneShot, Protocol::Pull, row(&|s| 4.0 + s / 6e4));
        m.set_measured(Algorithm::TwoShot, Protocol::Pull, row(&|s| 9.0 + s / 1e5));
        m.set_measured(
            Algorithm::OneShot,
            Protocol::Direct,
            row(&|s| 6.0 + s / 6e4),
        );
        m.set_measured(
            Algorithm::TwoShot,
            Protocol::Direct,
            row(&|s| 7.0 + s / 2e5),
        );
        m.calibrated = true;
        let pick = |bytes: u64| {
            let p = plan(
                &a,
                &m,
                Collective::AllReduce,
                bytes / 2,
                2,
                64,
                Choice::Auto,
                Choice::Auto,
            );
            (p.algo, p.proto)
        };
        assert_eq!(pick(4 << 10), (Algorithm::OneShot, Protocol::Ll));
        assert_eq!(pick(256 << 10), (Algorithm::OneShot, Protocol::Pull));
        assert_eq!(pick(16 << 20), (Algorithm::TwoShot, Protocol::Direct));
        // The other collectives weigh the same rows: AllGather and AllToAll one-shot's at their
        // piece, ReduceScatter two-shot's at its whole input.
        let other = |coll: Collective, count: u64| {
            plan(&a, &m, coll, count, 2, 64, Choice::Auto, Choice::Auto).proto
        };
        assert_eq!(other(Collective::AllGather, 1 << 10), Protocol::Ll);
        assert_eq!(other(Collective::AllGather, 128 << 10), Protocol::Pull);
        assert_eq!(other(Collective::AlltoAll, 128 << 10), Protocol::Pull);
        assert_eq!(other(Collective::ReduceScatter, 1 << 20), Protocol::Direct);
        // Direct is not a candidate where peers cannot read the user's buffers.
        a.direct = false;
        let p = plan(
            &a,
            &m,
            Collective::AllReduce,
            8 << 20,
            2,
            64,
            Choice::Auto,
            Choice::Auto,
        );
        assert_ne!(p.proto, Protocol::Direct);
        // The model round-trips its PULL rows through the exchange.
        let back = CostModel::agree(&[m.to_bytes()]).unwrap();
        assert_eq!(back.table_us, m.table_us);
    }

    #[test]
    fn measured_moves_choose_from_their_own_rows() {
        let mut a = Arena::with_pull(8, 64 << 20, 32 << 20).unwrap();
        a.direct = true;
        let a = a;
        let mut m = CostModel::default_for(8);
        let row = |f: &dyn Fn(f64) -> f64| CALIB_SIZES.map(|s| f(s as f64));
        // The AllReduce's rows say LL everywhere (the proxy the planner used before)...
        m.set_measured(Algorithm::OneShot, Protocol::Ll, row(&|s| 2.0 + s / 1e6));
        m.set_measured(
            Algorithm::OneShot,
            Protocol::Direct,
            row(&|s| 9.0 + s / 1e6),
        );
        m.set_measured(Algorithm::TwoShot, Protocol::Ll, row(&|s| 2.0 + s / 1e6));
        m.calibrated = true;
        let pick_on = |a: &Arena, m: &CostModel, coll: Collective, whole: u64| {
            plan(a, m, coll, whole / 16, 2, 64, Choice::Auto, Choice::Auto).proto
        };
        let pick = |m: &CostModel, coll: Collective, whole: u64| pick_on(&a, m, coll, whole);
        for coll in MOVES {
            assert!(!m.moves_measured(coll));
            assert_eq!(pick(&m, coll, 64 << 10), Protocol::Ll, "{coll}");
        }
        // ...the AllGather's own rows say direct from 32 KiB of whole buffer.
        m.set_move_measured(Collective::AllGather, Protocol::Ll, row(&|s| 3.0 + s / 1e4));
        m.set_move_measured(
            Collective::AllGather,
            Protocol::Block,
            row(&|s| 6.0 + s / 4e4),
        );
        m.set_move_measured(
            Collective::AllGather,
            Protocol::Direct,
            row(&|s| 5.0 + s / 8e4),
        );
        assert!(m.moves_measured(Collective::AllGather));
        assert_eq!(pick(&m, Collective::AllGather, 8 << 10), Protocol::Ll);
        assert_eq!(pick(&m, Collective::AllGather, 64 << 10), Protocol::Direct);
        assert_eq!(pick(&m, Collective::AllGather, 8 << 20), Protocol::Direct);
        // The staged PULL protocol was not timed: never chosen while the rows are the AllGather's
        // own, even where direct is not offered.
        let mut staged = a;
        staged.direct = false;
        assert_ne!(
            pick_on(&staged, &m, Collective::AllGather, 8 << 20),
            Protocol::Pull
        );
        // Larger than the pull area holds: the push protocols' own rows decide.
        assert_eq!(pick(&m, Collective::AllGather, 512 << 20), Protocol::Block);
        // A forced protocol is taken whatever the rows say.
        let forced = plan(
            &a,
            &m,
            Collective::AllGather,
            4096,
            2,
            64,
            Choice::Auto,
            Choice::Force(Protocol::Pull),
        );
        assert_eq!(forced.proto, Protocol::Pull);
        // The other collectives keep the AllReduce's rows.
        assert_eq!(pick(&m, Collective::AlltoAll, 64 << 10), Protocol::Ll);
        // The rows travel through the exchange; the element-wise maximum of two ranks' models.
        let mut slower = m;
        slower.set_move_measured(
            Collective::AllGather,
            Protocol::Direct,
            row(&|s| 50.0 + s / 8e4),
        );
        let back = CostModel::agree(&[m.to_bytes(), slower.to_bytes()]).unwrap();
        assert_eq!(back.moves_us, slower.moves_us);
        assert_eq!(back.table_us, m.table_us);
        assert_eq!(
            pick(&back, Collective::AllGather, 64 << 10),
            Protocol::Block
        );
    }

    #[test]
    fn calibration_drops_slow_combinations_alike_and_extends_their_rows() {
        let mut cal = Calibration::new(3);
        let serialize = |t: &[f64]| -> Vec<u8> { t.iter().flat_map(|x| x.to_le_bytes()).collect() };
        for (i, &size) in CALIB_SIZES.iter().enumerate() {
            let s = size as f64;
            // Combination 0: fast; 1: 4x slower throughout; 2: slow small, fastest large.
            let rank0 = [1.0 + s / 1e5, 4.0 * (1.0 + s / 1e5), 20.0 + s / 4e5];
            let rank1 = rank0.map(|t| t * 1.01);
            let all = vec![serialize(&rank0), serialize(&rank1)];
            let agreed = Calibration::agree_times(&all, 3).unwrap();
            assert_eq!(agreed[0], rank1[0]);
            let before: Vec<bool> = (0..3).map(|k| cal.live(k)).collect();
            cal.record(i, &agreed);
            // Nothing is dropped below PRUNE_FROM, whatever the ratio.
            if size < PRUNE_FROM {
                assert!((0..3).all(|k| cal.live(k)));
            }
            if !before[1] {
                assert!(!cal.live(1));
            }
        }
        assert!(cal.live(0));
        assert!(!cal.live(1), "4x slower from PRUNE_FROM on: dropped");
        assert!(
            cal.live(2),
            "slow at small sizes, never 3x slower past PRUNE_FROM: kept"
        );
        let r1 = cal.row(1);
        assert!(
            r1.iter().all(|&t| t > 0.0),
            "the dropped row is complete: {r1:?}"
        );
        let first = CALIB_SIZES.iter().position(|&s| s >= PRUNE_FROM).unwrap();
        for i in first + 1..CALIB_SIZES.len() {
            assert!(r1[i] >= 4.0 * (1.0 + CALIB_SIZES[i] as f64 / 1e5));
        }
        assert!(Calibration::agree_times(&[vec![0u8; 7]], 1).is_err());
    }

    #[test]
    fn a_combination_the_pull_area_cannot_serve_stops_and_its_row_continues() {
        let mut cal = Calibration::new(2);
        let last = CALIB_SIZES.len() - 1;
        for i in 0..CALIB_SIZES.len() {
            if i == last {
                // Combination 1 does not fit at the largest size: timed no more.
                cal.stop(1, i);
            }
            assert_eq!(cal.live(1), i < last);
            let t = [10.0 + i as f64, 1.0 + i as f64];
            cal.record(i, &t);
        }
        let r = cal.row(1);
        assert!(r.iter().all(|&t| t > 0.0), "{r:?}");
        // Measured up to the size before, extended in proportion to the size from there.
        assert_eq!(r[last - 1], last as f64);
        assert_eq!(
            r[last],
            r[last - 1] * CALIB_SIZES[last] as f64 / CALIB_SIZES[last - 1] as f64
        );
        // Stopping at the first size leaves the combination timed there (it is excluded before).
        let mut first = Calibration::new(1);
        first.stop(0, 0);
        assert!(first.live(0));
    }
}
