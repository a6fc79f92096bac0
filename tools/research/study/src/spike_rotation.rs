//! "Spikes first, then rotation", an experiment on top of the codec: each group's spikes are
//! taken out of the *unrotated* group and kept exactly, and only the rest is rotated (see
//! [`crate::rotation`]) and quantized, without spikes.
//!
//! Per rank and per group of `g` values of the flattened buffer (the codec's groups), for a
//! format of `b` bits, group `g` and `k` spikes:
//!
//! * the `k` spikes are picked as the codec's encoder picks them ([`select_spikes`]: alternately
//!   the smallest and the largest value not yet picked, the first index on ties); their `bf16`
//!   values and positions are kept;
//! * those positions are set to 0, the group is rotated, rounded to `bf16` and encoded with the
//!   codec's format of the same width and group size and **0 spikes**.
//!
//! On the wire the spikes take the space they take in the codec's own `k`-spike blocks (`k`
//! values and `k` one-byte positions per group), so the traffic is the effective bits of the
//! `k`-spike format; [`Message`] carries the `k0` encoding and the spikes side by side.
//!
//! * One-shot ([`one_shot`]): every rank decodes the N encodings, sums them in `f32` in rank
//!   order, rotates the sum back group by group, adds every rank's spikes at their positions (in
//!   `f32`, rank order) and rounds to `bf16`.
//! * Two-step ([`two_step`]): the owner of a block decodes the N encodings, sums them in `f32`
//!   (rotated domain), rotates back, adds the N ranks' spikes and rounds to `bf16`; it encodes that
//!   reduced block again with the same scheme (the all-gather format); every rank decodes it,
//!   rotates back, puts the spikes back and rounds to `bf16`. Blocks and shards do not change the
//!   arithmetic, so the simulation runs over the whole buffer at once.
//!

use crate::rotation::Rotation;
use crate::spec::Spec;
use half::bf16;

/// What one rank sends: the rotated rest encoded without spikes, and the spikes.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The codec's encoding (format with 0 spikes) of the rotated, `bf16`-rounded rest.
    pub encoded: Vec<u8>,
    /// The spikes: position in the buffer and exact value, group by group in the codec's slot
    /// order.
    pub spikes: Vec<(usize, bf16)>,
}

fn k0_format(f: Spec) -> Result<flashcomm_codec::Format, String> {
    flashcomm_codec::Format::new(flashcomm_codec::DType::Bf16, f.bits, f.group, 0)
        .map_err(|e| e.to_string())
}

/// The positions of the `min(k, len)` spikes of one group, in the codec's slot order
/// ([`flashcomm_codec::select_spikes`], the encoder's own selection).
pub fn select_spikes(xs: &[f32], k: usize) -> Vec<usize> {
    let mut picked = vec![false; xs.len()];
    let (slots, n) = flashcomm_codec::select_spikes(xs, k, &mut picked);
    slots[..n].to_vec()
}

/// Splits a buffer group by group (groups of `group` values; a last, shorter group as the codec
/// treats it): the rest, with the spikes set to 0, in `f32`, and the spikes.
pub fn split(values: &[bf16], group: usize, k: usize) -> (Vec<f32>, Vec<(usize, bf16)>) {
    let mut rest: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
    let mut spikes = Vec::with_capacity(values.len().div_ceil(group) * k);
    for (j, g) in rest.chunks_mut(group).enumerate() {
        for i in select_spikes(g, k) {
            spikes.push((j * group + i, values[j * group + i]));
            g[i] = 0.0;
        }
    }
    (rest, spikes)
}

/// Encodes one rank's buffer with the scheme: spikes out, rotate the rest, round to `bf16`,
/// encode with the 0-spike format of `f`'s width and group.
pub fn encode(f: Spec, values: &[bf16]) -> Result<Message, String> {
    let fmt = k0_format(f)?;
    let (mut rest, spikes) = split(values, f.group.into(), f.spikes.into());
    Rotation::new(f.group.into()).forward(&mut rest);
    let rounded: Vec<bf16> = rest.into_iter().map(bf16::from_f32).collect();
    let encoded = flashcomm_codec::encode_to_vec(fmt, &rounded).map_err(|e| e.to_string())?;
    Ok(Message { encoded, spikes })
}

