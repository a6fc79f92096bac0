//! Prints the error of the quantized AllReduce of the CPU reference codec against the exact sum,
//! for every width at the default group and spikes (what `ci/demo.sh` shows on a machine
//! without a GPU).
//!
//! `cargo run -p flashcomm-codec --example error_table [RANKS [VALUES]]`

fn main() {
    let mut args = std::env::args().skip(1);
    let ranks = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let values = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 16);
    print!("{}", flashcomm_codec::error_table_markdown(ranks, values));
}
