//! The LLaMA forward pass in `f32`, with the two row-parallel all-reduces of every layer
//! (attention `o_proj` and MLP `down_proj`) simulated at a chosen tensor-parallel degree, and
//! hooks for the expert-parallel all-to-alls around every MLP block (see [`crate::expert`]).
//!
//! Weights come from the GGUF file, dequantized once to `f32`. GGUF's converter stores the rows of
//! the query and key projections permuted so that rotary embedding rotates *adjacent* pairs
//! `(x[2i], x[2i+1])` of each head by `pos * base^(-2i/d)` (not the two halves of the head), and
//! this forward pass uses that layout.

use crate::gguf::Gguf;
use crate::quant::dequantize;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, Slice};

/// Hyper-parameters of a LLaMA model.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Hidden size.
    pub hidden: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// MLP inner size.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Rotary base.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Vocabulary size.
    pub vocab: usize,
}

impl Config {
    /// Size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// One transformer block's weights; matrices are `[out, in]`.
#[derive(Debug, Clone)]
pub struct Block {
    attn_norm: Vec<f32>,
    /// Query, key and value projections stacked: `[hidden + 2 * kv_dim, hidden]`.
    wqkv: Array2<f32>,
    wo: Array2<f32>,
    ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2 * ffn, hidden]`.
    w_gate_up: Array2<f32>,
    w_down: Array2<f32>,
}

/// A loaded model.
#[derive(Debug, Clone)]
pub struct Model {
    /// Hyper-parameters.
    pub cfg: Config,
    /// Token embedding, `[vocab, hidden]`; also the output projection (tied).
    embed: Array2<f32>,
    blocks: Vec<Block>,
    out_norm: Vec<f32>,
}

/// Which all-reduce of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// After the attention output projection.
    OProj,
    /// After the MLP down projection.
    DownProj,
}

/// Sums the per-rank partial outputs of a row-parallel layer; optionally also moves the MLP
/// block's input and output as expert parallelism's dispatch and combine would.
pub trait AllReduce: Sync {
    /// Number of ranks the inputs are split over.
    fn ranks(&self) -> usize;
    /// Reduces `partials` (one `[tokens * hidden]` row-major buffer per rank) to their sum.
    fn all_reduce(&self, layer: usize, site: Site, partials: &[Vec<f32>]) -> Vec<f32>;
    /// The MLP block's input of `layer` (the normalized hidden states, `[tokens * hidden]`
    /// row-major) as the expert receives it. The input unchanged by default.
    fn dispatch(&self, layer: usize, input: Vec<f32>) -> Vec<f32> {
        let _ = layer;
        input
    }
    /// The MLP block's output of `layer` (`[tokens * hidden]` row-major, after the down
    /// projection's all-reduce) as the token's rank receives it back. The output unchanged by
    /// default.
    fn combine(&self, layer: usize, output: Vec<f32>) -> Vec<f32> {
        let _ = layer;
        output
    }
}

/// Runs `f` on the row-major values of `x` and puts the result back in the same shape.
fn through(x: Array2<f32>, f: impl FnOnce(Vec<f32>) -> Vec<f32>) -> Array2<f32> {
    let dim = x.dim();
    let x = if x.is_standard_layout() {
        x
    } else {
        x.as_standard_layout().into_owned()
    };
    let v = f(x.into_raw_vec_and_offset().0);
    Array2::from_shape_vec(dim, v).expect("the hook keeps the length")
}

fn meta_u(g: &Gguf, key: &str) -> Result<usize, String> {
    g.get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| format!("metadata {key} is missing"))
}

fn meta_f(g: &Gguf, key: &str) -> Result<f32, String> {
    g.get(key)
        .and_then(|v| v.as_f64())
        .map(|v| v as f32)
        .ok_or_else(|| format!("metadata {key} is missing"))
}

/// Dequantizes a tensor and checks its dimensions (fastest-varying first).
fn load(g: &Gguf, name: &str, dims: &[usize]) -> Result<Vec<f32>, String> {
    let t = g
        .tensor(name)
        .ok_or_else(|| format!("tensor {name} is missing"))?;
    let got: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    if got != dims {
        return Err(format!("tensor {name} has dims {got:?}, expected {dims:?}"));
    }
    let bytes = g.tensor_bytes(t).map_err(|e| e.to_string())?;
    dequantize(t.ty, bytes, dims.iter().product()).map_err(|e| format!("{name}: {e}"))
}

fn matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Array2<f32>, String> {
    let v = load(g, name, &[cols, rows])?;
    Array2::from_shape_vec((rows, cols), v).map_err(|e| e.to_string())
}

fn stack(a: Array2<f32>, b: Array2<f32>) -> Array2<f32> {
    ndarray::concatenate(Axis(0), &[a.view(), b.view()]).expect("same number of columns")
}

/// `x · wᵀ` for `x: [t, in]` and `w: [out, in]`.
pub fn matmul_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    x.dot(&w.t())
}

fn rms_norm(x: &Array2<f32>, weight: &[f32], eps: f32) -> Array2<f32> {
    let mut out = x.clone();
    for mut row in out.rows_mut() {
        let ms = row.iter().map(|&v| v * v).sum::<f32>() / row.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
    out
}

/// Applies rotary embedding in place to `heads` heads of `head_dim` starting at column `col0`,
/// rotating adjacent pairs.
fn rope(
    x: &mut Array2<f32>,
    col0: usize,
    heads: usize,
    head_dim: usize,
    cos: &Array2<f32>,
    sin: &Array2<f32>,
) {
    for (t, mut row) in x.rows_mut().into_iter().enumerate() {
        for h in 0..heads {
            let base = col0 + h * head_dim;
            for i in 0..head_dim / 2 {
                let (c, sn) = (cos[[t, i]], sin[[t, i]]);
                let a = row[base + 2 * i];
                let b = row[base + 2 * i + 1];
                row[base + 2 * i] = a * c - b * sn;
                row[base + 2 * i + 1] = a * sn + b * c;
            }
        }
    }
}

/// Splits `0..n` into `parts` contiguous slices as evenly as possible.
pub fn split_range(n: usize, parts: usize, k: usize) -> std::ops::Range<usize> {
    let lo = n * k / parts;
    let hi = n * (k + 1) / parts;
    lo..hi
}

/// Columns `r` of a matrix (a view).
pub fn cols(x: &Array2<f32>, r: std::ops::Range<usize>) -> ArrayView2<'_, f32> {
    x.slice_axis(Axis(1), Slice::from(r))
}

fn cols_mut(x: &mut Array2<f32>, r: std::ops::Range<usize>) -> ArrayViewMut2<'_, f32> {
    x.slice_axis_mut(Axis(1), Slice::from(r))
}

/// Rows `r` of a matrix (a view).
pub fn rows(x: &Array2<f32>, r: std::ops::Range<usize>) -> ArrayView2<'_, f32> {
    x.slice_axis(Axis(0), Slice::from(r))
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl Model {
    /// Loads a LLaMA-architecture GGUF model, dequantizing every weight to `f32`.
    pub fn from_gguf(g: &Gguf) -> Result<Model, String> {
        let arch = g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or("general.architecture is missing")?;
        if arch != "llama" {
            return Err(format!("architecture {arch} is not llama"));
        }
        let hidden = meta_u(g, "llama.embedding_length")?;
        let heads = meta_u(g, "llama.attention.head_count")?;
        let kv_heads = meta_u(g, "llama.attention.head_count_kv")?;
        let vocab = g
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or("token_embd.weight is missing")? as usize;
        let cfg = Config {
            hidden,
            layers: meta_u(g, "llama.block_count")?,
            ffn: meta_u(g, "llama.feed_forward_length")?,
            heads,
            kv_heads,
            rope_base: meta_f(g, "llama.rope.freq_base").unwrap_or(10000.0),
            eps: meta_f(g, "llama.attention.layer_norm_rms_epsilon")?,
            vocab,
        };
        if hidden % heads != 0 || heads % kv_heads != 0 {
            return Err("head counts do not divide the hidden size".into());
        }
        let kv_dim = kv_heads * cfg.head_dim();
        let embed = matrix(g, "token_embd.weight", vocab, hidden)?;
        if g.tensor("output.weight").is_some() {
            return Err("an untied output.weight is not supported".into());
        }
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = |n: &str| format!("blk.{l}.{n}.weight");
            let wq = matrix(g, &p("attn_q"), hidden, hidden)?;
            let wk = matrix(g, &p("attn_k"), kv_dim, hidden)?;
            let wv = matrix(g, &p("attn_v"), kv_dim, hidden)?;
            let wgate = matrix(g, &p("ffn_gate"), cfg.ffn, hidden)?;
            let wup = matrix(g, &p("ffn_up"), cfg.ffn, hidden)?;
            blocks.push(Block {
                attn_norm: load(g, &p("attn_norm"), &[hidden])?,
                wqkv: stack(stack(wq, wk), wv),
                wo: matrix(g, &p("attn_output"), hidden, hidden)?,
                ffn_norm: load(g, &p("ffn_norm"), &[hidden])?,
                w_gate_up: stack(wgate, wup),
                w_down: matrix(g, &p("ffn_down"), hidden, cfg.ffn)?,
            });
        }
        Ok(Model {
            out_norm: load(g, "output_norm.weight", &[hidden])?,
            cfg,
            embed,
            blocks,
        })
    }

    /// A row-parallel layer: every rank multiplies its contiguous slice of the input columns by
    /// the matching slice of the weight's input dimension, and the partial sums are all-reduced.
    fn row_parallel(
        &self,
        x: &Array2<f32>,
        w: &Array2<f32>,
        layer: usize,
        site: Site,
        ar: &dyn AllReduce,
    ) -> Array2<f32> {
        let n = ar.ranks();
        let (t, k_in) = x.dim();
        let partials: Vec<Vec<f32>> = (0..n)
            .map(|k| {
                let r = split_range(k_in, n, k);
                let p = matmul_t(cols(x, r.clone()), cols(w, r));
                p.into_raw_vec_and_offset().0
            })
            .collect();
        let sum = ar.all_reduce(layer, site, &partials);
        Array2::from_shape_vec((t, w.nrows()), sum).expect("all-reduce keeps the length")
    }

    /// Runs the blocks over one sequence (positions `0..tokens.len()`, causal attention) and
    /// returns the final normalized hidden states `[tokens, hidden]`.
    pub fn hidden_states(&self, tokens: &[u32], ar: &dyn AllReduce) -> Array2<f32> {
        let c = &self.cfg;
        let t = tokens.len();
        let hd = c.head_dim();
        let kv_dim = c.kv_heads * hd;
        let group = c.heads / c.kv_heads;
        let mut x = Array2::<f32>::zeros((t, c.hidden));
        for (mut row, &id) in x.rows_mut().into_iter().zip(tokens) {
            row.assign(&self.embed.row(id as usize));
        }
        let mut cos = Array2::<f32>::zeros((t, hd / 2));
        let mut sin = Array2::<f32>::zeros((t, hd / 2));
        for p in 0..t {
            for i in 0..hd / 2 {
                let theta = (p as f64) * (c.rope_base as f64).powf(-2.0 * i as f64 / hd as f64);
                cos[[p, i]] = theta.cos() as f32;
                sin[[p, i]] = theta.sin() as f32;
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, b) in self.blocks.iter().enumerate() {
            // Attention.
            let h = rms_norm(&x, &b.attn_norm, c.eps);
            let mut qkv = matmul_t(h.view(), b.wqkv.view());
            rope(&mut qkv, 0, c.heads, hd, &cos, &sin);
            rope(&mut qkv, c.hidden, c.kv_heads, hd, &cos, &sin);
            let mut attn = Array2::<f32>::zeros((t, c.hidden));
            for head in 0..c.heads {
                let kvh = head / group;
                let q = cols(&qkv, head * hd..(head + 1) * hd);
                let k0 = c.hidden + kvh * hd;
                let v0 = c.hidden + kv_dim + kvh * hd;
                let k = cols(&qkv, k0..k0 + hd);
                let v = cols(&qkv, v0..v0 + hd);
                let mut scores = q.dot(&k.t());
                for (i, mut row) in scores.rows_mut().into_iter().enumerate() {
                    let (live, masked) = row
                        .as_slice_mut()
                        .expect("rows are contiguous")
                        .split_at_mut(i + 1);
                    let m = live
                        .iter()
                        .fold(f32::NEG_INFINITY, |a, &v| a.max(v * scale));
                    let mut sum = 0.0f32;
                    for v in live.iter_mut() {
                        *v = (*v * scale - m).exp();
                        sum += *v;
                    }
                    let inv = 1.0 / sum;
                    live.iter_mut().for_each(|v| *v *= inv);
                    masked.fill(0.0);
                }
                cols_mut(&mut attn, head * hd..(head + 1) * hd).assign(&scores.dot(&v));
            }
            x += &self.row_parallel(&attn, &b.wo, l, Site::OProj, ar);
            // MLP (in expert parallelism: dispatch, the expert, combine).
            let h = rms_norm(&x, &b.ffn_norm, c.eps);
            let h = through(h, |v| ar.dispatch(l, v));
            let gu = matmul_t(h.view(), b.w_gate_up.view());
            let mut act = cols(&gu, 0..c.ffn).to_owned();
            act.zip_mut_with(&cols(&gu, c.ffn..2 * c.ffn), |g, &u| *g = silu(*g) * u);
            let y = self.row_parallel(&act, &b.w_down, l, Site::DownProj, ar);
            x += &through(y, |v| ar.combine(l, v));
        }
        rms_norm(&x, &self.out_norm, c.eps)
    }

    /// Logits `[rows, vocab]` of some final hidden states.
    pub fn logits(&self, hidden: ArrayView2<'_, f32>) -> Array2<f32> {
        matmul_t(hidden, self.embed.view())
    }

    /// Sum of the negative log-likelihoods of `tokens[1..]` given their prefixes, and their
    /// count.
    pub fn nll(&self, tokens: &[u32], ar: &dyn AllReduce) -> (f64, usize) {
        let h = self.hidden_states(tokens, ar);
        let t = tokens.len();
        let mut total = 0.0f64;
        const CHUNK: usize = 128;
        let mut start = 0;
        while start + 1 < t {
            let end = (start + CHUNK).min(t - 1);
            let logits = self.logits(rows(&h, start..end));
            for (i, row) in logits.rows().into_iter().enumerate() {
                let target = tokens[start + i + 1] as usize;
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let lse = m as f64
                    + row
                        .iter()
                        .map(|&v| f64::from((v - m).exp()))
                        .sum::<f64>()
                        .ln();
                total += lse - row[target] as f64;
            }
            start = end;
        }
        (total, t.saturating_sub(1))
    }
}