/// Decodes the messages of `n` values each, sums the decoded values in `f32` in message order
/// (`acc = v_0; acc = acc + v_i`), rotates the sum back, adds every message's spikes in message
/// order (`f32`) and rounds to `bf16`.
pub fn receive(f: Spec, messages: &[Message], n: usize) -> Result<Vec<bf16>, String> {
    let fmt = k0_format(f)?;
    let mut acc = vec![0f32; n];
    let mut vals = vec![0f32; n];
    for (r, m) in messages.iter().enumerate() {
        let out = if r == 0 { &mut acc } else { &mut vals };
        flashcomm_codec::decode_f32::<bf16>(fmt, &m.encoded, n, out).map_err(|e| e.to_string())?;
        if r > 0 {
            acc.iter_mut().zip(&vals).for_each(|(a, &v)| *a += v);
        }
    }
    Rotation::new(f.group.into()).inverse(&mut acc);
    for m in messages {
        for &(i, v) in &m.spikes {
            acc[i] += v.to_f32();
        }
    }
    Ok(acc.into_iter().map(bf16::from_f32).collect())
}

fn check(inputs: &[&[bf16]]) -> Result<usize, String> {
    let n = inputs.first().ok_or("no ranks")?.len();
    if inputs.iter().any(|x| x.len() != n) {
        return Err("ranks of different lengths".into());
    }
    Ok(n)
}

