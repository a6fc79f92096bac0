//! The words of a call's route, each declared once, here in the lowest crate beside
//! [`Collective`](crate::Collective) and [`DType`](crate::DType): the device protocol, the
//! AllReduce algorithm, where the arenas live (the transport), whether a quantized AllReduce runs
//! where it does not pay (the quantization choice), and a choice that is automatic or forced. The
//! kernel catalogue, the planner, the configuration (which parses into them), the shim and the
//! benchmark all use these types; none keeps a copy.

use std::fmt;

/// A word with a spelling of its own in settings, tables and command lines (lower case).
pub trait Keyword: Copy + Eq + 'static {
    /// Every value, in table order.
    const KEYWORDS: &'static [Self];

    /// The spelling of this value.
    fn keyword(self) -> &'static str;

    /// The value spelt `text` (ASCII case ignored, surrounding blanks trimmed).
    fn from_keyword(text: &str) -> Option<Self> {
        let t = text.trim();
        Self::KEYWORDS
            .iter()
            .copied()
            .find(|k| k.keyword().eq_ignore_ascii_case(t))
    }
}

/// A choice that is either automatic or forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Choice<T> {
    /// Let the cost model decide.
    #[default]
    Auto,
    /// Always this one (where it is valid).
    Force(T),
}

impl<T: Keyword> Choice<T> {
    /// The spelling of this choice: `auto`, or the forced value's keyword.
    pub fn keyword(self) -> &'static str {
        match self {
            Choice::Auto => "auto",
            Choice::Force(t) => t.keyword(),
        }
    }

    /// The choice spelt `text`: `auto`, or one of `T`'s keywords (ASCII case ignored).
    pub fn from_keyword(text: &str) -> Option<Self> {
        if text.trim().eq_ignore_ascii_case("auto") {
            Some(Choice::Auto)
        } else {
            T::from_keyword(text).map(Choice::Force)
        }
    }
}

impl<T: Keyword> fmt::Display for Choice<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.keyword())
    }
}

/// How readiness travels with the data (and, for the two push protocols against PULL, who moves
/// it: the sender stores into its peers' arenas, or the receiver loads from its peers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Push: 16-byte lines with a tag beside every 4 bytes of data: lowest latency, half the
    /// payload density.
    Ll,
    /// Push: frames with one tag written after a fence: full density, one fence per frame.
    Block,
    /// Pull, staged: each rank copies its input into its own arena and publishes one flag line
    /// per (peer, block, stage); peers load from there. Every lossless collective.
    Pull,
    /// Pull, direct: peers load straight from the user's buffers where they can (ranks of one
    /// process; registered or captured buffers of other processes of the machine with zero-copy),
    /// and each block ends with a "done" flag exchange. Every lossless collective.
    Direct,
}

impl Protocol {
    /// Every protocol, in table order.
    pub const ALL: [Protocol; 4] = [
        Protocol::Ll,
        Protocol::Block,
        Protocol::Pull,
        Protocol::Direct,
    ];

    /// The push protocols, the ones every call has kernels of (the quantized kernels are push
    /// kernels; the PULL ones are lossless).
    pub const PUSH: [Protocol; 2] = [Protocol::Ll, Protocol::Block];

    /// Kernel-name fragment (also the protocol's name in settings and tables).
    pub const fn name(self) -> &'static str {
        match self {
            Protocol::Ll => "ll",
            Protocol::Block => "block",
            Protocol::Pull => "pull",
            Protocol::Direct => "direct",
        }
    }

    /// Position in [`Protocol::ALL`].
    pub const fn index(self) -> usize {
        match self {
            Protocol::Ll => 0,
            Protocol::Block => 1,
            Protocol::Pull => 2,
            Protocol::Direct => 3,
        }
    }

    /// Whether this is a pull protocol (AllReduce only).
    pub const fn pulls(self) -> bool {
        matches!(self, Protocol::Pull | Protocol::Direct)
    }
}

/// AllReduce algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank pushes its whole input to every peer and reduces all of them.
    OneShot,
    /// Reduce-scatter to shard owners, then all-gather of the reduced shards.
    TwoShot,
}

impl Algorithm {
    /// Both algorithms, in table order.
    pub const ALL: [Algorithm; 2] = [Algorithm::OneShot, Algorithm::TwoShot];

