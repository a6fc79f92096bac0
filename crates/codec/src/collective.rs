//! The kinds of collective call: the one collective enum of the tree, kept here, in the lowest
//! crate, beside [`DType`](crate::DType), so the configuration, the communicator, the shim and the
//! tools all speak of the same values and need no converters.

use std::fmt;

/// The kind of a collective call (`ncclBcast` counts as `Broadcast`, `ncclXConfig` as `X`).
///
/// The discriminants are the kinds' indices (the second index of the shim's statistics table and
/// of `flashcommStats_t`): never reorder them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Collective {
    /// Sum (or another reduction) over ranks, result on every rank: `ncclAllReduce`.
    AllReduce = 0,
    /// Reduction over ranks, rank r keeps block r: `ncclReduceScatter`.
    ReduceScatter = 1,
    /// Concatenation of every rank's buffer: `ncclAllGather`.
    AllGather = 2,
    /// Block p of every rank goes to rank p: `ncclAlltoAll`.
    AlltoAll = 3,
    /// `ncclBroadcast`, `ncclBcast`.
    Broadcast = 4,
    /// `ncclReduce`.
    Reduce = 5,
    /// `ncclSend`.
    Send = 6,
    /// `ncclRecv`.
    Recv = 7,
}

impl Collective {
    /// Every kind, in index order.
    pub const ALL: [Collective; 8] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::AlltoAll,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Send,
        Collective::Recv,
    ];

    /// Number of kinds.
    pub const COUNT: usize = Self::ALL.len();

    /// The kinds flashcomm's kernels implement (the others always go to NCCL): the kinds
    /// `FLASHCOMM_OPS` and `FLASHCOMM_QUANT_OPS` may name, and the ones flashcomm-perf measures.
    pub const KERNELS: [Collective; 4] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::AlltoAll,
    ];

    /// The kind's index (its position in [`Collective::ALL`]).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The lower-case name used in environment variables, logs, the statistics API, the benchmark's
    /// command line and its JSON (`allreduce`, `reducescatter`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::ReduceScatter => "reducescatter",
            Collective::AllGather => "allgather",
            Collective::AlltoAll => "alltoall",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Send => "send",
            Collective::Recv => "recv",
        }
    }

    /// The NCCL exports that perform this kind (`ncclX` form; each has a `pncclX` twin).
    pub const fn exports(self) -> &'static [&'static str] {
        match self {
            Collective::AllReduce => &["ncclAllReduce", "ncclAllReduceConfig"],
            Collective::ReduceScatter => &["ncclReduceScatter", "ncclReduceScatterConfig"],
            Collective::AllGather => &["ncclAllGather", "ncclAllGatherConfig"],
            Collective::AlltoAll => &["ncclAlltoAll", "ncclAlltoAllConfig"],
            Collective::Broadcast => &["ncclBroadcast", "ncclBroadcastConfig", "ncclBcast"],
            Collective::Reduce => &["ncclReduce", "ncclReduceConfig"],
            Collective::Send => &["ncclSend"],
            Collective::Recv => &["ncclRecv"],
        }
    }

    /// The kind export `name` (`ncclX` or `pncclX`) performs.
    pub fn of_export(name: &str) -> Option<Collective> {
        let base = name.strip_prefix('p').unwrap_or(name);
        Self::ALL.into_iter().find(|k| k.exports().contains(&base))
    }

    /// The kind named `name`: [`Collective::name`] or the same with underscores
    /// (`all_reduce`), any case.
    pub fn from_name(name: &str) -> Option<Collective> {
        let t: String = name
            .trim()
            .chars()
            .filter(|&c| c != '_')
            .map(|c| c.to_ascii_lowercase())
            .collect();
        Self::ALL.into_iter().find(|k| k.name() == t)
    }

    /// Whether the operation takes a reduction operator.
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    /// Whether it is a point-to-point operation.
    pub const fn is_p2p(self) -> bool {
        matches!(self, Collective::Send | Collective::Recv)
    }

    /// Bytes of a rank's send and receive buffers for a call of `bytes` per rank (NCCL's count
    /// times the element size) among `nranks`: a ReduceScatter reads `nranks x bytes` and writes
    /// `bytes`, an AllGather the reverse, an AllToAll (`bytes` per peer) reads and writes
    /// `nranks x bytes`, every other kind `bytes` of each. `None` when a size overflows.
    pub fn buffer_bytes(self, bytes: u64, nranks: u64) -> Option<(u64, u64)> {
        let all = bytes.checked_mul(nranks)?;
        Some(match self {
            Collective::ReduceScatter => (all, bytes),
            Collective::AllGather => (bytes, all),
            Collective::AlltoAll => (all, all),
            _ => (bytes, bytes),
        })
    }

    /// Bus-bandwidth factor (nccl-tests' convention): `2(n-1)/n` for AllReduce, `(n-1)/n` for
    /// ReduceScatter, AllGather and AlltoAll, 1 for the rooted and point-to-point kinds.
    pub fn busbw_factor(self, nranks: u32) -> f64 {
        let n = f64::from(nranks.max(1));
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::ReduceScatter | Collective::AllGather | Collective::AlltoAll => {
                (n - 1.0) / n
            }
            Collective::Broadcast | Collective::Reduce | Collective::Send | Collective::Recv => 1.0,
        }
    }
}

