//! The seeded generator the data sets draw from: the tree's one generator, shared with the
//! codec's tests and the benchmark.

pub use flashcomm_codec::rng::Rng;
