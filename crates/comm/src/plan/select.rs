//! Selection: the plan of a call (algorithm, protocol, grid, chunks), lossless or quantized, and
//! whether quantizing pays, as the cost model predicts; pure, so every rank plans alike.

use crate::abi::{FRAME_BYTES, FRAME_PAYLOAD, THREADS};
use crate::error::Error;

use super::{
    Algorithm, Arena, CODEC_BLOCK_VALUES, Choice, Collective, CostModel, DataType,
    PULL_ONESHOT_BLOCK_BYTES, PULL_PIECE_BLOCK_BYTES, PULL_TWOSHOT_BLOCK_BYTES, Plan, Protocol,
    QUANT_THREADS, QUANT_TWO_STEP_MIN_BLOCKS, QuantModel, QuantSpec, TIE_FACTOR, chunk_for,
    pull_shape, shape_for, shard_elems,
};

/// Whether the quantized plan `quant` of a message of `bytes` bytes per rank pays against the
/// lossless plan `lossless` of the same call ([`QuantChoice::Auto`](super::QuantChoice::Auto)): predicted faster by more
/// than [`TIE_FACTOR`]; a tie goes to the lossless plan (about the same time, no quantization
/// error). Without a
/// calibrated model, or a measurement of the quantized plan's codec settings and algorithm at
/// this size, it pays (the call is quantized, as asked). Pure: every rank, holding the agreed
/// models, decides alike.
pub fn quant_pays(
    model: &CostModel,
    lossless: &Plan,
    measured: Option<&QuantModel>,
    quant: &Plan,
    bytes: u64,
) -> bool {
    let Some(tq) = measured.and_then(|m| m.predict(quant.algo, bytes)) else {
        return true;
    };
    if !model.calibrated {
        return true;
    }
    let tl = model.predict(lossless.algo, lossless.proto, bytes);
    tq * TIE_FACTOR < tl
}

/// Grid, sub-slot and chunk bytes of a quantized launch of up to `grid` blocks whose chunks
/// cover `frames` frames (per source: the codec blocks of the message, of a two-step shard, or of
/// one peer's block): the frames cut evenly over the grid, at most what a sub-slot holds, and the
/// grid trimmed to the chunks there are, so that every block has work. The quantized kernels take
/// a chunk's codec blocks from the sub-slot size (`sub_bytes / FRAME_BYTES` frames); a sub-slot
/// of a sub-slot's full capacity whatever the message left most of the grid idle below a few
/// MiB (4 MiB, 4-bit, 2 ranks, host transport: 5 of 22 blocks had work; docs/experiments.md,
/// "Quantized chunks cut to the message").
fn quant_chunking(arena: &Arena, grid: u32, frames: u64) -> (u32, u64, u64) {
    let capacity = arena.chunking(Protocol::Block, grid).0 / FRAME_BYTES;
    let per = frames
        .div_ceil(grid.max(1) as u64)
        .clamp(1, capacity.max(1));
    let grid = frames.div_ceil(per).clamp(1, grid.max(1) as u64) as u32;
    (grid, per * FRAME_BYTES, per * FRAME_PAYLOAD)
}

