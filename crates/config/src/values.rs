//! Value types of the variables: how each parses from text and how it is shown.

use std::fmt;

use flashcomm_codec::{ALL_DTYPES, Collective, DType};

/// A value that a variable can hold.
pub trait Value: Sized {
    /// Parses the text of a variable. `Err` may carry a detail; the caller adds the variable name,
    /// the value and the allowed values.
    fn parse(raw: &str) -> Result<Self, Option<String>>;
    /// The text form, as it would be written in the environment (`unset` for an absent option).
    fn show(&self) -> String;
}

impl<T: Value> Value for Option<T> {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        T::parse(raw).map(Some)
    }
    fn show(&self) -> String {
        match self {
            Some(v) => v.show(),
            None => "unset".to_string(),
        }
    }
}

impl Value for bool {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(None),
        }
    }
    fn show(&self) -> String {
        if *self { "1" } else { "0" }.to_string()
    }
}

/// Free text (trimmed, not empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(pub String);

impl Value for Text {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim();
        if t.is_empty() {
            Err(None)
        } else {
            Ok(Text(t.to_string()))
        }
    }
    fn show(&self) -> String {
        self.0.clone()
    }
}

/// A file path that `dlopen` takes as a path, never as a bare name to search for: it must contain
/// a `/` (a bare `libnccl.so.2` would find this very library again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibPath(pub String);

impl Value for LibPath {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim();
        if t.is_empty() {
            Err(None)
        } else if !t.contains('/') {
            Err(Some(
                "a bare library name would be searched for and could find flashcomm itself".into(),
            ))
        } else {
            Ok(LibPath(t.to_string()))
        }
    }
    fn show(&self) -> String {
        self.0.clone()
    }
}

/// Where a fault can be injected into a communicator's set-up (`FLASHCOMM_DEBUG_FAULT`, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// The creation hook panics before anything else (before the exchange's first round).
    HookPanic,
    /// The exchange's resources (device, stream, buffers) cannot be prepared as usual.
    ExchangePrepare,
    /// This rank's frame of round `n` cannot be copied to where the all-gather reads it (nor
    /// the failure frame that replaces it).
    ExchangeUpload,
    /// The real all-gather of round `n` refuses the call once (a transient error).
    ExchangeEnqueue,
    /// A local step of the set-up panics before round `n` of the communicator's own rounds
    /// (`n` = 0: before the transport is chosen; `n` = 1..: set-up step `n - 1`).
    SetupPanic,
    /// Set-up step `n` fails (an allocation, a driver call or a launch failing there).
    SetupStep,
}

impl FaultPoint {
    const ALL: [(&'static str, FaultPoint); 6] = [
        ("hook-panic", FaultPoint::HookPanic),
        ("exchange-prepare", FaultPoint::ExchangePrepare),
        ("exchange-upload", FaultPoint::ExchangeUpload),
        ("exchange-enqueue", FaultPoint::ExchangeEnqueue),
        ("setup-panic", FaultPoint::SetupPanic),
        ("setup-step", FaultPoint::SetupStep),
    ];

    /// The point's name in `FLASHCOMM_DEBUG_FAULT`.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("?", |(n, _)| n)
    }
}

/// One injected fault: `point[:n][@rank]` (`n`: the round or step, default 0; no rank: every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Where.
    pub point: FaultPoint,
    /// Which round or step.
    pub n: u32,
    /// Which rank (of the communicator being set up); `None`: every rank.
    pub rank: Option<u32>,
}

/// Faults injected into communicator set-up, for tests of the failure paths
/// (`FLASHCOMM_DEBUG_FAULT`): a comma list of [`Fault`]s.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Faults(pub Vec<Fault>);

impl Faults {
    /// The fault at `point` for `rank`, if one is injected: its `n`.
    pub fn at(&self, point: FaultPoint, rank: u32) -> Option<u32> {
        self.0
            .iter()
            .find(|f| f.point == point && f.rank.is_none_or(|r| r == rank))
            .map(|f| f.n)
    }
}