/// One-shot all-reduce with spikes first, then rotation: every rank encodes its partial once,
/// every rank [`receive`]s all N messages in rank order (the same bytes, the same arithmetic: the
/// same result on every rank).
pub fn one_shot(f: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String> {
    let n = check(inputs)?;
    let messages = inputs
        .iter()
        .map(|x| encode(f, x))
        .collect::<Result<Vec<_>, _>>()?;
    receive(f, &messages, n)
}

/// Two-step all-reduce with spikes first, then rotation: reduce-scatter with `rs` (the owner
/// [`receive`]s the N messages and gets the reduced `bf16` values), all-gather with `ag` (the
/// owner encodes the reduced values again; every rank [`receive`]s that one message).
pub fn two_step(rs: Spec, ag: Spec, inputs: &[&[bf16]]) -> Result<Vec<bf16>, String> {
    let n = check(inputs)?;
    let messages = inputs
        .iter()
        .map(|x| encode(rs, x))
        .collect::<Result<Vec<_>, _>>()?;
    let reduced = receive(rs, &messages, n)?;
    let gathered = encode(ag, &reduced)?;
    receive(ag, std::slice::from_ref(&gathered), n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashcomm_codec::{DType, Format};

    fn spec(bits: u8, group: u16, spikes: u8) -> Spec {
        Spec {
            bits,
            group,
            spikes,
        }
    }

    fn lcg(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// A partial like the model's: values of about 1, a few fixed outlier channels of about 20,
    /// and on rank 0 a massive activation of 25,500 at position 7.
    fn partial(n: usize, seed: u64, massive: bool) -> Vec<bf16> {
        let mut r = lcg(seed);
        (0..n)
            .map(|i| {
                let v = if massive && i == 7 {
                    25_500.0
                } else if i % 576 == 507 || i % 576 == 247 {
                    20.0 * r()
                } else {
                    r()
                };
                bf16::from_f32(v)
            })
            .collect()
    }

    fn rel_l2(q: &[bf16], e: &[bf16]) -> f64 {
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in q.iter().zip(e) {
            let (a, b) = (f64::from(a.to_f32()), f64::from(b.to_f32()));
            num += (a - b).powi(2);
            den += b * b;
        }
        (num / den).sqrt()
    }

    #[test]
    fn selection_is_the_codecs() {
        // Values with many ties (a coarse grid) and a partial last block and group.
        let n = 3 * 1024 + 200;
        let mut r = lcg(5);
        let values: Vec<bf16> = (0..n)
            .map(|i| {
                let v = (r() * 6.0).round();
                bf16::from_f32(if i % 301 == 0 { -40.0 } else { v })
            })
            .collect();
        let xs: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
        for group in [32u16, 64, 128, 256] {
            for k in [2u8, 4] {
                let fmt = Format::new(DType::Bf16, 4, group, k).unwrap();
                let enc = flashcomm_codec::encode_to_vec(fmt, &values).unwrap();
                let (g, k) = (usize::from(group), usize::from(k));
                for (j, grp) in xs.chunks(g).enumerate() {
                    let (b, jb) = (j * g / 1024, (j * g % 1024) / g);
                    let base = b * fmt.block_bytes() + fmt.spike_positions_offset() + jb * k;
                    let codec: Vec<usize> = (0..k.min(grp.len()))
                        .map(|s| usize::from(enc[base + s]))
                        .collect();
                    assert_eq!(select_spikes(grp, k), codec, "g{g} k{k} group {j}");
                }
            }
        }
        assert_eq!(select_spikes(&[1.0, 1.0, 1.0], 4), [0, 1, 2]);
        assert_eq!(select_spikes(&[3.0, -1.0, 3.0, -1.0], 4), [1, 0, 3, 2]);
    }

    #[test]
    fn split_zeroes_the_spikes_and_keeps_them_exactly() {
        let x = partial(2048 + 40, 1, true);
        let (rest, spikes) = split(&x, 128, 4);
        assert_eq!(spikes.len(), 16 * 4 + 4);
        for &(i, v) in &spikes {
            assert_eq!(rest[i], 0.0);
            assert_eq!(v, x[i]);
        }
        assert!(spikes.contains(&(7, bf16::from_f32(25_500.0))));
        let zeros = rest.iter().filter(|&&v| v == 0.0).count();
        assert!(zeros >= spikes.len());
        for (i, (&r, v)) in rest.iter().zip(&x).enumerate() {
            if !spikes.iter().any(|&(p, _)| p == i) {
                assert_eq!(r, v.to_f32());
            }
        }
    }

    #[test]
    fn huge_outliers_come_back_exactly_with_spikes() {
        let n = 4 * 1024;
        let a = partial(n, 2, true);
        let b = partial(n, 3, false);
        let inputs = [a.as_slice(), b.as_slice()];
        let exact = flashcomm_codec::reference::allreduce_lossless(&inputs);
        for g in [32u16, 128] {
            for k in [2u8, 4] {
                let f = spec(4, g, k);
                for out in [
                    one_shot(f, &inputs).unwrap(),
                    two_step(f, f, &inputs).unwrap(),
                ] {
                    // The massive value comes back as the exact sum: the error of the rest is far
                    // below the half ulp of bf16 at 25,500 (64).
                    assert_eq!(out[7], exact[7], "g{g} k{k}");
                    // The rest keeps the step of values of about 1, not of 25,500.
                    let rest: f32 = out
                        .iter()
                        .zip(&exact)
                        .enumerate()
                        .filter(|&(i, _)| i != 7)
                        .map(|(_, (q, e))| (q.to_f32() - e.to_f32()).abs())
                        .fold(0.0, f32::max);
                    assert!(rest < 8.0, "g{g} k{k}: {rest}");
                }
            }
        }
        // Rotation without taking the spikes out first spreads the massive value over its group:
        // the error of its other values grows several times over.
        let f = spec(4, 128, 2);
        let srot = one_shot(f, &inputs).unwrap();
        let rot_in: Vec<Vec<bf16>> = inputs
            .iter()
            .map(|x| {
                let mut v: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                Rotation::new(128).forward(&mut v);
                v.into_iter().map(bf16::from_f32).collect()
            })
            .collect();
        let rot_in: Vec<&[bf16]> = rot_in.iter().map(Vec::as_slice).collect();
        let fmt = Format::new(DType::Bf16, 4, 128, 2).unwrap();
        let mut rot: Vec<f32> = flashcomm_codec::reference::allreduce_oneshot(fmt, &rot_in)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        Rotation::new(128).inverse(&mut rot);
        let err0 = |o: &dyn Fn(usize) -> f32| {
            (0..128)
                .filter(|&i| i != 7)
                .map(|i| (o(i) - exact[i].to_f32()).abs())
                .fold(0f32, f32::max)
        };
        let (e_srot, e_rot) = (err0(&|i| srot[i].to_f32()), err0(&|i| rot[i]));
        assert!(e_rot > 5.0 * e_srot, "rot {e_rot}, srot {e_srot}");
    }

    #[test]
    fn error_is_small_at_8_bits_and_shrinks_with_bits() {
        let n = 8 * 1024;
        let parts: Vec<Vec<bf16>> = (0..4).map(|r| partial(n, 10 + r, r == 0)).collect();
        let inputs: Vec<&[bf16]> = parts.iter().map(Vec::as_slice).collect();
        let exact = flashcomm_codec::reference::allreduce_lossless(&inputs);
        for k in [0u8, 2, 4] {
            let mut last = (0.0, 0.0);
            for bits in [8u8, 6, 4, 3, 2] {
                let f = spec(bits, 64, k);
                let one = rel_l2(&one_shot(f, &inputs).unwrap(), &exact);
                let two = rel_l2(&two_step(f, f, &inputs).unwrap(), &exact);
                if bits == 8 {
                    // bf16 rounding of the rotated values and of the result dominates.
                    assert!(one < 1e-2 && two < 1e-2, "k{k}: {one} {two}");
                } else {
                    assert!(one > last.0 && two > last.1, "b{bits} k{k}");
                }
                // Two quantizations in a row cost more than one.
                assert!(two > one, "b{bits} k{k}: {two} vs {one}");
                last = (one, two);
            }
        }
        // The mixed two-step: an 8-bit all-gather after a 4-bit reduce-scatter.
        let mixed = two_step(spec(4, 64, 2), spec(8, 64, 2), &inputs).unwrap();
        let (m, o) = (
            rel_l2(&mixed, &exact),
            rel_l2(&one_shot(spec(4, 64, 2), &inputs).unwrap(), &exact),
        );
        assert!((m / o - 1.0).abs() < 0.1, "mixed {m}, one-shot {o}");
    }

    #[test]
    fn every_rank_gets_the_same_one_shot_result() {
        let n = 3 * 1024;
        let parts: Vec<Vec<bf16>> = (0..4).map(|r| partial(n, 20 + r, r == 2)).collect();
        let f = spec(3, 32, 2);
        let messages: Vec<Message> = parts.iter().map(|x| encode(f, x).unwrap()).collect();
        // Each rank holds its own copy of the N messages in rank order and runs the same
        // decode, sum, inverse rotation and spike merge.
        let per_rank: Vec<Vec<bf16>> = (0..4)
            .map(|_| receive(f, &messages.clone(), n).unwrap())
            .collect();
        assert!(per_rank.windows(2).all(|w| w[0] == w[1]));
        let inputs: Vec<&[bf16]> = parts.iter().map(Vec::as_slice).collect();
        assert_eq!(one_shot(f, &inputs).unwrap(), per_rank[0]);
        // The encoding is the codec's k0 format; the spikes are k per group.
        let k0 = Format::new(DType::Bf16, 3, 32, 0).unwrap();
        assert_eq!(messages[0].encoded.len(), k0.encoded_len(n));
        assert_eq!(messages[0].spikes.len(), n / 32 * 2);
    }

    #[test]
    fn bad_inputs_are_refused() {
        let a = partial(100, 1, false);
        let b = partial(99, 1, false);
        assert!(one_shot(spec(4, 32, 2), &[&a, &b]).is_err());
        assert!(one_shot(spec(4, 32, 2), &[]).is_err());
        assert!(one_shot(spec(9, 32, 2), &[&a]).is_err());
    }
}
