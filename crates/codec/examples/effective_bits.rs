//! Prints the effective-bits table of `docs/codec.md` (markdown): bits on the wire per value for
//! every width, group size and spike count, for 16-bit and 32-bit inputs.
//!
//! `cargo run -p flashcomm-codec --example effective_bits`

fn main() {
    print!("{}", flashcomm_codec::effective_bits_markdown());
}