impl Value for Faults {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let mut out = Vec::new();
        for item in raw.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (what, rank) = match item.split_once('@') {
                Some((w, r)) => (
                    w,
                    Some(r.trim().parse::<u32>().map_err(|_| {
                        Some(format!("{item:?}: the rank after @ is not a number"))
                    })?),
                ),
                None => (item, None),
            };
            let (name, n) = match what.split_once(':') {
                Some((p, n)) => (
                    p.trim(),
                    n.trim()
                        .parse::<u32>()
                        .map_err(|_| Some(format!("{item:?}: the number after : is not one")))?,
                ),
                None => (what.trim(), 0),
            };
            let point = FaultPoint::ALL
                .iter()
                .find(|(p, _)| *p == name)
                .map(|(_, p)| *p)
                .ok_or_else(|| Some(format!("{item:?}: no fault point {name:?}")))?;
            out.push(Fault { point, n, rank });
        }
        if out.is_empty() {
            return Err(None);
        }
        Ok(Faults(out))
    }
    fn show(&self) -> String {
        self.0
            .iter()
            .map(|f| {
                let mut t = format!("{}:{}", f.point.name(), f.n);
                if let Some(r) = f.rank {
                    t.push_str(&format!("@{r}"));
                }
                t
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The name of an exported API function (`ncclX` or `pncclX`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionName(pub String);

impl Value for FunctionName {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim();
        let ok = (t.starts_with("nccl") || t.starts_with("pnccl") || t.starts_with("flashcomm"))
            && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if ok {
            Ok(FunctionName(t.to_string()))
        } else {
            Err(None)
        }
    }
    fn show(&self) -> String {
        self.0.clone()
    }
}

/// An unsigned integer in `LO..=HI`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bounded<const LO: u64, const HI: u64>(pub u64);

impl<const LO: u64, const HI: u64> Value for Bounded<LO, HI> {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let v: u64 = raw.trim().parse().map_err(|_| None)?;
        if (LO..=HI).contains(&v) {
            Ok(Bounded(v))
        } else {
            Err(None)
        }
    }
    fn show(&self) -> String {
        self.0.to_string()
    }
}

/// A size in bytes: a decimal integer with an optional binary suffix `K`, `M`, `G` or `T`
/// (also `KiB`, `KB`, ...; all mean powers of 1024).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub u64);

/// 1 KiB.
pub const KIB: u64 = 1 << 10;
/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

impl Value for Bytes {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim();
        let digits = t.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(None);
        }
        let (num, suffix) = t.split_at(digits);
        let n: u64 = num
            .parse()
            .map_err(|_| Some("number too large".to_string()))?;
        let unit = match suffix.trim().to_ascii_uppercase().as_str() {
            "" | "B" => 1,
            "K" | "KB" | "KIB" => KIB,
            "M" | "MB" | "MIB" => MIB,
            "G" | "GB" | "GIB" => GIB,
            "T" | "TB" | "TIB" => TIB,
            _ => return Err(None),
        };
        n.checked_mul(unit)
            .map(Bytes)
            .ok_or_else(|| Some("number too large".to_string()))
    }
    fn show(&self) -> String {
        let v = self.0;
        for (unit, s) in [(TIB, "T"), (GIB, "G"), (MIB, "M"), (KIB, "K")] {
            if v != 0 && v.is_multiple_of(unit) {
                return format!("{}{s}", v / unit);
            }
        }
        v.to_string()
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.show())
    }
}

/// Declares a keyword enum: variants, their spelling, `Value` and `Display`.
macro_rules! keyword_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vm])* $variant),+ }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The spelling of this value.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl Value for $name {
            fn parse(raw: &str) -> Result<Self, Option<String>> {
                let t = raw.trim().to_ascii_lowercase();
                match t.as_str() {
                    $($text => Ok($name::$variant),)+
                    _ => Err(None),
                }
            }
            fn show(&self) -> String {
                self.as_str().to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// The words of a call's route (protocol, algorithm, transport, quantization choice, a forced or
/// automatic choice): declared once in the codec crate; the configuration parses into them.
pub use flashcomm_codec::{Algorithm, Choice, HostCopy, Keyword, Protocol, QuantChoice, Transport};

/// `auto`, or one of `T`'s keywords.
impl<T: Keyword> Value for Choice<T> {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        Choice::from_keyword(raw).ok_or(None)
    }
    fn show(&self) -> String {
        self.keyword().to_string()
    }
}

impl Value for QuantChoice {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        QuantChoice::from_keyword(raw).ok_or(None)
    }
    fn show(&self) -> String {
        self.name().to_string()
    }
}

impl Value for HostCopy {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        HostCopy::from_keyword(raw).ok_or(None)
    }
    fn show(&self) -> String {
        self.name().to_string()
    }
}

/// A collective kind (the tree's one collective enum), as `FLASHCOMM_OPS` spells it: one of
/// [`Collective::KERNELS`].
impl Value for Collective {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim().to_ascii_lowercase();
        Collective::KERNELS
            .into_iter()
            .find(|k| k.name() == t)
            .ok_or(None)
    }
    fn show(&self) -> String {
        self.name().to_string()
    }
}

