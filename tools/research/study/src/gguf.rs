//! A reader for GGUF version 3 files: the metadata key/value store, the tensor directory and the
//! aligned tensor data.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type: u32, value)
//! tensor_count × (name: string, n_dims: u32, dims: n_dims × u64, ggml_type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor starts at data_start + offset (offset a multiple of the alignment)
//! ```
//!
//! A string is a u64 byte length followed by UTF-8 bytes. An array value is an element type (u32),
//! a count (u64) and the elements. `dims[0]` is the fastest-varying dimension, so a weight matrix
//! with `dims = [in, out]` is stored as `out` rows of `in` values.

use std::collections::BTreeMap;

/// Errors raised while parsing a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    /// The file does not start with the `GGUF` magic.
    #[error("not a GGUF file (bad magic)")]
    BadMagic,
    /// Only version 3 is read.
    #[error("unsupported GGUF version {0}")]
    UnsupportedVersion(u32),
    /// The file ends before a field that should be there.
    #[error("file truncated while reading {what} at byte {offset}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Byte offset of the read.
        offset: usize,
    },
    /// A metadata value type outside the specification.
    #[error("unknown metadata value type {0}")]
    BadValueType(u32),
    /// A string that is not valid UTF-8.
    #[error("string at byte {0} is not UTF-8")]
    BadString(usize),
    /// A structural inconsistency (bad alignment, tensor out of bounds, ...).
    #[error("invalid GGUF: {0}")]
    Invalid(String),
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `u8` (type 0).
    U8(u8),
    /// `i8` (type 1).
    I8(i8),
    /// `u16` (type 2).
    U16(u16),
    /// `i16` (type 3).
    I16(i16),
    /// `u32` (type 4).
    U32(u32),
    /// `i32` (type 5).
    I32(i32),
    /// `f32` (type 6).
    F32(f32),
    /// `bool` (type 7), one byte.
    Bool(bool),
    /// UTF-8 string (type 8).
    String(String),
    /// Homogeneous array (type 9).
    Array(Vec<Value>),
    /// `u64` (type 10).
    U64(u64),
    /// `i64` (type 11).
    I64(i64),
    /// `f64` (type 12).
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a float.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice, when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array, when it is one.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The ggml element types this crate knows by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE half.
    F16,
    /// 4-bit, blocks of 32 with an f16 scale and an f16 minimum.
    Q4_1,
    /// 8-bit, blocks of 32 with an f16 scale.
    Q8_0,
    /// Any other type, by its number.
    Other(u32),
}

impl GgmlType {
    /// Maps a ggml type number.
    pub fn from_u32(v: u32) -> GgmlType {
        match v {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            o => GgmlType::Other(o),
        }
    }

    /// The type number written in the file.
    pub fn to_u32(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Other(o) => o,
        }
    }

    /// Values per block and bytes per block, for the types whose size is known.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 => Some((1, 2)),
            GgmlType::Q4_1 => Some((32, 20)),
            GgmlType::Q8_0 => Some((32, 34)),
            GgmlType::Other(_) => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, fastest-varying first.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Size of the data in bytes, when the type's layout is known.
    pub fn n_bytes(&self) -> Option<u64> {
        let (per_block, bytes) = self.ty.block_layout()?;
        let n = self.n_elements();
        let per_block = per_block as u64;
        if !n.is_multiple_of(per_block) {
            return None;
        }
        Some(n / per_block * bytes as u64)
    }
}

/// A parsed GGUF file that owns its bytes.
#[derive(Debug, Clone)]
pub struct Gguf {
    /// Format version (always 3 here).
    pub version: u32,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor directory, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of every tensor.
    pub alignment: usize,
    /// Byte offset of the data section in the file.
    pub data_offset: usize,
    bytes: Vec<u8>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(GgufError::Truncated {
                what,
                offset: self.pos,
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn len(&mut self, what: &'static str) -> Result<usize, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        // Every element of a length-prefixed item takes at least one byte, so a length beyond
        // the remaining bytes is corrupt; rejecting it here avoids huge allocations.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or(GgufError::Truncated { what, offset: at })
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let n = self.len(what)?;
        let at = self.pos;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::BadString(at))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        const W: &str = "metadata value";
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array(W)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(W)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(W)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(W)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(W)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(W)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(W)?)),
            7 => Value::Bool(self.array::<1>(W)?[0] != 0),
            8 => Value::String(self.string(W)?),
            9 => {
                if depth > 4 {
                    return Err(GgufError::Invalid("arrays nested too deep".into()));
                }
                let elem = self.u32("array element type")?;
                let n = self.len("array length")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(W)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(W)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(W)?)),
            t => return Err(GgufError::BadValueType(t)),
        })
    }
}

