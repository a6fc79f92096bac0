//! The model's byte-level BPE tokenizer, built from the GGUF metadata
//! (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
//!
//! Encoding is done in four stages:
//!
//! 0. **Control tokens** (`tokenizer.ggml.token_type` 3, e.g. `<|endoftext|>`, `<|im_start|>`)
//!    written in the text become their own ids, leftmost first and the longest at one place, as
//!    the reference tokenizer's added special tokens do; the text between them goes through the
//!    stages below.
//! 1. **Pre-tokenization**, a hand-written equivalent of SmolLM2's pre-tokenizer: every numeric
//!    character stands alone (individual digits), and the rest is split by the GPT-2 pattern
//!    `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//!    `\p{L}` is Rust's `char::is_alphabetic` (the Unicode *Alphabetic* property, slightly
//!    larger than the letter categories) and `\p{N}` is `char::is_numeric`.
//!
//! Checked against the reference (Hugging Face `tokenizers`, configured as SmolLM2's
//! `tokenizer.json`: Digits with individual digits, then ByteLevel with its regex, BPE over the
//! GGUF's vocabulary and merges, the control tokens as special tokens): the same ids, token
//! for token, for the whole WikiText-2 test file (312,144 tokens) and for a text of Devanagari,
//! Tamil and Thai with combining marks, letter and other numbers, CJK, emoji, no-break and
//! ideographic spaces, tabs and CRLF (docs/accuracy-model.md).
//! 2. **Byte mapping**: every UTF-8 byte becomes one printable character by the GPT-2
//!    byte-to-unicode table (bytes `!`..`~`, `¡`..`¬`, `®`..`ÿ` map to themselves, the other 68
//!    bytes to U+0100.. in increasing order), so that a space is `Ġ` and a newline `Ċ`.
//!    A byte whose character is not in the vocabulary becomes token 0 (the unknown token).
//! 3. **BPE**: starting from single characters, the adjacent pair with the lowest merge rank is
//!    merged (all its occurrences, left to right) until no pair has a rank.

use std::collections::HashMap;

/// A byte-level BPE tokenizer.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
    byte_ids: [u32; 256],
    /// Control tokens matched in the text before pre-tokenization, longest first.
    controls: Vec<(String, u32)>,
}

/// The GPT-2 byte-to-unicode table.
pub fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(c).expect("the table stays below U+0200");
    }
    table
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Number
    } else {
        Class::Other
    }
}

/// Splits text into pre-tokens (see the module documentation). The pieces concatenate to the
/// input.
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    // Individual digits first: numeric characters are pieces of their own.
    let mut seg_start = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            if seg_start < i {
                gpt2_split(&text[seg_start..i], &mut out);
            }
            out.push(&text[i..i + c.len_utf8()]);
            seg_start = i + c.len_utf8();
        }
    }
    if seg_start < text.len() {
        gpt2_split(&text[seg_start..], &mut out);
    }
    out
}

/// The GPT-2 pattern, applied to a segment without numeric characters (numbers are still
/// handled, for completeness).
fn gpt2_split<'a>(seg: &'a str, out: &mut Vec<&'a str>) {
    let chars: Vec<(usize, char)> = seg.char_indices().collect();
    let n = chars.len();
    let byte_at = |k: usize| if k < n { chars[k].0 } else { seg.len() };
    let run = |mut k: usize, cl: Class| {
        while k < n && class(chars[k].1) == cl {
            k += 1;
        }
        k
    };
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        let end = 'm: {
            // 's|'t|'re|'ve|'m|'ll|'d
            if c == '\'' {
                let rest = &seg[byte_at(i + 1)..];
                for suffix in ["s", "t", "re", "ve", "m", "ll", "d"] {
                    if rest.starts_with(suffix) {
                        break 'm i + 1 + suffix.len();
                    }
                }
            }
            let cl = class(c);
            // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
            if cl != Class::Space {
                break 'm run(i, cl);
            }
            if c == ' ' && i + 1 < n {
                let next = class(chars[i + 1].1);
                if next != Class::Space {
                    break 'm run(i + 1, next);
                }
            }
            // '\s+(?!\S)' then '\s+'
            let e = run(i, Class::Space);
            if e == n || e - i == 1 { e } else { e - 1 }
        };
        out.push(&seg[byte_at(i)..byte_at(end)]);
        i = end;
    }
}