/// Plans a quantized AllReduce. The wire format is the codec's; readiness travels in BLOCK frames
/// that carry whole codec blocks. Two-step needs every shard non-empty (at least `nranks` codec
/// blocks); the cost model picks between one-shot and two-step from the bytes each moves after
/// compression and the decode work each does.
#[allow(clippy::too_many_arguments)]
pub fn plan_quant(
    arena: &Arena,
    model: &CostModel,
    measured: Option<&QuantModel>,
    count: u64,
    dtype: DataType,
    q: QuantSpec,
    max_grid: u32,
    algo_choice: Choice<Algorithm>,
) -> Result<Plan, Error> {
    if dtype == DataType::F32 {
        return Err(Error::Unsupported(
            "quantized AllReduce of f32 (use f16 or bf16; f32 stays lossless)".into(),
        ));
    }
    if !q.has_kernels() {
        return Err(Error::Unsupported(format!(
            "no kernels for widths {}/{}",
            q.rs_bits, q.ag_bits
        )));
    }
    let n = arena.nranks as u64;
    let fr = q.format(dtype, q.rs_bits)?;
    let fa = q.format(dtype, q.ag_bits)?;
    let nb = count.div_ceil(CODEC_BLOCK_VALUES);
    let two_ok = nb >= n;
    let bytes = count * dtype.bytes();
    // Bytes as the lossless model sees them, scaled by the compression of each step, plus the
    // codec work (decoding and encoding at roughly HBM speed: 1.5 MB/us of element data).
    let codec_us_per_byte = 1.0 / 1.5e6;
    let wire_one = bytes as f64 * fr.effective_bits() / 16.0;
    let wire_two = bytes as f64 * (fr.effective_bits() + fa.effective_bits()) / 32.0;
    let t_one = model.predict(Algorithm::OneShot, Protocol::Block, wire_one as u64)
        + codec_us_per_byte * bytes as f64 * (1.0 + n as f64);
    let t_two = model.predict(Algorithm::TwoShot, Protocol::Block, wire_two as u64)
        + codec_us_per_byte * bytes as f64 * (1.0 + 2.0 / n as f64 + 1.0);
    // Measured times, where these settings were calibrated: they decide, a tie going to
    // one-shot (the fixed order of TIE_FACTOR), and a size where two-step was not measured (just
    // above QUANT_TWO_STEP_MIN_BLOCKS, below the first calibration size it was timed at) stays
    // one-shot, so that no calibrated choice rests on the scaled lossless model.
    let timed = measured.map(|m| {
        (
            m.predict(Algorithm::OneShot, bytes),
            m.predict(Algorithm::TwoShot, bytes),
        )
    });
    let two_faster = match timed {
        Some((Some(one), Some(two))) => two * TIE_FACTOR < one,
        Some((Some(_), None)) => false,
        _ => t_two < t_one,
    };
    let algo = match algo_choice {
        Choice::Force(Algorithm::TwoShot) if two_ok => Algorithm::TwoShot,
        Choice::Force(_) => Algorithm::OneShot,
        Choice::Auto if two_ok && n > 1 && nb >= QUANT_TWO_STEP_MIN_BLOCKS && two_faster => {
            Algorithm::TwoShot
        }
        Choice::Auto => Algorithm::OneShot,
    };
    Ok(quant_shape(arena, count, dtype, q, max_grid, algo)?.0)
}

/// The quantized AllReduce of `algo`, whatever the cost model says: its grid, sub-slot and chunk
/// bytes, and the rounds its busiest block takes. [`plan_quant`] shapes its plans here; tests run
/// a one-shot of more than two rounds with it (every rank must run the same plan). Two-step needs
/// at least `nranks` codec blocks.
pub fn quant_shape(
    arena: &Arena,
    count: u64,
    dtype: DataType,
    q: QuantSpec,
    max_grid: u32,
    algo: Algorithm,
) -> Result<(Plan, u64), Error> {
    let n = arena.nranks as u64;
    let fr = q.format(dtype, q.rs_bits)?;
    let fa = q.format(dtype, q.ag_bits)?;
    let nb = count.div_ceil(CODEC_BLOCK_VALUES);
    // A frame carries FRAME_PAYLOAD / block_bytes codec blocks. Two-step: one warp per frame.
    // One-shot: the warps of a block share its chunk's codec blocks, so the grid is sized for
    // one codec block per warp.
    let per_frame = match algo {
        Algorithm::OneShot => FRAME_PAYLOAD / fr.block_bytes() as u64,
        Algorithm::TwoShot => FRAME_PAYLOAD / (fr.block_bytes().max(fa.block_bytes()) as u64),
    };
    let blocks = match algo {
        Algorithm::OneShot => nb,
        Algorithm::TwoShot => nb.div_ceil(n),
    };
    let frames = blocks.div_ceil(per_frame);
    let warp_units = match algo {
        Algorithm::OneShot => blocks,
        Algorithm::TwoShot => frames,
    };
    let grid = warp_units
        .div_ceil((QUANT_THREADS / 32) as u64)
        .clamp(1, max_grid.min(arena.max_grid()).max(1) as u64) as u32;
    let (grid, sub_bytes, chunk_bytes) = quant_chunking(arena, grid, frames);
    let chunks = frames.div_ceil((sub_bytes / FRAME_BYTES).max(1));
    let plan = Plan {
        coll: Collective::AllReduce,
        algo,
        proto: Protocol::Block,
        grid,
        threads: QUANT_THREADS,
        sub_bytes,
        chunk_bytes,
        copy_engines: false,
        shard_elems: 0,
        quant: Some(q),
    };
    Ok((plan, chunks.div_ceil(grid as u64)))
}

