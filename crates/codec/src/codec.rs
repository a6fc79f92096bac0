//! Encoding, decoding, the fused reduce step and the error bound (`docs/codec.md`).
//!
//! The block functions here are written as plain loops over one block at a time so that they
//! read like the specification and stay fast in unoptimized test builds.

use crate::element::{Element, ulp_generic};
use crate::error::CodecError;
use crate::format::{BLOCK_VALUES, DType, Format, HEADER_BYTES};

/// Largest group the format allows; sizes the per-group scratch arrays.
const MAX_GROUP: usize = 256;

/// The absolute floor of the error bound, `2^(b - 126)`: it only matters when the step is below
/// `2^-128`, where `1 / step` overflows to infinity and every value above `lo` takes the top code.
pub(crate) fn tiny_step_floor(bits: u8) -> f64 {
    2f64.powi(i32::from(bits) - 126)
}

/// Unit in the last place of f32 at `|y|` (2^-149 below the smallest normal).
pub(crate) fn ulp_f32(y: f64) -> f64 {
    ulp_generic(y, 23, -126, f64::INFINITY)
}

fn check_dtype<T: Element>(fmt: &Format) -> Result<(), CodecError> {
    if T::DTYPE == fmt.dtype() {
        Ok(())
    } else {
        Err(CodecError::DType {
            format: fmt.dtype(),
            element: T::DTYPE,
        })
    }
}

fn check_encoded_len(fmt: &Format, n: usize, actual: usize) -> Result<(), CodecError> {
    let expected = fmt
        .checked_encoded_len(n)
        .ok_or(CodecError::TooLarge { n })?;
    if expected == actual {
        Ok(())
    } else {
        Err(CodecError::EncodedLength { expected, actual })
    }
}

fn check_value_len(expected: usize, actual: usize) -> Result<(), CodecError> {
    if expected == actual {
        Ok(())
    } else {
        Err(CodecError::ValueLength { expected, actual })
    }
}

/// Checks bytes 4..16 of every block header of an encoded buffer of `n` values. The buffer's
/// length must already be `fmt.encoded_len(n)`.
fn check_headers(fmt: &Format, input: &[u8], n: usize) -> Result<(), CodecError> {
    const FIELDS: [(&str, usize, usize); 6] = [
        ("nvalues", 4, 2),
        ("bits", 6, 1),
        ("group_log2", 7, 1),
        ("spikes", 8, 1),
        ("dtype", 9, 1),
        ("reserved", 10, 6),
    ];
    let bb = fmt.block_bytes();
    for (b, block) in input.chunks_exact(bb).enumerate() {
        let nv = Format::block_values(n, b) as u16;
        let want = fmt.header_fields(nv);
        let got = &block[4..HEADER_BYTES];
        if got == want {
            continue;
        }
        for (name, off, len) in FIELDS {
            let r = off - 4..off - 4 + len;
            if got[r.clone()] != want[r.clone()] {
                let le = |s: &[u8]| {
                    s.iter()
                        .take(4)
                        .enumerate()
                        .fold(0u32, |a, (i, &x)| a | u32::from(x) << (8 * i))
                };
                return Err(CodecError::Header {
                    block: b,
                    field: name,
                    expected: le(&want[r.clone()]),
                    found: le(&got[r]),
                });
            }
        }
    }
    Ok(())
}

/// Validates a call that reads an encoded buffer.
fn check_decode_args<T: Element>(
    fmt: &Format,
    input: &[u8],
    n: usize,
    out_len: usize,
) -> Result<(), CodecError> {
    check_dtype::<T>(fmt)?;
    check_value_len(n, out_len)?;
    check_encoded_len(fmt, n, input.len())?;
    check_headers(fmt, input, n)
}

// ---------------------------------------------------------------------------------------------
// Bit planes

/// Writes the codes of the first `codes.len()` values of a block into its bit planes (the planes
/// must be zero beforehand).
fn pack_planes(fmt: &Format, codes: &[u8], block: &mut [u8]) {
    let units = fmt.units();
    let mut below: u32 = u32::from(fmt.bits());
    for (p, &u) in units.iter().enumerate() {
        below -= u32::from(u);
        let u = usize::from(u);
        let mask = ((1u32 << u) - 1) as u8;
        let start = fmt.plane_offset(p);
        let plane = &mut block[start..start + fmt.plane_bytes(p)];
        for (v, &q) in codes.iter().enumerate() {
            let bit = v * u;
            let unit = (q >> below) & mask;
            plane[bit / 8] |= unit << (bit % 8);
        }
    }
}