/// An element type (the tree's one datatype enum), as `FLASHCOMM_QUANT_DTYPES` spells it: `bf16`,
/// `f16` or `f32`.
impl Value for DType {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim().to_ascii_lowercase();
        ALL_DTYPES.into_iter().find(|d| d.suffix() == t).ok_or(None)
    }
    fn show(&self) -> String {
        self.suffix().to_string()
    }
}

keyword_enum! {
    /// `NCCL_DEBUG`.
    DebugLevel {
        /// Nothing at all.
        None = "none",
        /// A version banner, and warnings.
        Version = "version",
        /// Warnings.
        Warn = "warn",
        /// Information.
        Info = "info",
        /// Like INFO (NCCL orders ABORT above INFO).
        Abort = "abort",
        /// Everything, including one line per API call.
        Trace = "trace",
    }
}

/// A comma-separated set of keywords (`none` is the empty set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Set<T>(pub Vec<T>);

impl<T> Set<T> {
    /// Whether the set holds `v`.
    pub fn contains(&self, v: &T) -> bool
    where
        T: PartialEq,
    {
        self.0.contains(v)
    }
}

impl<T: Value + PartialEq> Value for Set<T> {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim();
        if t.eq_ignore_ascii_case("none") {
            return Ok(Set(Vec::new()));
        }
        let mut out = Vec::new();
        for part in t.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let v = T::parse(part).map_err(|_| Some(format!("`{part}` is not allowed")))?;
            if !out.contains(&v) {
                out.push(v);
            }
        }
        if out.is_empty() {
            Err(None)
        } else {
            Ok(Set(out))
        }
    }
    fn show(&self) -> String {
        if self.0.is_empty() {
            return "none".to_string();
        }
        self.0.iter().map(Value::show).collect::<Vec<_>>().join(",")
    }
}

/// `FLASHCOMM_QUANT_BITS`: how a step's payload travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantBits {
    /// Lossless: the values travel in their own type.
    Off,
    /// Values travel as 16-bit floats (f32 inputs only; 16-bit inputs travel unchanged).
    Half,
    /// Group quantization with this many bits per value (2..=8).
    Bits(u8),
}

impl Value for QuantBits {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim().to_ascii_lowercase();
        match t.as_str() {
            "off" | "0" | "none" => Ok(QuantBits::Off),
            "16" => Ok(QuantBits::Half),
            _ => match t.parse::<u8>() {
                Ok(b @ 2..=8) => Ok(QuantBits::Bits(b)),
                _ => Err(None),
            },
        }
    }
    fn show(&self) -> String {
        match self {
            QuantBits::Off => "off".to_string(),
            QuantBits::Half => "16".to_string(),
            QuantBits::Bits(b) => b.to_string(),
        }
    }
}

/// One of a fixed list of integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneOf<const A: u32, const B: u32, const C: u32, const D: u32>(pub u32);

impl<const A: u32, const B: u32, const C: u32, const D: u32> Value for OneOf<A, B, C, D> {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let v: u32 = raw.trim().parse().map_err(|_| None)?;
        if [A, B, C, D].contains(&v) {
            Ok(OneOf(v))
        } else {
            Err(None)
        }
    }
    fn show(&self) -> String {
        self.0.to_string()
    }
}

/// `NCCL_DEBUG_SUBSYS`: a comma list of subsystem names, `ALL`, or `^list` (all but those).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subsystems {
    /// `true` for the `^` form: every subsystem except `names`.
    pub negated: bool,
    /// Upper-case names as written (unknown names are kept; they select nothing).
    pub names: Vec<String>,
}

impl Subsystems {
    /// NCCL's default selection: `INIT,BOOTSTRAP,ENV`.
    pub fn nccl_default() -> Self {
        Subsystems {
            negated: false,
            names: vec!["INIT".into(), "BOOTSTRAP".into(), "ENV".into()],
        }
    }

    /// Whether subsystem `name` (upper case) is selected.
    pub fn selects(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| n == name || n == "ALL");
        listed != self.negated
    }
}

