//! The catalogue of the product's collective kernels: every kernel has a fixed index, computed
//! from the call's shape with a few integer operations, so a launch needs neither a name nor a
//! lookup. [`crate::Kernels`] resolves the whole table once when it loads the modules.
//!
//! This file is plain data and `const fn`s that import nothing of flashcomm but the codec's words
//! (`DType`, `Protocol`, `Algorithm`, `QuantOp`, declared there once): `xtask` includes it
//! to generate the CUDA instantiation list (`cuda/include/flashcomm/instances.h`), so the kernels
//! that exist and the kernels the host believes exist come from this one table.

pub use flashcomm_codec::{Algorithm, DType, Protocol, QuantOp};

/// The CUDA element type of `t`.
pub const fn cuda_type(t: DType) -> &'static str {
    match t {
        DType::F32 => "float",
        DType::F16 => "__half",
        DType::Bf16 => "__nv_bfloat16",
    }
}

/// Element types of the reducing kernels, in table order (`DType::code`).
pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

/// Element types of the quantized kernels, in table order.
pub const QUANT_DTYPES: [DType; 2] = [DType::F16, DType::Bf16];

/// Widths of the one-shot quantized AllReduce (one kernel each).
pub const QUANT_ONESHOT_BITS: [u8; 7] = [2, 3, 4, 5, 6, 7, 8];

/// (reduce-scatter, all-gather) widths of the two-step quantized AllReduce that have kernels:
/// equal widths, and an 8-bit all-gather after a 2-, 3- or 4-bit reduce-scatter (Flash
/// Communication's INT4 + INT8 setting and its neighbours).
pub const QUANT_TWOSTEP_BITS: [(u8, u8); 10] = [
    (2, 2),
    (3, 3),
    (4, 4),
    (5, 5),
    (6, 6),
    (7, 7),
    (8, 8),
    (2, 8),
    (3, 8),
    (4, 8),
];

/// Index of the lossless AllReduce kernels (algorithm x protocol x type).
const AR: usize = 0;
/// Index of the lossless ReduceScatter kernels (protocol x type).
const RS: usize = AR + 2 * Protocol::ALL.len() * 3;
/// Index of the lossless AllGather kernels (protocol).
const AG: usize = RS + Protocol::ALL.len() * 3;
/// The set-up probe.
const PROBE: usize = AG + Protocol::ALL.len();
/// Index of the one-shot quantized kernels (type x width).
const Q1: usize = PROBE + 1;
/// Index of the two-step quantized kernels (type x width pair).
const Q2: usize = Q1 + QUANT_DTYPES.len() * QUANT_ONESHOT_BITS.len();
/// Index of the lossless AllToAll kernels (protocol).
const A2A: usize = Q2 + QUANT_DTYPES.len() * QUANT_TWOSTEP_BITS.len();
/// Index of the quantized AllGather, AllToAll and ReduceScatter kernels (collective x type x
/// width).
const QOPS: usize = A2A + Protocol::ALL.len();
/// Index of the copy-engine schedule's reductions (type).
const CRED: usize = QOPS + QuantOp::ALL.len() * QUANT_DTYPES.len() * QUANT_OP_BITS.len();
/// Number of kernels in the table.
pub const COUNT: usize = CRED + DTYPES.len();

/// Widths of the quantized AllGather, AllToAll and ReduceScatter (one kernel each per type).
pub const QUANT_OP_BITS: [u8; 7] = [2, 3, 4, 5, 6, 7, 8];

/// Table index of the lossless AllReduce kernel.
pub const fn allreduce(algo: Algorithm, proto: Protocol, t: DType) -> usize {
    AR + (algo.index() * Protocol::ALL.len() + proto.index()) * 3 + t.code() as usize
}

/// Table index of the lossless ReduceScatter kernel (every protocol: PULL's by loads).
pub const fn reducescatter(proto: Protocol, t: DType) -> usize {
    RS + proto.index() * 3 + t.code() as usize
}

/// Table index of the AllGather kernel (any type: it moves bytes; every protocol).
pub const fn allgather(proto: Protocol) -> usize {
    AG + proto.index()
}

/// Table index of the AllToAll kernel (any type: it moves bytes; every protocol).
pub const fn alltoall(proto: Protocol) -> usize {
    A2A + proto.index()
}

/// Table index of the copy-engine schedule's reduction of type `t` (`fc_copy_reduce_<t>`).
pub const fn copy_reduce(t: DType) -> usize {
    CRED + t.code() as usize
}

