//! Accuracy of the quantized tensor-parallel all-reduce on a real model.
//!
//! The study loads SmolLM2-135M-Instruct from its GGUF file ([`gguf`], [`quant`]), tokenizes
//! WikiText-2 with the model's byte-level BPE ([`tokenizer`]), and runs the LLaMA forward pass in
//! `f32` ([`model`]) with the two row-parallel all-reduces of every layer simulated at TP = N:
//! each rank's partial sum is converted to `bf16` and reduced by the codec's CPU reference,
//! exactly or quantized ([`collective`]). [`study`] turns the mean negative log-likelihood of
//! each setting into a perplexity and compares it with the exact all-reduce. [`rotation`] is an
//! optional randomized Hadamard rotation of the quantization groups around the codec;
//! [`spike_rotation`] takes each group's spikes out before rotating the rest. [`oracle`] bounds
//! what any per-group scalar codec could reach; [`grid`] tries a non-uniform code grid.
//! [`expert`] simulates expert parallelism on the same model: the MLP block's input and output
//! sent through the codec's quantized all-to-all, as dispatch and combine would send them.

#![forbid(unsafe_code)]

pub mod collective;
pub mod expert;
pub mod gguf;
pub mod grid;
pub mod model;
pub mod oracle;
pub mod quant;
pub mod rotation;
pub mod spec;
pub mod spike_rotation;
pub mod study;
pub mod tokenizer;
