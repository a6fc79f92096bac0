//! Fault class 5: the environment under a deterministic randomized harness. Every variable the
//! library reads gets overlong, non-UTF-8, whitespace-padded, control-character and conflicting
//! values, alone and in random combinations. Reading never panics; a value the library cannot
//! use is reported in a message that names the variable and shows at most a bounded part of the
//! value; a bad `FLASHCOMM_*` value makes the library fall back to passing every call through;
//! and a variable given twice is read as `getenv` reads it (the first value), with a warning.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use flashcomm_config::{Config, variables};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A garbage value of kind `k`.
fn garbage(rng: &mut Rng, k: u64) -> OsString {
    match k {
        0 => OsString::from("9".repeat(100_000)),
        1 => OsString::from_vec(vec![0xff, 0xfe, b'4', 0x80]),
        2 => OsString::from(format!("  \t{}\n ", rng.below(100))),
        3 => OsString::from("4\u{0}8"),
        4 => OsString::from("\u{202e}allreduce"),
        5 => OsString::from(format!("{}", u64::MAX)),
        6 => OsString::from("-1"),
        7 => OsString::from("1K,2M,;;"),
        8 => OsString::from("ll,block"),
        _ => {
            let len = rng.below(64) as usize;
            OsString::from_vec((0..len).map(|_| rng.below(256) as u8).collect())
        }
    }
}

/// How long a message may be beside the allowed values it lists, whatever the value's length.
const SHOWN: usize = 1000;

#[test]
fn garbage_in_every_variable_is_reported_by_name_and_falls_back() {
    let specs = variables();
    let mut rng = Rng(0x5eed_f00d);
    for spec in &specs {
        for k in 0..12 {
            let value = garbage(&mut rng, k);
            let c = Config::from_vars([(OsString::from(spec.name), value.clone())]);
            let named: Vec<_> = c
                .problems
                .iter()
                .filter(|p| p.variable == spec.name)
                .collect();
            if named.is_empty() {
                // Accepted (whitespace around a valid value, for example): the setting is valid.
                continue;
            }
            for p in &named {
                let text = p.to_string();
                assert!(text.contains(spec.name), "{text}");
                assert!(
                    text.len() < SHOWN + spec.allowed.len(),
                    "{}: a message of {} bytes for a value of {}",
                    spec.name,
                    text.len(),
                    value.len()
                );
            }
            if spec.strict {
                let why = c.passthrough_forced.as_deref().unwrap_or_else(|| {
                    panic!(
                        "{}={value:?}: a bad value must force pass-through",
                        spec.name
                    )
                });
                assert!(why.contains(spec.name), "{why}");
                assert!(c.passthrough());
            }
        }
    }
}

#[test]
fn random_environments_never_panic_and_bad_ones_fall_back() {
    let specs = variables();
    let mut rng = Rng(0xc0ff_ee00);
    for _ in 0..2000 {
        let n = rng.below(8) + 1;
        let vars: Vec<(OsString, OsString)> = (0..n)
            .map(|_| {
                let spec = &specs[rng.below(specs.len() as u64) as usize];
                let k = rng.below(14);
                let value = if k >= 12 {
                    // Sometimes a value that is probably valid for some variable.
                    OsString::from(
                        ["1", "0", "4", "auto", "64M", "allreduce"][rng.below(6) as usize],
                    )
                } else {
                    garbage(&mut rng, k)
                };
                (OsString::from(spec.name), value)
            })
            .collect();
        let c = Config::from_vars(vars.iter().cloned());
        if c.problems.iter().any(|p| p.strict) {
            assert!(c.passthrough(), "{vars:?}");
        }
        let _ = c.describe();
        let _ = c.agreement_digest();
    }
}

/// The C library's `getenv` (and so NCCL, and anything else in the process) reads the first of
/// two entries of one name; the configuration must read the same value, and say so.
#[test]
fn a_variable_given_twice_reads_the_first_value_with_a_warning() {
    let c = Config::from_vars([
        ("FLASHCOMM_QUANT_BITS", "4"),
        ("FLASHCOMM_MIN_BYTES", "1K"),
        ("FLASHCOMM_QUANT_BITS", "8"),
    ]);
    assert_eq!(c.quant_rs_bits(), flashcomm_config::QuantBits::Bits(4));
    let p = c
        .problems
        .iter()
        .find(|p| p.variable == "FLASHCOMM_QUANT_BITS")
        .expect("a warning about the second value");
    assert!(
        !p.strict,
        "the first value is used: nothing to fall back from"
    );
    assert!(p.to_string().contains("twice"), "{p}");
    assert!(c.passthrough_forced.is_none());
    // The same value twice is no problem.
    let c = Config::from_vars([("FLASHCOMM_QUANT_BITS", "4"), ("FLASHCOMM_QUANT_BITS", "4")]);
    assert!(c.problems.is_empty());
}

/// Conflicting settings: each is reported by name and the library falls back.
#[test]
fn conflicting_values_are_reported_by_name() {
    for (vars, named) in [
        (
            vec![("FLASHCOMM_MIN_BYTES", "2M"), ("FLASHCOMM_MAX_BYTES", "1M")],
            "FLASHCOMM_MIN_BYTES",
        ),
        (
            vec![
                ("FLASHCOMM_QUANT_MIN_BYTES", "1G"),
                ("FLASHCOMM_QUANT_MAX_BYTES", "1K"),
            ],
            "FLASHCOMM_QUANT_MIN_BYTES",
        ),
    ] {
        let c = Config::from_vars(vars.iter().copied());
        let why = c.passthrough_forced.expect("falls back");
        assert!(why.contains(named), "{why}");
    }
}