impl Gguf {
    /// Parses a whole GGUF file held in memory.
    pub fn parse(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        let mut r = Reader {
            buf: &bytes,
            pos: 0,
        };
        if r.take(4, "magic")? != b"GGUF" {
            return Err(GgufError::BadMagic);
        }
        let version = r.u32("version")?;
        if version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.len("tensor count")?;
        let n_kv = r.len("metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor rank")?;
            if n_dims == 0 || n_dims > 4 {
                return Err(GgufError::Invalid(format!(
                    "tensor {name} has rank {n_dims}"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dimension")?);
            }
            let ty = GgmlType::from_u32(r.u32("tensor type")?);
            let offset = r.u64("tensor offset")?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .and_then(|a| usize::try_from(a).ok())
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| {
                    GgufError::Invalid("general.alignment is not a power of two".into())
                })?,
        };
        let data_offset = r.pos.div_ceil(alignment) * alignment;
        let gguf = Gguf {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            bytes,
        };
        for t in &gguf.tensors {
            gguf.tensor_bytes(t)?;
        }
        Ok(gguf)
    }

    /// Reads and parses a GGUF file.
    pub fn open(path: &std::path::Path) -> Result<Gguf, Box<dyn std::error::Error>> {
        let bytes = std::fs::read(path)?;
        Ok(Gguf::parse(bytes)?)
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A tensor directory entry by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor's data (checked against the file's bounds and alignment).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<&[u8], GgufError> {
        let n = t.n_bytes().ok_or_else(|| {
            GgufError::Invalid(format!("tensor {} has an unsized type {:?}", t.name, t.ty))
        })?;
        if !t.offset.is_multiple_of(self.alignment as u64) {
            return Err(GgufError::Invalid(format!(
                "tensor {} is misaligned",
                t.name
            )));
        }
        let start = (self.data_offset as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(n));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => {
                Ok(&self.bytes[s as usize..e as usize])
            }
            _ => Err(GgufError::Invalid(format!(
                "tensor {} lies outside the file",
                t.name
            ))),
        }
    }
}

/// Builds GGUF files in memory; used by the tests to make small synthetic files.
#[derive(Debug, Default)]
pub struct Writer {
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    alignment: usize,
}

impl Writer {
    /// An empty file with the given data alignment (a power of two).
    pub fn new(alignment: usize) -> Writer {
        Writer {
            alignment,
            ..Writer::default()
        }
    }

    fn encode(out: &mut Vec<u8>, v: &Value) -> u32 {
        match v {
            Value::U8(x) => {
                out.extend(x.to_le_bytes());
                0
            }
            Value::I8(x) => {
                out.extend(x.to_le_bytes());
                1
            }
            Value::U16(x) => {
                out.extend(x.to_le_bytes());
                2
            }
            Value::I16(x) => {
                out.extend(x.to_le_bytes());
                3
            }
            Value::U32(x) => {
                out.extend(x.to_le_bytes());
                4
            }
            Value::I32(x) => {
                out.extend(x.to_le_bytes());
                5
            }
            Value::F32(x) => {
                out.extend(x.to_le_bytes());
                6
            }
            Value::Bool(x) => {
                out.push(u8::from(*x));
                7
            }
            Value::String(s) => {
                out.extend((s.len() as u64).to_le_bytes());
                out.extend(s.as_bytes());
                8
            }
            Value::Array(a) => {
                let mut body = Vec::new();
                let mut elem = 4;
                for x in a {
                    elem = Writer::encode(&mut body, x);
                }
                out.extend(elem.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                out.extend(body);
                9
            }
            Value::U64(x) => {
                out.extend(x.to_le_bytes());
                10
            }
            Value::I64(x) => {
                out.extend(x.to_le_bytes());
                11
            }
            Value::F64(x) => {
                out.extend(x.to_le_bytes());
                12
            }
        }
    }

    /// Adds a metadata entry.
    pub fn kv(&mut self, key: &str, v: Value) -> &mut Writer {
        let mut body = Vec::new();
        let ty = Writer::encode(&mut body, &v);
        self.kv.push((key.to_string(), ty, body));
        self
    }

    /// Adds a tensor with its raw data.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Writer {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// Serializes the file.
    pub fn finish(&self) -> Vec<u8> {
        let a = self.alignment;
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, ty, body) in &self.kv {
            out.extend((k.len() as u64).to_le_bytes());
            out.extend(k.as_bytes());
            out.extend(ty.to_le_bytes());
            out.extend(body);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            out.extend((name.len() as u64).to_le_bytes());
            out.extend(name.as_bytes());
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_u32().to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(a as u64) * a as u64;
        }
        out.resize(out.len().div_ceil(a) * a, 0);
        let base = out.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(base + off as usize, 0);
            out.extend(data);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A file assembled byte by byte: one u32 and one string-array key, one F32 tensor.
    #[test]
    fn parses_hand_assembled_file() {
        let mut f = Vec::new();
        f.extend(b"GGUF");
        f.extend(3u32.to_le_bytes());
        f.extend(1u64.to_le_bytes()); // tensors
        f.extend(2u64.to_le_bytes()); // kv
        string(&mut f, "llama.block_count");
        f.extend(4u32.to_le_bytes()); // u32
        f.extend(30u32.to_le_bytes());
        string(&mut f, "tokenizer.ggml.tokens");
        f.extend(9u32.to_le_bytes()); // array
        f.extend(8u32.to_le_bytes()); // of strings
        f.extend(2u64.to_le_bytes());
        string(&mut f, "a");
        string(&mut f, "Ġb");
        string(&mut f, "norm.weight");
        f.extend(1u32.to_le_bytes());
        f.extend(3u64.to_le_bytes());
        f.extend(0u32.to_le_bytes()); // F32
        f.extend(0u64.to_le_bytes()); // offset
        let header = f.len();
        f.resize(header.div_ceil(32) * 32, 0);
        for v in [1.5f32, -2.0, 0.25] {
            f.extend(v.to_le_bytes());
        }
        let g = Gguf::parse(f).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.alignment, 32);
        assert_eq!(g.data_offset, header.div_ceil(32) * 32);
        assert_eq!(g.get("llama.block_count").unwrap().as_u64(), Some(30));
        let toks = g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
        assert_eq!(toks[1].as_str(), Some("Ġb"));
        let t = g.tensor("norm.weight").unwrap();
        assert_eq!(
            (t.dims.clone(), t.ty, t.n_elements()),
            (vec![3], GgmlType::F32, 3)
        );
        let data: Vec<f32> = g
            .tensor_bytes(t)
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(data, vec![1.5, -2.0, 0.25]);
    }