/// Plans a quantized AllGather, AllToAll or ReduceScatter: one quantization step at `q.rs_bits`
/// (`q.ag_bits` is not used), BLOCK frames of whole codec blocks. `count` is the values per
/// block: AllGather's send count, AllToAll's per-peer count, ReduceScatter's receive count; each
/// such block is encoded as a buffer of its own. Every block of the grid carries its chunk of
/// every peer's block, and its warps share the (peer, frame) pairs, so the grid is sized for the
/// frames of all N blocks, one warp each.
pub fn plan_quant_op(
    arena: &Arena,
    coll: Collective,
    count: u64,
    dtype: DataType,
    q: QuantSpec,
    max_grid: u32,
) -> Result<Plan, Error> {
    if !matches!(
        coll,
        Collective::AllGather | Collective::AlltoAll | Collective::ReduceScatter
    ) {
        return Err(Error::Unsupported(format!(
            "{coll}: no quantized kernel of one step"
        )));
    }
    if dtype == DataType::F32 {
        return Err(Error::Unsupported(format!(
            "quantized {coll} of f32 (use f16 or bf16; f32 stays lossless)"
        )));
    }
    let f = q.format(dtype, q.rs_bits)?;
    let per_frame = FRAME_PAYLOAD / f.block_bytes() as u64;
    let per_peer = count.div_ceil(CODEC_BLOCK_VALUES).div_ceil(per_frame);
    let frames = per_peer * arena.nranks as u64;
    let grid = frames
        .div_ceil((QUANT_THREADS / 32) as u64)
        .clamp(1, max_grid.min(arena.max_grid()).max(1) as u64) as u32;
    let (grid, sub_bytes, chunk_bytes) = quant_chunking(arena, grid, per_peer);
    Ok(Plan {
        coll,
        algo: Algorithm::OneShot,
        proto: Protocol::Block,
        grid,
        threads: QUANT_THREADS,
        sub_bytes,
        chunk_bytes,
        copy_engines: false,
        shard_elems: 0,
        quant: Some(QuantSpec {
            ag_bits: q.rs_bits,
            ..q
        }),
    })
}