/// Reads the codes of the first `codes.len()` values of a block from its bit planes.
fn unpack_planes(fmt: &Format, block: &[u8], codes: &mut [u8]) {
    codes.fill(0);
    let units = fmt.units();
    let mut below: u32 = u32::from(fmt.bits());
    for (p, &u) in units.iter().enumerate() {
        below -= u32::from(u);
        let u = usize::from(u);
        let mask = ((1u32 << u) - 1) as u8;
        let start = fmt.plane_offset(p);
        let plane = &block[start..start + fmt.plane_bytes(p)];
        for (v, q) in codes.iter_mut().enumerate() {
            let bit = v * u;
            let unit = (plane[bit / 8] >> (bit % 8)) & mask;
            *q |= unit << below;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding

/// Where the metadata of group `j` lives inside a block.
struct GroupMeta {
    lo: usize,
    hi: usize,
    spike_values: usize,
    spike_positions: usize,
}

fn group_meta(fmt: &Format, j: usize) -> GroupMeta {
    let s = fmt.dtype().size();
    let k = usize::from(fmt.spikes());
    GroupMeta {
        lo: fmt.range_offset() + 2 * j * s,
        hi: fmt.range_offset() + (2 * j + 1) * s,
        spike_values: fmt.spike_values_offset() + j * k * s,
        spike_positions: fmt.spike_positions_offset() + j * k,
    }
}

/// The spikes of one group of values without NaN, as the encoder selects them: the positions
/// of `min(k, 4, xs.len())` values in slot order (returned with their number), picks 0 and 2 the
/// smallest value not yet picked, picks 1 and 3 the largest; strict comparisons keep the lowest
/// index on ties (-0 and +0 compare equal). Marks each in `picked` (false on entry, at least
/// `xs.len()` long).
pub fn select_spikes(xs: &[f32], k: usize, picked: &mut [bool]) -> ([usize; 4], usize) {
    let ke = k.min(4).min(xs.len());
    let mut slots = [0usize; 4];
    for (p, slot) in slots.iter_mut().enumerate().take(ke) {
        let want_max = p % 2 == 1;
        let mut best = usize::MAX;
        for (i, &x) in xs.iter().enumerate() {
            if picked[i] {
                continue;
            }
            if best == usize::MAX || (want_max && x > xs[best]) || (!want_max && x < xs[best]) {
                best = i;
            }
        }
        picked[best] = true;
        *slot = best;
    }
    (slots, ke)
}

/// Encodes one group of `values.len()` (1..=g) valid values: writes its range, spikes and
/// positions into `block` and its codes into `codes`.
fn encode_group<T: Element>(
    fmt: &Format,
    j: usize,
    values: &[T],
    codes: &mut [u8],
    block: &mut [u8],
) {
    let len = values.len();
    let meta = group_meta(fmt, j);
    let s = T::BYTES;
    let poison = |block: &mut [u8]| {
        let nan = T::canonical_nan();
        nan.write_le(&mut block[meta.lo..meta.lo + s]);
        nan.write_le(&mut block[meta.hi..meta.hi + s]);
    };

    let mut xs = [0f32; MAX_GROUP];
    let mut any_nan = false;
    for (x, v) in xs.iter_mut().zip(values) {
        *x = v.to_f32();
        any_nan |= x.is_nan();
    }
    let xs = &xs[..len];
    if any_nan {
        poison(block);
        return;
    }

    let mut picked = [false; MAX_GROUP];
    let (slots, ke) = select_spikes(xs, usize::from(fmt.spikes()), &mut picked);

    // Range of the rest.
    let mut lo_i = usize::MAX;
    let mut hi_i = usize::MAX;
    for (i, &x) in xs.iter().enumerate() {
        if picked[i] {
            continue;
        }
        if lo_i == usize::MAX {
            lo_i = i;
            hi_i = i;
            continue;
        }
        if x < xs[lo_i] {
            lo_i = i;
        }
        if x > xs[hi_i] {
            hi_i = i;
        }
    }
    let (lo, hi) = if lo_i == usize::MAX {
        (T::from_bits(0), T::from_bits(0))
    } else {
        (values[lo_i], values[hi_i])
    };
    let (lo_f, hi_f) = (lo.to_f32(), hi.to_f32());
    let range = hi_f - lo_f;
    let max_code = fmt.max_code() as f32;
    let step = range / max_code;
    // The decoded value of the top code, computed as the decoder does: when it overflows (only
    // possible for ranges within about 2^-23 of f32::MAX) the range does not fit in f32.
    let top = lo_f + max_code * step;
    if lo_f.is_infinite() || hi_f.is_infinite() || range.is_infinite() || top.is_infinite() {
        poison(block);
        return;
    }
    lo.write_le(&mut block[meta.lo..meta.lo + s]);
    hi.write_le(&mut block[meta.hi..meta.hi + s]);

    // Codes of the rest.
    let r = 1.0f32 / step;
    for (i, &x) in xs.iter().enumerate() {
        if picked[i] {
            continue;
        }
        let t = (x - lo_f) * r;
        codes[i] = if t.is_nan() || t < 0.0 {
            0
        } else if t >= max_code {
            max_code as u8
        } else {
            t.round_ties_even() as u8
        };
    }

    // Spike slots; slots >= ke stay +0 at position 0.
    for (slot, &i) in slots.iter().enumerate().take(ke) {
        let off = meta.spike_values + slot * s;
        values[i].write_le(&mut block[off..off + s]);
        block[meta.spike_positions + slot] = i as u8;
    }
}

/// Encodes one block of 1..=1024 values into `block` (exactly `block_bytes` long).
fn encode_block<T: Element>(fmt: &Format, values: &[T], block: &mut [u8]) {
    block.fill(0);
    let nv = values.len();
    block[4..HEADER_BYTES].copy_from_slice(&fmt.header_fields(nv as u16));
    let mut codes = [0u8; BLOCK_VALUES];
    let g = usize::from(fmt.group());
    for (j, (vals, cs)) in values.chunks(g).zip(codes.chunks_mut(g)).enumerate() {
        encode_group(fmt, j, vals, cs, block);
    }
    pack_planes(fmt, &codes[..nv], block);
}

/// Encodes `input` with `fmt` into `out`, which must be exactly `fmt.encoded_len(input.len())`
/// bytes. Deterministic: the same input always gives the same bytes, padding included.
pub fn encode<T: Element>(fmt: Format, input: &[T], out: &mut [u8]) -> Result<(), CodecError> {
    check_dtype::<T>(&fmt)?;
    check_encoded_len(&fmt, input.len(), out.len())?;
    let bb = fmt.block_bytes();
    for (vals, block) in input.chunks(BLOCK_VALUES).zip(out.chunks_exact_mut(bb)) {
        encode_block(&fmt, vals, block);
    }
    Ok(())
}

/// Encodes `input` into a new buffer of `fmt.encoded_len(input.len())` bytes.
pub fn encode_to_vec<T: Element>(fmt: Format, input: &[T]) -> Result<Vec<u8>, CodecError> {
    check_dtype::<T>(&fmt)?;
    let len = fmt
        .checked_encoded_len(input.len())
        .ok_or(CodecError::TooLarge { n: input.len() })?;
    let mut out = vec![0u8; len];
    encode(fmt, input, &mut out)?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// The decoded view of one group: enough to produce each value and its bound.
struct DecodedGroup {
    poisoned: bool,
    lo: f32,
    hi: f32,
    step: f32,
    /// Number of valid spike slots, min(k, L).
    ke: usize,
    spike_pos: [u8; 4],
    spike_val: [f32; 4],
}

fn read_group<T: Element>(fmt: &Format, block: &[u8], j: usize, len: usize) -> DecodedGroup {
    let meta = group_meta(fmt, j);
    let s = T::BYTES;
    let lo = T::read_le(&block[meta.lo..meta.lo + s]).to_f32();
    let hi = T::read_le(&block[meta.hi..meta.hi + s]).to_f32();
    let ke = usize::from(fmt.spikes()).min(len);
    let mut spike_pos = [0u8; 4];
    let mut spike_val = [0f32; 4];
    for slot in 0..ke {
        let off = meta.spike_values + slot * s;
        spike_val[slot] = T::read_le(&block[off..off + s]).to_f32();
        spike_pos[slot] = block[meta.spike_positions + slot];
    }
    DecodedGroup {
        poisoned: lo.is_nan() || hi.is_nan(),
        lo,
        hi,
        step: (hi - lo) / fmt.max_code() as f32,
        ke,
        spike_pos,
        spike_val,
    }
}

impl DecodedGroup {
    /// The spike slot at position `i`, the first matching slot if a corrupt block repeats one.
    fn spike_at(&self, i: usize) -> Option<usize> {
        (0..self.ke).find(|&s| usize::from(self.spike_pos[s]) == i)
    }
}

/// Decodes one block into f32 values (`out.len()` = the block's value count). Values of poisoned
/// groups are NaN.
fn decode_block_f32<T: Element>(fmt: &Format, block: &[u8], out: &mut [f32]) {
    let nv = out.len();
    let mut codes = [0u8; BLOCK_VALUES];
    unpack_planes(fmt, block, &mut codes[..nv]);
    let g = usize::from(fmt.group());
    for (j, (vals, cs)) in out.chunks_mut(g).zip(codes.chunks(g)).enumerate() {
        let grp = read_group::<T>(fmt, block, j, vals.len());
        if grp.poisoned {
            vals.fill(f32::NAN);
            continue;
        }
        for (v, &q) in vals.iter_mut().zip(cs) {
            let m = f32::from(q) * grp.step;
            *v = grp.lo + m;
        }
        // Later slots first, so the first slot wins on a repeated position.
        for slot in (0..grp.ke).rev() {
            if let Some(v) = vals.get_mut(usize::from(grp.spike_pos[slot])) {
                *v = grp.spike_val[slot];
            }
        }
    }
}

/// Runs `f` on each block of a validated buffer with the f32 decoded values of that block.
fn for_each_decoded_block<T: Element>(
    fmt: &Format,
    input: &[u8],
    n: usize,
    mut f: impl FnMut(usize, &[f32]),
) {
    let bb = fmt.block_bytes();
    let mut scratch = [0f32; BLOCK_VALUES];
    for (b, block) in input.chunks_exact(bb).enumerate() {
        let nv = Format::block_values(n, b);
        decode_block_f32::<T>(fmt, block, &mut scratch[..nv]);
        f(b * BLOCK_VALUES, &scratch[..nv]);
    }
}

/// Decodes `n` values from `input` (exactly `fmt.encoded_len(n)` bytes) into `out` (`n` values),
/// rounding each f32 decoded value to `T` (nearest, ties to even). Checks every header first; on
/// error `out` is unchanged.
pub fn decode<T: Element>(
    fmt: Format,
    input: &[u8],
    n: usize,
    out: &mut [T],
) -> Result<(), CodecError> {
    check_decode_args::<T>(&fmt, input, n, out.len())?;
    for_each_decoded_block::<T>(&fmt, input, n, |start, vals| {
        for (o, &v) in out[start..start + vals.len()].iter_mut().zip(vals) {
            *o = T::from_f32(v);
        }
    });
    Ok(())
}

/// Decodes `n` values to their f32 decoded values (before rounding to the element type), as
/// [`decode_accumulate`] adds them. Poisoned groups give NaN.
pub fn decode_f32<T: Element>(
    fmt: Format,
    input: &[u8],
    n: usize,
    out: &mut [f32],
) -> Result<(), CodecError> {
    check_decode_args::<T>(&fmt, input, n, out.len())?;
    for_each_decoded_block::<T>(&fmt, input, n, |start, vals| {
        out[start..start + vals.len()].copy_from_slice(vals);
    });
    Ok(())
}

/// Decodes `n` values and adds each f32 decoded value into `acc` (`acc = acc + v`, one f32
/// addition per value). Checks every header first; on error `acc` is unchanged.
pub fn decode_accumulate<T: Element>(
    fmt: Format,
    input: &[u8],
    n: usize,
    acc: &mut [f32],
) -> Result<(), CodecError> {
    check_decode_args::<T>(&fmt, input, n, acc.len())?;
    for_each_decoded_block::<T>(&fmt, input, n, |start, vals| {
        for (a, &v) in acc[start..start + vals.len()].iter_mut().zip(vals) {
            *a += v;
        }
    });
    Ok(())
}

/// The fused reduce step: decodes the `N = inputs.len()` encodings of `n` values each (format
/// `fmt_in`), accumulates in f32 in input order (`acc = v_0`, then `acc = acc + v_i` for
/// i = 1..N-1), rounds `acc` to `T` and encodes the result with `fmt_out` into `out`
/// (`fmt_out.encoded_len(n)` bytes). Both formats must be for `T`.
pub fn reduce_requantize<T: Element>(
    fmt_in: Format,
    inputs: &[&[u8]],
    n: usize,
    fmt_out: Format,
    out: &mut [u8],
) -> Result<(), CodecError> {
    check_dtype::<T>(&fmt_in)?;
    check_dtype::<T>(&fmt_out)?;
    if inputs.is_empty() {
        return Err(CodecError::NoInputs);
    }
    for input in inputs {
        check_encoded_len(&fmt_in, n, input.len())?;
        check_headers(&fmt_in, input, n)?;
    }
    check_encoded_len(&fmt_out, n, out.len())?;
    let bb_in = fmt_in.block_bytes();
    let bb_out = fmt_out.block_bytes();
    let mut acc = [0f32; BLOCK_VALUES];
    let mut vals = [0f32; BLOCK_VALUES];
    let mut rounded = [T::default(); BLOCK_VALUES];
    for (b, block_out) in out.chunks_exact_mut(bb_out).enumerate() {
        let nv = Format::block_values(n, b);
        let range = b * bb_in..(b + 1) * bb_in;
        decode_block_f32::<T>(&fmt_in, &inputs[0][range.clone()], &mut acc[..nv]);
        for input in &inputs[1..] {
            decode_block_f32::<T>(&fmt_in, &input[range.clone()], &mut vals[..nv]);
            for (a, &v) in acc[..nv].iter_mut().zip(&vals[..nv]) {
                *a += v;
            }
        }
        for (r, &a) in rounded[..nv].iter_mut().zip(&acc[..nv]) {
            *r = T::from_f32(a);
        }
        encode_block(&fmt_out, &rounded[..nv], block_out);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Error bound

/// Per-element bound on `|v - x|` for the f32 decoded values `v` of one block.
fn bound_block_f32<T: Element>(fmt: &Format, block: &[u8], out: &mut [f64]) {
    let g = usize::from(fmt.group());
    let floor = tiny_step_floor(fmt.bits());
    for (j, vals) in out.chunks_mut(g).enumerate() {
        let grp = read_group::<T>(fmt, block, j, vals.len());
        if grp.poisoned {
            vals.fill(f64::NAN);
            continue;
        }
        let big = f64::from(grp.lo.abs().max(grp.hi.abs()));
        let b = f64::from(grp.step) * (0.5 + 2f64.powi(-10)) + 4.0 * ulp_f32(big) + floor;
        for (i, v) in vals.iter_mut().enumerate() {
            *v = if grp.spike_at(i).is_some() { 0.0 } else { b };
        }
    }
}

/// Per-element error bound of the f32 decoded values (as [`decode_f32`] and
/// [`decode_accumulate`] produce them): for every value that is neither a spike nor in a poisoned
/// group, `|v - x| <= step * (0.5 + 2^-10) + 4 * ulp_f32(max(|lo|, |hi|)) + 2^(b - 126)`; 0 for
/// spikes; NaN for values of poisoned groups (which decode to NaN).
pub fn error_bound_f32<T: Element>(
    fmt: Format,
    input: &[u8],
    n: usize,
    out: &mut [f64],
) -> Result<(), CodecError> {
    check_decode_args::<T>(&fmt, input, n, out.len())?;
    let bb = fmt.block_bytes();
    for (b, block) in input.chunks_exact(bb).enumerate() {
        let nv = Format::block_values(n, b);
        let start = b * BLOCK_VALUES;
        bound_block_f32::<T>(&fmt, block, &mut out[start..start + nv]);
    }
    Ok(())
}

/// Per-element error bound of the values [`decode`] produces: the f32 bound of
/// [`error_bound_f32`] plus half an ulp of `T` at the f32 decoded value (infinite where that
/// rounding overflows); 0 for spikes, NaN for values of poisoned groups.
pub fn error_bound<T: Element>(
    fmt: Format,
    input: &[u8],
    n: usize,
    out: &mut [f64],
) -> Result<(), CodecError> {
    error_bound_f32::<T>(fmt, input, n, out)?;
    let rounding_free = T::DTYPE == DType::F32;
    for_each_decoded_block::<T>(&fmt, input, n, |start, vals| {
        for (o, &v) in out[start..start + vals.len()].iter_mut().zip(vals) {
            if *o > 0.0 && !rounding_free {
                *o += 0.5 * T::ulp_at(f64::from(v));
            }
        }
    });
    Ok(())
}