impl Tokenizer {
    /// Builds a tokenizer from the vocabulary (token strings in the byte-mapped alphabet, id =
    /// index) and the merges (`"left right"`, rank = index).
    pub fn new(tokens: Vec<String>, merges: &[String]) -> Result<Tokenizer, String> {
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let byte_char = byte_to_unicode();
        let char_byte = byte_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        // Bytes without a token of their own (SmolLM2's vocabulary lacks a few control bytes and
        // the bytes that never occur in UTF-8) become token 0, the unknown token.
        let mut byte_ids = [0u32; 256];
        for (b, c) in byte_char.iter().enumerate() {
            byte_ids[b] = ids.get(&c.to_string()).copied().unwrap_or(0);
        }
        let mut merge_map = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| format!("merge {rank} has no space: {m:?}"))?;
            let (Some(&ia), Some(&ib), Some(&im)) =
                (ids.get(a), ids.get(b), ids.get(&format!("{a}{b}")))
            else {
                return Err(format!("merge {rank} ({m:?}) names an unknown token"));
            };
            merge_map.entry((ia, ib)).or_insert((rank as u32, im));
        }
        Ok(Tokenizer {
            tokens,
            ids,
            merges: merge_map,
            byte_char,
            char_byte,
            byte_ids,
            controls: Vec::new(),
        })
    }

    /// Declares control tokens (by id): written in the text, each becomes its own id instead of
    /// being encoded as text.
    pub fn with_controls(mut self, ids: impl IntoIterator<Item = u32>) -> Tokenizer {
        for id in ids {
            if let Some(t) = self.tokens.get(id as usize)
                && !t.is_empty()
            {
                self.controls.push((t.clone(), id));
            }
        }
        self.controls
            .sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        self
    }

    /// Reads `tokenizer.ggml.tokens`, `tokenizer.ggml.merges` and the control tokens of
    /// `tokenizer.ggml.token_type` (type 3; none when the key is absent) from a GGUF file.
    pub fn from_gguf(g: &crate::gguf::Gguf) -> Result<Tokenizer, String> {
        let strings = |key: &str| -> Result<Vec<String>, String> {
            g.get(key)
                .and_then(|v| v.as_array())
                .ok_or_else(|| format!("{key} is missing"))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| format!("{key} holds a non-string"))
                })
                .collect()
        };
        let controls: Vec<u32> = match g.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .ok_or("tokenizer.ggml.token_type is not an array")?
                .iter()
                .enumerate()
                .filter(|(_, t)| t.as_u64() == Some(3))
                .map(|(i, _)| i as u32)
                .collect(),
        };
        Ok(Tokenizer::new(
            strings("tokenizer.ggml.tokens")?,
            &strings("tokenizer.ggml.merges")?,
        )?
        .with_controls(controls))
    }

    /// The next control token in `text`: its byte offset and index in `controls` (leftmost,
    /// then longest).
    fn next_control(&self, text: &str) -> Option<(usize, usize)> {
        self.controls
            .iter()
            .enumerate()
            .filter_map(|(k, (t, _))| text.find(t.as_str()).map(|at| (at, k)))
            .min()
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The id of a token string written in the byte-mapped alphabet.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// BPE of one pre-token.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<u32> = piece.bytes().map(|b| self.byte_ids[b as usize]).collect();
        loop {
            let best = syms
                .windows(2)
                .filter_map(|w| {
                    self.merges
                        .get(&(w[0], w[1]))
                        .map(|&(rank, m)| (rank, w[0], w[1], m))
                })
                .min_by_key(|&(rank, ..)| rank);
            let Some((_, a, b, merged)) = best else { break };
            let mut next = Vec::with_capacity(syms.len());
            let mut k = 0;
            while k < syms.len() {
                if k + 1 < syms.len() && syms[k] == a && syms[k + 1] == b {
                    next.push(merged);
                    k += 2;
                } else {
                    next.push(syms[k]);
                    k += 1;
                }
            }
            syms = next;
        }
        out.extend(syms);
    }

    /// Encodes text to token ids (no BOS is added: the model's `add_bos_token` is false).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut cache: HashMap<&str, Vec<u32>> = HashMap::new();
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut rest = text;
        while let Some((at, k)) = self.next_control(rest) {
            self.encode_text(&rest[..at], &mut cache, &mut out);
            let (t, id) = &self.controls[k];
            out.push(*id);
            rest = &rest[at + t.len()..];
        }
        self.encode_text(rest, &mut cache, &mut out);
        out
    }

    /// Pre-tokenization and BPE of text without control tokens.
    fn encode_text<'a>(
        &self,
        text: &'a str,
        cache: &mut HashMap<&'a str, Vec<u32>>,
        out: &mut Vec<u32>,
    ) {
        for piece in pre_tokenize(text) {
            if let Some(ids) = cache.get(piece) {
                out.extend_from_slice(ids);
                continue;
            }
            let mut ids = Vec::new();
            self.bpe(piece, &mut ids);
            out.extend_from_slice(&ids);
            cache.insert(piece, ids);
        }
    }

    /// Decodes token ids to text (invalid UTF-8 is replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.tokens.get(id as usize) else {
                continue;
            };
            for c in t.chars() {
                match self.char_byte.get(&c) {
                    Some(&b) => bytes.push(b),
                    None => bytes.extend(c.to_string().as_bytes()),
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The byte-mapped character of a byte.
    pub fn byte_char(&self, b: u8) -> char {
        self.byte_char[b as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_to_unicode();
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xAD], 'Ń');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn pre_tokenizer_follows_the_pattern() {
        let p = pre_tokenize("Hello world's  2024!! \n = x <unk>\n\n");
        assert_eq!(
            p,
            vec![
                "Hello", " world", "'s", "  ", "2", "0", "2", "4", "!!", " \n", " =", " x", " <",
                "unk", ">", "\n\n"
            ]
        );
        assert_eq!(pre_tokenize("a  b"), vec!["a", " ", " b"]);
        assert_eq!(pre_tokenize("a\n b"), vec!["a", "\n", " b"]);
        assert_eq!(pre_tokenize("don't 'tis"), vec!["don", "'t", " '", "tis"]);
        assert_eq!(pre_tokenize("café 3½"), vec!["café", " ", "3", "½"]);
        assert!(pre_tokenize("").is_empty());
    }

    fn tiny() -> Tokenizer {
        let table = byte_to_unicode();
        let mut tokens: Vec<String> = vec!["<unk>".into()];
        tokens.extend(table.iter().filter(|&&c| c != 'Ā').map(|c| c.to_string()));
        for t in ["Ġt", "he", "Ġthe", "Ġa", "ll", "all"] {
            tokens.push(t.into());
        }
        let merges: Vec<String> = ["Ġ t", "h e", "Ġt he", "l l", "a ll", "Ġ a"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        Tokenizer::new(tokens, &merges).unwrap()
    }

    #[test]
    fn bpe_applies_merges_by_rank() {
        let t = tiny();
        let id = |s: &str| t.token_id(s).unwrap();
        assert_eq!(t.encode(" the"), vec![id("Ġthe")]);
        // "Ġ a" has a worse rank than "a ll", so " all" becomes "Ġ" + "all".
        assert_eq!(t.encode(" all"), vec![id("Ġ"), id("all")]);
        assert_eq!(t.encode("the"), vec![id("t"), id("he")]);
        // Byte 0 has no token in this vocabulary: it becomes the unknown token.
        assert_eq!(t.encode("\0a"), vec![0, id("a")]);
        let text = "the hall, all the tea\n";
        assert_eq!(t.decode(&t.encode(text)), text);
    }

    #[test]
    fn control_tokens_are_matched_before_pre_tokenization() {
        let mut tokens: Vec<String> = byte_to_unicode().iter().map(|c| c.to_string()).collect();
        let base = tokens.len() as u32;
        tokens.extend(["<|end|>", "<|end|>x", "<|im|>"].map(String::from));
        let plain = Tokenizer::new(tokens, &[]).unwrap();
        let t = plain.clone().with_controls([base, base + 1, base + 2]);
        let id = |s: &str| plain.token_id(s).unwrap();
        // Without controls declared, the text is encoded byte by byte.
        assert_eq!(plain.encode("a<|im|>").len(), 7);
        assert_eq!(t.encode("a<|im|>"), vec![id("a"), base + 2]);
        // Leftmost first, then the longest at that place; text around them is plain.
        assert_eq!(
            t.encode("<|end|>xy <|end|><|im|>"),
            vec![base + 1, id("y"), id("Ġ"), base, base + 2]
        );
        assert_eq!(t.encode("<|en"), plain.encode("<|en"));
        let text = "x<|end|> y";
        assert_eq!(t.decode(&t.encode(text)), text);
    }
}