/// Chooses how to run one call. `bytes` is the per-rank message: AllReduce count*elem,
/// ReduceScatter recvcount*elem*nranks, AllGather sendcount*elem.
pub fn plan(
    arena: &Arena,
    model: &CostModel,
    coll: Collective,
    count: u64,
    elem: u64,
    max_grid: u32,
    algo_choice: Choice<Algorithm>,
    proto_choice: Choice<Protocol>,
) -> Plan {
    let n = arena.nranks;
    if n == 1 {
        // One rank exchanges nothing (`Communicator::execute` copies, or does nothing in place): no
        // plan is weighed, so the trivial call costs no cost-model lookups.
        let (grid, threads) = shape_for(Protocol::Ll, 0, 1);
        let (sub_bytes, chunk_bytes) = arena.chunking(Protocol::Ll, grid);
        return Plan {
            coll,
            algo: Algorithm::OneShot,
            proto: Protocol::Ll,
            grid,
            threads,
            sub_bytes,
            chunk_bytes,
            copy_engines: false,
            shard_elems: 0,
            quant: None,
        };
    }
    let max_grid = max_grid.min(arena.max_grid()).max(1);
    // What a rank sends: the message of one-shot's model rows.
    let bytes = coll
        .buffer_bytes(count * elem, n as u64)
        .map_or(u64::MAX, |(send, _)| send);
    let shard = if coll == Collective::AllReduce {
        shard_elems(count, n, elem)
    } else {
        None
    };
    // Candidates as static slices: planning runs on every call and allocates nothing.
    const ONE_SHOT: &[Algorithm] = &[Algorithm::OneShot];
    const TWO_SHOT: &[Algorithm] = &[Algorithm::TwoShot];
    let algos: &[Algorithm] = match coll {
        Collective::AllReduce => match algo_choice {
            Choice::Force(Algorithm::TwoShot) if shard.is_some() && n > 1 => TWO_SHOT,
            Choice::Force(_) => ONE_SHOT,
            Choice::Auto if shard.is_some() && n > 1 => &Algorithm::ALL,
            Choice::Auto => ONE_SHOT,
        },
        // ReduceScatter has the cost structure of the first half of two-shot, AllGather and
        // AllToAll of one-shot's push; each uses the corresponding model row. (The other kinds
        // never reach a kernel: `Communicator::execute` refuses them.)
        Collective::ReduceScatter => TWO_SHOT,
        _ => ONE_SHOT,
    };
    // The PULL protocols apply where the pull area holds the call (for a two-shot AllReduce:
    // its shards; for `Direct`: where peers can read the user's buffers). A forced PULL protocol
    // that does not apply to a call leaves the choice among the push protocols to the model; a
    // forced push protocol is taken as asked.
    let pull_ok = |a: Algorithm, p: Protocol| -> bool {
        !p.pulls()
            || arena.pull_fits(
                p,
                coll,
                count,
                elem,
                if a == Algorithm::TwoShot { shard } else { None },
            )
    };
    // Direct asked for where peers cannot read the user's buffers: the staged PULL protocol.
    let proto_choice = match proto_choice {
        Choice::Force(Protocol::Direct) if !arena.direct => Choice::Force(Protocol::Pull),
        other => other,
    };
    let forced = [match proto_choice {
        Choice::Force(p) => p,
        Choice::Auto => Protocol::Ll,
    }];
    let protos: &[Protocol] = match proto_choice {
        Choice::Force(p) if algos.iter().any(|&a| pull_ok(a, p)) => &forced,
        Choice::Force(_) => &Protocol::PUSH,
        // Every collective weighs every protocol; ReduceScatter, AllGather and AllToAll do so on
        // the AllReduce's rows, as for the push protocols (docs/protocols.md, "PULL for the
        // other collectives").
        Choice::Auto => &Protocol::ALL,
    };
    // ReduceScatter, AllGather and AllToAll whose protocols the calibration timed
    // (`CommConfig::calibrate_moves`) are predicted from their own rows, at the whole buffer's
    // bytes, among the protocols measured; otherwise every collective is predicted from the
    // AllReduce's rows (a forced protocol is taken whatever the rows say).
    let own_rows = coll != Collective::AllReduce && protos.len() > 1 && model.moves_measured(coll);
    let whole = count.saturating_mul(elem).saturating_mul(n as u64);
    let predict = |a: Algorithm, p: Protocol| -> Option<f64> {
        if own_rows {
            model.predict_move(coll, p, whole)
        } else {
            Some(model.predict(a, p, bytes))
        }
    };
    // The fastest prediction, then the first candidate (in the fixed order of the slices) within
    // TIE_FACTOR of it: see TIE_FACTOR.
    let mut fastest = f64::INFINITY;
    for &a in algos {
        for &p in protos {
            if pull_ok(a, p)
                && let Some(t) = predict(a, p)
            {
                fastest = fastest.min(t);
            }
        }
    }
    let mut best: Option<(Algorithm, Protocol)> = None;
    for &a in algos {
        for &p in protos {
            if best.is_none()
                && pull_ok(a, p)
                && predict(a, p).is_some_and(|t| t <= fastest * TIE_FACTOR)
            {
                best = Some((a, p));
            }
        }
    }
    let (algo, proto) = best.unwrap_or((algos[0], Protocol::Ll));
    if proto.pulls() {
        // AllReduce: one-shot blocks take a chunk of the message, two-shot blocks a piece of
        // every shard; the others: a chunk of every rank's piece (count * elem bytes).
        let (target, over) = match (coll, algo) {
            (Collective::AllReduce, Algorithm::OneShot) => (PULL_ONESHOT_BLOCK_BYTES, bytes),
            (Collective::AllReduce, Algorithm::TwoShot) => {
                (PULL_TWOSHOT_BLOCK_BYTES, shard.unwrap_or(count) * elem)
            }
            _ => (PULL_PIECE_BLOCK_BYTES, count * elem),
        };
        let algo = if coll == Collective::AllReduce {
            algo
        } else {
            Algorithm::OneShot
        };
        let (grid, chunk_bytes) = pull_shape(over, target, max_grid);
        return Plan {
            coll,
            algo,
            proto,
            grid,
            threads: THREADS,
            sub_bytes: arena.pull_half_bytes,
            chunk_bytes,
            copy_engines: false,
            shard_elems: if algo == Algorithm::TwoShot {
                shard.unwrap_or(0)
            } else {
                0
            },
            quant: None,
        };
    }
    let per_block_bytes = match (coll, algo) {
        (Collective::AllReduce, Algorithm::TwoShot) => shard.unwrap_or(count) * elem,
        (Collective::ReduceScatter | Collective::AlltoAll, _) => count * elem,
        _ => bytes,
    };
    // AllToAll: each block carries its chunk of every peer's block, so the grid is sized for the
    // whole message (n blocks), not one block: sized for one, 1-32 KiB per peer ran on one or two
    // blocks (8 ranks: 1.5-6.5x the plain reference kernel, docs/experiments.md).
    let grid_bytes = if coll == Collective::AlltoAll {
        bytes
    } else {
        per_block_bytes
    };
    let (grid, threads) = shape_for(proto, grid_bytes, max_grid);
    let (sub_bytes, capacity) = arena.chunking(proto, grid);
    let chunk_bytes = chunk_for(per_block_bytes, grid, capacity);
    let coll_algo = if coll == Collective::AllReduce {
        algo
    } else {
        Algorithm::OneShot
    };
    Plan {
        coll,
        algo: coll_algo,
        proto,
        grid,
        threads,
        sub_bytes,
        chunk_bytes,
        copy_engines: false,
        shard_elems: if coll_algo == Algorithm::TwoShot {
            shard.unwrap_or(0)
        } else {
            0
        },
        quant: None,
    }
}