/// Table index of the set-up probe (`fc_probe_write`).
pub const fn probe() -> usize {
    PROBE
}

const fn quant_dtype(t: DType) -> Option<usize> {
    match t {
        DType::F16 => Some(0),
        DType::Bf16 => Some(1),
        DType::F32 => None,
    }
}

/// Table index of the one-shot quantized AllReduce at `bits`, if that kernel exists.
pub const fn quant_oneshot(t: DType, bits: u8) -> Option<usize> {
    match quant_dtype(t) {
        Some(d) if bits >= 2 && bits <= 8 => {
            Some(Q1 + d * QUANT_ONESHOT_BITS.len() + (bits - 2) as usize)
        }
        _ => None,
    }
}

/// Position of a width pair in [`QUANT_TWOSTEP_BITS`].
pub const fn twostep_pair(rs_bits: u8, ag_bits: u8) -> Option<usize> {
    let mut i = 0;
    while i < QUANT_TWOSTEP_BITS.len() {
        if QUANT_TWOSTEP_BITS[i].0 == rs_bits && QUANT_TWOSTEP_BITS[i].1 == ag_bits {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// Table index of the two-step quantized AllReduce, if that kernel exists.
pub const fn quant_twostep(t: DType, rs_bits: u8, ag_bits: u8) -> Option<usize> {
    match (quant_dtype(t), twostep_pair(rs_bits, ag_bits)) {
        (Some(d), Some(p)) => Some(Q2 + d * QUANT_TWOSTEP_BITS.len() + p),
        _ => None,
    }
}

/// Table index of the quantized AllGather, AllToAll or ReduceScatter at `bits`, if that kernel
/// exists.
pub const fn quant_op(op: QuantOp, t: DType, bits: u8) -> Option<usize> {
    match quant_dtype(t) {
        Some(d) if bits >= 2 && bits <= 8 => Some(
            QOPS + (op.index() * QUANT_DTYPES.len() + d) * QUANT_OP_BITS.len()
                + (bits - 2) as usize,
        ),
        _ => None,
    }
}

/// Writes the CUDA name of kernel `index` into `out` (used once per kernel when the modules
/// load, and by the generator of the CUDA instantiation list).
pub fn name(index: usize, out: &mut String) {
    use std::fmt::Write;
    out.clear();
    let _ = match index {
        i if i < RS => {
            let per_algo = Protocol::ALL.len() * 3;
            let (a, r) = ((i - AR) / per_algo, (i - AR) % per_algo);
            let algo = Algorithm::ALL[a];
            let (p, t) = (Protocol::ALL[r / 3], DTYPES[r % 3]);
            write!(
                out,
                "fc_allreduce_{}_{}_{}",
                algo.name(),
                p.name(),
                t.suffix()
            )
        }
        i if i < AG => {
            let r = i - RS;
            let (p, t) = (Protocol::ALL[r / 3], DTYPES[r % 3]);
            write!(out, "fc_reducescatter_{}_{}", p.name(), t.suffix())
        }
        i if i < PROBE => write!(out, "fc_allgather_{}", Protocol::ALL[i - AG].name()),
        PROBE => write!(out, "fc_probe_write"),
        i if i < Q2 => {
            let r = i - Q1;
            let t = QUANT_DTYPES[r / QUANT_ONESHOT_BITS.len()];
            let b = QUANT_ONESHOT_BITS[r % QUANT_ONESHOT_BITS.len()];
            write!(out, "fc_allreduce_q1_block_{}_b{b}", t.suffix())
        }
        i if i < A2A => {
            let r = i - Q2;
            let t = QUANT_DTYPES[r / QUANT_TWOSTEP_BITS.len()];
            let (rs, ag) = QUANT_TWOSTEP_BITS[r % QUANT_TWOSTEP_BITS.len()];
            write!(out, "fc_allreduce_q2_block_{}_r{rs}_a{ag}", t.suffix())
        }
        i if i < QOPS => write!(out, "fc_alltoall_{}", Protocol::ALL[i - A2A].name()),
        i if i < CRED => {
            let r = i - QOPS;
            let per_op = QUANT_DTYPES.len() * QUANT_OP_BITS.len();
            let op = QuantOp::ALL[r / per_op];
            let t = QUANT_DTYPES[(r % per_op) / QUANT_OP_BITS.len()];
            let b = QUANT_OP_BITS[r % QUANT_OP_BITS.len()];
            write!(out, "fc_{}_q_block_{}_b{b}", op.name(), t.suffix())
        }
        i if i < COUNT => write!(out, "fc_copy_reduce_{}", DTYPES[i - CRED].suffix()),
        _ => write!(out, "fc_invalid_{index}"),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_names() -> Vec<String> {
        (0..COUNT)
            .map(|i| {
                let mut s = String::new();
                name(i, &mut s);
                s
            })
            .collect()
    }

    #[test]
    fn names_are_unique_and_valid() {
        let mut names = all_names();
        assert!(
            names
                .iter()
                .all(|n| n.starts_with("fc_") && !n.contains("invalid"))
        );
        names.sort();
        names.dedup();
        assert_eq!(names.len(), COUNT);
    }

    #[test]
    fn every_index_is_reached_once() {
        let mut seen = vec![0u32; COUNT];
        for a in Algorithm::ALL {
            for p in Protocol::ALL {
                for t in DTYPES {
                    seen[allreduce(a, p, t)] += 1;
                }
            }
        }
        for p in Protocol::ALL {
            for t in DTYPES {
                seen[reducescatter(p, t)] += 1;
            }
            seen[allgather(p)] += 1;
            seen[alltoall(p)] += 1;
        }
        seen[probe()] += 1;
        for t in DTYPES {
            seen[copy_reduce(t)] += 1;
            for b in 0..=10 {
                if let Some(i) = quant_oneshot(t, b) {
                    seen[i] += 1;
                }
                for a in 0..=10 {
                    if let Some(i) = quant_twostep(t, b, a) {
                        seen[i] += 1;
                    }
                }
                for op in QuantOp::ALL {
                    if let Some(i) = quant_op(op, t, b) {
                        seen[i] += 1;
                    }
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn names_follow_the_shape() {
        let mut s = String::new();
        name(
            allreduce(Algorithm::TwoShot, Protocol::Ll, DType::Bf16),
            &mut s,
        );
        assert_eq!(s, "fc_allreduce_twoshot_ll_bf16");
        name(
            allreduce(Algorithm::OneShot, Protocol::Direct, DType::F32),
            &mut s,
        );
        assert_eq!(s, "fc_allreduce_oneshot_direct_f32");
        name(
            allreduce(Algorithm::TwoShot, Protocol::Pull, DType::F16),
            &mut s,
        );
        assert_eq!(s, "fc_allreduce_twoshot_pull_f16");
        name(reducescatter(Protocol::Block, DType::F16), &mut s);
        assert_eq!(s, "fc_reducescatter_block_f16");
        name(reducescatter(Protocol::Direct, DType::Bf16), &mut s);
        assert_eq!(s, "fc_reducescatter_direct_bf16");
        name(allgather(Protocol::Ll), &mut s);
        assert_eq!(s, "fc_allgather_ll");
        name(allgather(Protocol::Pull), &mut s);
        assert_eq!(s, "fc_allgather_pull");
        name(alltoall(Protocol::Block), &mut s);
        assert_eq!(s, "fc_alltoall_block");
        name(alltoall(Protocol::Direct), &mut s);
        assert_eq!(s, "fc_alltoall_direct");
        name(quant_oneshot(DType::Bf16, 3).unwrap(), &mut s);
        assert_eq!(s, "fc_allreduce_q1_block_bf16_b3");
        name(quant_twostep(DType::F16, 4, 8).unwrap(), &mut s);
        assert_eq!(s, "fc_allreduce_q2_block_f16_r4_a8");
        name(quant_op(QuantOp::AlltoAll, DType::Bf16, 5).unwrap(), &mut s);
        assert_eq!(s, "fc_alltoall_q_block_bf16_b5");
        name(
            quant_op(QuantOp::ReduceScatter, DType::F16, 2).unwrap(),
            &mut s,
        );
        assert_eq!(s, "fc_reducescatter_q_block_f16_b2");
        name(
            quant_op(QuantOp::AllGather, DType::Bf16, 8).unwrap(),
            &mut s,
        );
        assert_eq!(s, "fc_allgather_q_block_bf16_b8");
        assert_eq!(quant_op(QuantOp::AllGather, DType::F32, 4), None);
        assert_eq!(quant_oneshot(DType::F32, 4), None);
        assert_eq!(quant_twostep(DType::Bf16, 5, 8), None);
    }
}