    #[test]
    fn writer_round_trips_every_value_type_and_alignment() {
        let mut w = Writer::new(64);
        w.kv("general.alignment", Value::U32(64))
            .kv("u8", Value::U8(7))
            .kv("i8", Value::I8(-7))
            .kv("u16", Value::U16(700))
            .kv("i16", Value::I16(-700))
            .kv("i32", Value::I32(-70000))
            .kv("f32", Value::F32(1e-5))
            .kv("bool", Value::Bool(true))
            .kv("u64", Value::U64(1 << 40))
            .kv("i64", Value::I64(-(1 << 40)))
            .kv("f64", Value::F64(0.1))
            .kv("arr", Value::Array(vec![Value::I32(1), Value::I32(-2)]))
            .tensor(
                "a",
                &[2],
                GgmlType::F32,
                [1f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
            .tensor("b", &[32, 1], GgmlType::Q8_0, vec![0u8; 34]);
        let g = Gguf::parse(w.finish()).unwrap();
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_offset % 64, 0);
        assert_eq!(g.get("i8"), Some(&Value::I8(-7)));
        assert_eq!(g.get("i16"), Some(&Value::I16(-700)));
        assert_eq!(g.get("f32").unwrap().as_f64(), Some(f64::from(1e-5f32)));
        assert_eq!(g.get("bool"), Some(&Value::Bool(true)));
        assert_eq!(g.get("i64"), Some(&Value::I64(-(1 << 40))));
        assert_eq!(g.get("u16").unwrap().as_u64(), Some(700));
        assert_eq!(g.get("i32").unwrap().as_u64(), None);
        assert_eq!(
            g.get("arr").unwrap().as_array().unwrap(),
            &[Value::I32(1), Value::I32(-2)]
        );
        let b = g.tensor("b").unwrap();
        assert_eq!(b.offset, 64);
        assert_eq!(g.tensor_bytes(b).unwrap().len(), 34);
    }

    #[test]
    fn rejects_bad_files() {
        assert_eq!(
            Gguf::parse(b"GGUX".to_vec()).unwrap_err(),
            GgufError::BadMagic
        );
        let mut v2 = b"GGUF".to_vec();
        v2.extend(2u32.to_le_bytes());
        assert_eq!(
            Gguf::parse(v2).unwrap_err(),
            GgufError::UnsupportedVersion(2)
        );
        let mut w = Writer::new(32);
        w.kv("k", Value::String("value".into()));
        let bytes = w.finish();
        // Cut inside the value's length (header 24 bytes, key 9, type 4).
        for cut in [20, 40, 45 + 3] {
            let r = Gguf::parse(bytes[..cut].to_vec());
            assert!(
                matches!(r, Err(GgufError::Truncated { .. })),
                "cut at {cut}: {r:?}"
            );
        }
        // A tensor whose data lies beyond the end of the file.
        let mut w = Writer::new(32);
        w.tensor("t", &[4], GgmlType::F32, vec![0u8; 16]);
        let mut bytes = w.finish();
        bytes.truncate(bytes.len() - 4);
        assert!(matches!(Gguf::parse(bytes), Err(GgufError::Invalid(_))));
    }
}