    /// Kernel-name fragment.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::OneShot => "oneshot",
            Algorithm::TwoShot => "twoshot",
        }
    }

    /// Position in [`Algorithm::ALL`].
    pub const fn index(self) -> usize {
        match self {
            Algorithm::OneShot => 0,
            Algorithm::TwoShot => 1,
        }
    }
}

/// The memory a rank's arena lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Device memory, reached through peer access or CUDA IPC.
    P2p,
    /// Pinned host memory mapped into every GPU.
    Host,
}

impl Transport {
    /// The name in settings, logs and the benchmark's JSON (`p2p`, `host`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::P2p => "p2p",
            Transport::Host => "host",
        }
    }
}

/// Whether a quantized AllReduce runs where the lossless kernels are predicted to be faster
/// (`FLASHCOMM_QUANT_CHOICE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QuantChoice {
    /// Quantize where it pays: a call asked to be quantized runs the quantized kernels only where
    /// the calibrated model predicts them faster than the lossless plan by more than the
    /// planner's tie factor; elsewhere it runs the lossless kernels, whose result carries no
    /// quantization error. Without a measurement for the call's codec settings (no calibration,
    /// or settings changed after set-up) every call is quantized.
    #[default]
    Auto,
    /// Every call asked to be quantized is.
    Always,
}

impl QuantChoice {
    /// The spelling in settings and on command lines (`auto`, `always`).
    pub fn name(self) -> &'static str {
        match self {
            QuantChoice::Auto => "auto",
            QuantChoice::Always => "always",
        }
    }
}

/// Whether the lossless AllReduce on the host transport moves its bytes with the copy engines
/// (`FLASHCOMM_HOST_COPY`, docs/protocols.md "The copy-engine schedule").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HostCopy {
    /// Never: the kernels move the bytes (the default until the GPU shows the schedule).
    #[default]
    Off,
    /// Every lossless AllReduce the host transport serves eagerly.
    On,
    /// Where set-up measures it faster (not measured yet: the same as `off`).
    Auto,
}

impl HostCopy {
    /// The spelling in settings (`off`, `on`, `auto`).
    pub fn name(self) -> &'static str {
        match self {
            HostCopy::Off => "off",
            HostCopy::On => "on",
            HostCopy::Auto => "auto",
        }
    }
}

impl Keyword for HostCopy {
    const KEYWORDS: &'static [Self] = &[HostCopy::Off, HostCopy::On, HostCopy::Auto];
    fn keyword(self) -> &'static str {
        self.name()
    }
}

impl Keyword for Protocol {
    const KEYWORDS: &'static [Self] = &Protocol::ALL;
    fn keyword(self) -> &'static str {
        self.name()
    }
}

impl Keyword for Algorithm {
    const KEYWORDS: &'static [Self] = &Algorithm::ALL;
    fn keyword(self) -> &'static str {
        self.name()
    }
}

impl Keyword for Transport {
    const KEYWORDS: &'static [Self] = &[Transport::P2p, Transport::Host];
    fn keyword(self) -> &'static str {
        self.name()
    }
}

impl Keyword for QuantChoice {
    const KEYWORDS: &'static [Self] = &[QuantChoice::Auto, QuantChoice::Always];
    fn keyword(self) -> &'static str {
        self.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_spell_and_parse_back() {
        for p in Protocol::ALL {
            assert_eq!(Choice::from_keyword(p.name()), Some(Choice::Force(p)));
        }
        assert_eq!(
            Choice::<Protocol>::from_keyword(" LL "),
            Some(Choice::Force(Protocol::Ll))
        );
        assert_eq!(
            Choice::<Algorithm>::from_keyword("AUTO"),
            Some(Choice::Auto)
        );
        assert_eq!(Choice::<Algorithm>::from_keyword("threeshot"), None);
        for h in HostCopy::KEYWORDS {
            assert_eq!(HostCopy::from_keyword(h.name()), Some(*h));
        }
        assert_eq!(HostCopy::from_keyword("maybe"), None);
        assert_eq!(Choice::Force(Transport::Host).to_string(), "host");
        assert_eq!(
            QuantChoice::from_keyword("always"),
            Some(QuantChoice::Always)
        );
    }
}