impl Value for Subsystems {
    fn parse(raw: &str) -> Result<Self, Option<String>> {
        let t = raw.trim();
        let (negated, rest) = match t.strip_prefix('^') {
            Some(r) => (true, r),
            None => (false, t),
        };
        let mut names = Vec::new();
        for part in rest.split(',') {
            let p = part.trim();
            if p.is_empty() {
                continue;
            }
            if !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(Some(format!("`{p}` is not a subsystem name")));
            }
            names.push(p.to_ascii_uppercase());
        }
        if names.is_empty() {
            return Err(None);
        }
        Ok(Subsystems { negated, names })
    }
    fn show(&self) -> String {
        format!(
            "{}{}",
            if self.negated { "^" } else { "" },
            self.names.join(",")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(Bytes::parse("0"), Ok(Bytes(0)));
        assert_eq!(Bytes::parse("4096"), Ok(Bytes(4096)));
        assert_eq!(Bytes::parse("64K"), Ok(Bytes(64 * KIB)));
        assert_eq!(Bytes::parse("64kib"), Ok(Bytes(64 * KIB)));
        assert_eq!(Bytes::parse("2M"), Ok(Bytes(2 * MIB)));
        assert_eq!(Bytes::parse(" 1G "), Ok(Bytes(GIB)));
        assert!(Bytes::parse("1.5G").is_err());
        assert!(Bytes::parse("G").is_err());
        assert!(Bytes::parse("-1").is_err());
        assert!(Bytes::parse("99999999999999999999").is_err());
        assert!(Bytes::parse("20000000000T").is_err());
        assert_eq!(Bytes(GIB).show(), "1G");
        assert_eq!(Bytes(64 * MIB).show(), "64M");
        assert_eq!(Bytes(1000).show(), "1000");
        assert_eq!(Bytes(0).show(), "0");
    }

    #[test]
    fn quant_bits() {
        assert_eq!(QuantBits::parse("off"), Ok(QuantBits::Off));
        assert_eq!(QuantBits::parse("16"), Ok(QuantBits::Half));
        assert_eq!(QuantBits::parse("4"), Ok(QuantBits::Bits(4)));
        assert!(QuantBits::parse("1").is_err());
        assert!(QuantBits::parse("9").is_err());
        assert!(QuantBits::parse("12").is_err());
    }

    #[test]
    fn sets_and_keywords() {
        let s = Set::<Collective>::parse("allreduce, AllGather,allreduce").unwrap();
        assert_eq!(s.0, vec![Collective::AllReduce, Collective::AllGather]);
        assert_eq!(s.show(), "allreduce,allgather");
        assert_eq!(Set::<Collective>::parse("none").unwrap().0, vec![]);
        assert!(Set::<Collective>::parse("allreduce,broadcast").is_err());
        assert_eq!(
            Set::<Collective>::parse("alltoall").unwrap().0,
            vec![Collective::AlltoAll]
        );
        assert!(Set::<Collective>::parse(",").is_err());
        assert_eq!(
            Choice::<Protocol>::parse("LL"),
            Ok(Choice::Force(Protocol::Ll))
        );
        assert!(Choice::<Algorithm>::parse("threeshot").is_err());
    }

    #[test]
    fn subsystems() {
        let s = Subsystems::parse("init,coll").unwrap();
        assert!(s.selects("INIT") && s.selects("COLL") && !s.selects("P2P"));
        let n = Subsystems::parse("^COLL").unwrap();
        assert!(!n.selects("COLL") && n.selects("INIT"));
        let all = Subsystems::parse("ALL").unwrap();
        assert!(all.selects("TUNING"));
        assert!(Subsystems::parse("INIT;COLL").is_err());
        assert!(Subsystems::nccl_default().selects("ENV"));
    }

    #[test]
    fn lib_path_refuses_bare_names() {
        assert!(LibPath::parse("libnccl.so.2").is_err());
        assert_eq!(
            LibPath::parse("/opt/nccl/lib/libnccl.so.2").unwrap().0,
            "/opt/nccl/lib/libnccl.so.2"
        );
        assert!(LibPath::parse("./libnccl.so.2").is_ok());
    }

    #[test]
    fn bools_and_bounds() {
        assert_eq!(bool::parse("YES"), Ok(true));
        assert_eq!(bool::parse("0"), Ok(false));
        assert!(bool::parse("2").is_err());
        assert_eq!(Bounded::<1, 8>::parse("8"), Ok(Bounded(8)));
        assert!(Bounded::<1, 8>::parse("9").is_err());
        assert!(Bounded::<1, 8>::parse("0").is_err());
        assert_eq!(OneOf::<0, 2, 4, 4>::parse("2"), Ok(OneOf(2)));
        assert!(OneOf::<0, 2, 4, 4>::parse("3").is_err());
    }
}