/// The collectives besides AllReduce that flashcomm quantizes, each in one step (every value
/// crosses the wire once, at one width): the kernels' catalogue and the CPU references
/// ([`crate::reference`]'s `allgather_quant`, `alltoall_quant`, `reducescatter_quant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantOp {
    /// Every rank's input encoded once, decoded by every rank: output segment `r` is rank r's
    /// input, the same on every rank.
    AllGather,
    /// Block `p` of rank r's input encoded as a buffer of its own, decoded by rank p into its
    /// output segment `r`.
    AlltoAll,
    /// Shard `j` of every rank's input encoded once each; rank j decodes the N encodings and
    /// sums them in f32 in rank order.
    ReduceScatter,
}

impl QuantOp {
    /// The three, in the kernel table's order.
    pub const ALL: [QuantOp; 3] = [
        QuantOp::AllGather,
        QuantOp::AlltoAll,
        QuantOp::ReduceScatter,
    ];

    /// The one-step quantized collective of `coll` (`None` for AllReduce and the others).
    pub const fn of(coll: Collective) -> Option<QuantOp> {
        match coll {
            Collective::AllGather => Some(QuantOp::AllGather),
            Collective::AlltoAll => Some(QuantOp::AlltoAll),
            Collective::ReduceScatter => Some(QuantOp::ReduceScatter),
            _ => None,
        }
    }

    /// The collective it quantizes.
    pub const fn collective(self) -> Collective {
        match self {
            QuantOp::AllGather => Collective::AllGather,
            QuantOp::AlltoAll => Collective::AlltoAll,
            QuantOp::ReduceScatter => Collective::ReduceScatter,
        }
    }

    /// Its collective's name (the kernels' name fragment).
    pub const fn name(self) -> &'static str {
        self.collective().name()
    }

    /// Position in [`QuantOp::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_follow_the_table() {
        for (i, k) in Collective::ALL.into_iter().enumerate() {
            assert_eq!(k.index(), i);
        }
    }

    #[test]
    fn names_round_trip() {
        for k in Collective::ALL {
            assert_eq!(Collective::from_name(k.name()), Some(k));
        }
        assert_eq!(
            Collective::from_name(" All_Reduce "),
            Some(Collective::AllReduce)
        );
        assert_eq!(Collective::from_name("allreduc"), None);
        assert_eq!(Collective::from_name(""), None);
    }

    #[test]
    fn every_export_names_its_kind_once() {
        for k in Collective::ALL {
            for e in k.exports() {
                assert_eq!(Collective::of_export(e), Some(k));
                assert_eq!(Collective::of_export(&format!("p{e}")), Some(k));
            }
        }
        assert_eq!(Collective::of_export("ncclGather"), None);
    }

    #[test]
    fn quantized_ops_map_to_their_collectives_and_back() {
        for (i, op) in QuantOp::ALL.into_iter().enumerate() {
            assert_eq!(op.index(), i);
            assert_eq!(QuantOp::of(op.collective()), Some(op));
        }
        assert_eq!(QuantOp::of(Collective::AllReduce), None);
    }

    #[test]
    fn buffer_sizes_follow_nccls_contract() {
        assert_eq!(Collective::AllReduce.buffer_bytes(8, 4), Some((8, 8)));
        assert_eq!(Collective::ReduceScatter.buffer_bytes(8, 4), Some((32, 8)));
        assert_eq!(Collective::AllGather.buffer_bytes(8, 4), Some((8, 32)));
        assert_eq!(Collective::AlltoAll.buffer_bytes(8, 4), Some((32, 32)));
        assert_eq!(Collective::Broadcast.buffer_bytes(8, 4), Some((8, 8)));
        assert_eq!(Collective::AllGather.buffer_bytes(u64::MAX, 2), None);
    }

    #[test]
    fn bus_bandwidth_factors() {
        assert!((Collective::AllReduce.busbw_factor(8) - 1.75).abs() < 1e-12);
        assert!((Collective::AllGather.busbw_factor(8) - 0.875).abs() < 1e-12);
        assert!((Collective::AlltoAll.busbw_factor(2) - 0.5).abs() < 1e-12);
        assert_eq!(Collective::AllReduce.busbw_factor(1), 0.0);
    }
}
