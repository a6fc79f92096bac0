// The flashcomm codec on the GPU, bit for bit the CPU reference (crates/codec, docs/codec.md).
//
// Organisation
// ------------
// One warp encodes or decodes one block of 1024 values. Lane l owns values 32l .. 32l+31, so a
// group of g values spans g/32 lanes (lanes_per_group = 1, 2, 4, 8) and every lane lies in exactly
// one group. A lane reads or writes its part of each bit plane with one vector access of 4u bytes
// (u = unit width: 4, 8, 16 or 32 bytes), and the per-group metadata is written by the first lane
// of the group. Widths are template parameters (dispatch 2..8 with a switch, see codec.cu); group
// size and spike count are run-time values; the element type is a template (float, __half,
// __nv_bfloat16).
//
// Values in registers
// -------------------
// A lane holds its 32 input values in the element type's own bits, `Vals<T>::w`:
//   f32      : w[i] = bits of value i (32 words)
//   f16/bf16 : w[j] = value 2j in bits 0..15, value 2j+1 in bits 16..31 (16 words)
// Decoded values come out as 32 f32 per lane (`float v[32]`, v[i] = value 32*lane + i).
//
// Arithmetic
// ----------
// IEEE binary32 with explicit round-to-nearest intrinsics (__fsub_rn, __fmul_rn, __fadd_rn,
// __fdiv_rn), no contraction (the build also passes -fmad=false), no flushing of subnormals.
// Rounding of a code is done by adding 2^23 (exact round-half-even of t in [0, 2^23)). Conversions
// to f16/bf16 are round-to-nearest-even (__float2half_rn / __float2bfloat16_rn and their packed
// forms); NaN results of decode are the canonical NaN of the type.
//
// Encoding strategy
// -----------------
// Spike selection and the range need, per group, the k/2+1 smallest and largest values (k = spike
// count) and the first index of some of them (ties go to the lowest index; -0 ties +0). The fast
// path computes per-lane top-m lists of values with min/max networks (packed bf16x2 / half2 min and
// max for 16-bit types), merges them across the lanes of the group with shuffles, and finds the
// spike positions with one equality-mask pass per searched value. It is exact whenever the m-th
// smallest value is strictly below the m-th largest, none of those values is zero (so that equal
// values have equal bits), the group is full, has no NaN, is not poisoned and 1/step is finite.
// Any warp with a group outside these conditions (tail blocks, constant or nearly constant groups,
// zeros at the extremes, NaN/inf, tiny ranges) runs the general path, which repeats the reference's
// selection literally with per-lane scans and lexicographic (value, index) shuffle reductions.
//
// The tag word
// ------------
// Bytes 0..3 of every block header (`tag`) belong to the transport: the self-synchronizing
// protocols write the readiness tag there after the rest of the block is in place and the receiver
// clears it. The encoder writes it only as 0, and only when asked to (HeaderMode::kZeroTag, for
// plain buffers that are written for the first time). Encoding into a transport frame must use
// HeaderMode::kKeepTag, which writes bytes 4..15 of the header and leaves the tag alone. Decoders
// never read it (check_header looks at bytes 4..15 only).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

// Benchmark-only ablation switches (cuda/bench/codec_ablation.cu, ci/codec-ablation.sh): each
// removes one part of the work to measure what it costs, and makes the results WRONG. The library
// build never sets them. Bits: 1 encode without the range/spike plan (a fixed range), 2 encode
// without the code arithmetic, 4 decode without writing the spikes, 8 decode without the range
// arithmetic (the codes' bit patterns as values), 16 decode without extracting codes.
#ifndef FC_CODEC_ABLATE
#define FC_CODEC_ABLATE 0
#endif

namespace fc {
namespace codec {

constexpr uint32_t kBlockValues = 1024;
constexpr uint32_t kHeaderBytes = 16;
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr float kMagic = 8388608.0f;  // 2^23
constexpr uint32_t kMagicBits = 0x4B000000u;

// ============================================================================ element types ====

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr uint32_t kBytes = 4;
  static constexpr uint32_t kCode = 0;
  static constexpr uint32_t kNanBits = 0x7FC00000u;
  static constexpr int kWords = 32;  // u32 words per lane for 32 values
  __device__ static __forceinline__ float value(const uint32_t* w, int i) { return __uint_as_float(w[i]); }
  __device__ static __forceinline__ uint32_t bits(const uint32_t* w, int i) { return w[i]; }
  // Bits of an f32 value that is exactly representable in T (not NaN).
  __device__ static __forceinline__ uint32_t exact_bits(float v) { return __float_as_uint(v); }
  __device__ static __forceinline__ float from_bits(uint32_t b) { return __uint_as_float(b); }
  // Round to nearest even; NaN -> canonical NaN.
  __device__ static __forceinline__ uint32_t round_bits(float v) { return isnan(v) ? kNanBits : __float_as_uint(v); }
};

template <>
struct Elem<__half> {
  static constexpr uint32_t kBytes = 2;
  static constexpr uint32_t kCode = 1;
  static constexpr uint32_t kNanBits = 0x7E00u;
  static constexpr int kWords = 16;
  __device__ static __forceinline__ float from_bits(uint32_t b) {
    return __half2float(__ushort_as_half((unsigned short)(b & 0xffffu)));
  }
  __device__ static __forceinline__ float value(const uint32_t* w, int i) {
    return from_bits((i & 1) ? (w[i >> 1] >> 16) : w[i >> 1]);
  }
  __device__ static __forceinline__ uint32_t bits(const uint32_t* w, int i) {
    return (i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffffu);
  }
  __device__ static __forceinline__ uint32_t exact_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }
  __device__ static __forceinline__ uint32_t round_bits(float v) {
    return isnan(v) ? kNanBits : (uint32_t)__half_as_ushort(__float2half_rn(v));
  }
  __device__ static __forceinline__ uint32_t round_pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr uint32_t kBytes = 2;
  static constexpr uint32_t kCode = 2;
  static constexpr uint32_t kNanBits = 0x7FC0u;
  static constexpr int kWords = 16;
  __device__ static __forceinline__ float from_bits(uint32_t b) { return __uint_as_float(b << 16); }
  __device__ static __forceinline__ float value(const uint32_t* w, int i) {
    return (i & 1) ? __uint_as_float(w[i >> 1] & 0xffff0000u) : __uint_as_float(w[i >> 1] << 16);
  }
  __device__ static __forceinline__ uint32_t bits(const uint32_t* w, int i) {
    return (i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffffu);
  }
  __device__ static __forceinline__ uint32_t exact_bits(float v) { return __float_as_uint(v) >> 16; }
  __device__ static __forceinline__ uint32_t round_bits(float v) {
    return isnan(v) ? kNanBits : (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  __device__ static __forceinline__ uint32_t round_pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// A lane's 32 values in the element type's bits (see the file comment).
template <typename T>
struct Vals {
  uint32_t w[Elem<T>::kWords];
};

// Rounds 32 f32 values to T (nearest even) into a lane's Vals. NaN bits are not canonicalized
// here (the encoder poisons any group with a NaN, whatever its bits).
template <typename T>
__device__ __forceinline__ void round_to_vals(const float (&v)[32], Vals<T>& out) {
  if constexpr (Elem<T>::kWords == 32) {
#pragma unroll
    for (int i = 0; i < 32; ++i) out.w[i] = __float_as_uint(v[i]);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) out.w[j] = Elem<T>::round_pack(v[2 * j], v[2 * j + 1]);
  }
}

// ============================================================================== bit planes ====

// Unit widths of a code of B bits, most significant first, and the shift of each unit in q.
template <int B>
struct Units {
  static_assert(B >= 2 && B <= 8, "codec widths are 2..8");
  static constexpr int kPlanes = (B == 7) ? 3 : (B == 3 || B == 5 || B == 6) ? 2 : 1;
  // Width of unit p.
  __host__ __device__ static constexpr int u(int p) {
    return p == 0 ? (B <= 3 ? 2 : B == 8 ? 8 : 4) : p == 1 ? (B == 3 || B == 5 ? 1 : 2) : 1;
  }
  // Shift of unit p inside the code.
  __host__ __device__ static constexpr int below(int p) {
    return p == 0 ? B - u(0) : p == 1 ? B - u(0) - u(1) : 0;
  }
};

// First word (of the lane's BITS plane words) of plane p: planes are stored one after the other,
// u words per lane each, so the lane's words of all planes add up to BITS.
template <int B>
__host__ __device__ constexpr int plane_word_base(int p) {
  return p == 0 ? 0 : p == 1 ? Units<B>::u(0) : Units<B>::u(0) + Units<B>::u(1);
}

// Byte offset of plane p inside a block.
template <int B>
__host__ __device__ constexpr uint32_t plane_offset(int p) {
  return kHeaderBytes + 128u * (uint32_t)plane_word_base<B>(p);
}

// Ors the units of code `q` of value i into the lane's plane words (bits of q above bit B-1 are
// ignored).
template <int B>
__device__ __forceinline__ void put_code(uint32_t (&words)[B], int i, uint32_t q) {
#pragma unroll
  for (int p = 0; p < Units<B>::kPlanes; ++p) {
    const int u = Units<B>::u(p);
    const uint32_t mask = (1u << u) - 1u;
    const int bit = i * u;
    words[plane_word_base<B>(p) + (bit >> 5)] |= ((q >> Units<B>::below(p)) & mask) << (bit & 31);
  }
}

// The code of value i from the lane's plane words.
template <int B>
__device__ __forceinline__ uint32_t get_code(const uint32_t (&words)[B], int i) {
  uint32_t q = 0;
#pragma unroll
  for (int p = 0; p < Units<B>::kPlanes; ++p) {
    const int u = Units<B>::u(p);
    const uint32_t mask = (1u << u) - 1u;
    const int bit = i * u;
    q |= ((words[plane_word_base<B>(p) + (bit >> 5)] >> (bit & 31)) & mask) << Units<B>::below(p);
  }
  return q;
}

// Spreads the low 32/u bits of m so that bit t fills the u-bit field t (u = 1, 2, 4 or 8; a
// constant after unrolling).
__device__ __forceinline__ uint32_t spread_bits(uint32_t m, int u) {
  if (u == 1) return m;
  if (u == 2) {
    m &= 0xffffu;
    m = (m | (m << 8)) & 0x00ff00ffu;
    m = (m | (m << 4)) & 0x0f0f0f0fu;
    m = (m | (m << 2)) & 0x33333333u;
    m = (m | (m << 1)) & 0x55555555u;
    return m * 3u;
  }
  if (u == 4) {
    m &= 0xffu;
    m = (m | (m << 12)) & 0x000f000fu;
    m = (m | (m << 6)) & 0x03030303u;
    m = (m | (m << 3)) & 0x11111111u;
    return m * 15u;
  }
  m &= 0xfu;
  m = (m | (m << 14)) & 0x00030003u;
  m = (m | (m << 7)) & 0x01010101u;
  return m * 255u;
}

// Clears the code fields of every value whose bit in `keep` is 0.
template <int B>
__device__ __forceinline__ void keep_codes(uint32_t (&words)[B], uint32_t keep) {
#pragma unroll
  for (int p = 0; p < Units<B>::kPlanes; ++p) {
    const int u = Units<B>::u(p);
#pragma unroll
    for (int k = 0; k < u; ++k) {
      const int first = k * (32 / u);
      words[plane_word_base<B>(p) + k] &= spread_bits(keep >> first, u);
    }
  }
}

// ================================================================================== layout ====

template <typename T, int B>
struct Layout {
  uint32_t group, glog2, lpg, lpg_log2, spikes, groups;
  uint32_t range_off, sval_off, spos_off, pad_off, block_bytes;

  __device__ __forceinline__ Layout(uint32_t g, uint32_t k) {
    group = g;
    glog2 = 31 - __clz(g);
    lpg = g >> 5;
    lpg_log2 = glog2 - 5;
    spikes = k;
    groups = kBlockValues >> glog2;
    range_off = kHeaderBytes + 128u * B;
    sval_off = range_off + groups * 2 * Elem<T>::kBytes;
    spos_off = sval_off + groups * k * Elem<T>::kBytes;
    pad_off = spos_off + groups * k;
    block_bytes = (pad_off + 15u) & ~15u;
  }
};

// Valid values in block b of a buffer of n values.
__device__ __forceinline__ uint32_t block_nvalues(uint64_t n, uint64_t b) {
  const uint64_t start = b * kBlockValues;
  return start >= n ? 0u : (uint32_t)min((uint64_t)kBlockValues, n - start);
}

// ================================================================================== header ====

enum class HeaderMode { kZeroTag, kKeepTag };

template <typename T, int B>
__device__ __forceinline__ uint32_t header_word1(const Layout<T, B>& L, uint32_t nvalues) {
  return nvalues | ((uint32_t)B << 16) | (L.glog2 << 24);
}
template <typename T, int B>
__device__ __forceinline__ uint32_t header_word2(const Layout<T, B>& L) {
  return L.spikes | (Elem<T>::kCode << 8);
}

// Writes the header of a block (`blk` 16-byte aligned). kZeroTag writes all 16 bytes with tag 0;
// kKeepTag writes bytes 4..15 only.
template <typename T, int B>
__device__ __forceinline__ void write_header(uint8_t* blk, const Layout<T, B>& L, uint32_t nvalues, HeaderMode mode) {
  const uint32_t w1 = header_word1(L, nvalues), w2 = header_word2(L);
  if (mode == HeaderMode::kZeroTag) {
    *reinterpret_cast<uint4*>(blk) = make_uint4(0u, w1, w2, 0u);
  } else {
    *reinterpret_cast<uint32_t*>(blk + 4) = w1;
    *reinterpret_cast<uint2*>(blk + 8) = make_uint2(w2, 0u);
  }
}

// Plain loads (global or shared memory through generic addressing).
struct LoadPlain {
  template <typename V>
  __device__ static __forceinline__ V load(const void* p) {
    return *reinterpret_cast<const V*>(p);
  }
};

// Loads cached in L2 only: for blocks that a peer GPU wrote into this GPU's memory.
struct LoadCg {
  template <typename V>
  __device__ static __forceinline__ V load(const void* p) {
    if constexpr (sizeof(V) == 16) {
      uint4 v;
      asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
      return *reinterpret_cast<V*>(&v);
    } else if constexpr (sizeof(V) == 8) {
      uint2 v;
      asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
      return *reinterpret_cast<V*>(&v);
    } else if constexpr (sizeof(V) == 4) {
      uint32_t v;
      asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
      return *reinterpret_cast<V*>(&v);
    } else {
      unsigned short v;
      asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
      return *reinterpret_cast<V*>(&v);
    }
  }
};

// Whether bytes 4..15 of a block header match the format and value count (the tag is not read).
// Every lane may call it (same address: one broadcast load).
template <typename T, int B, class Ld = LoadPlain>
__device__ __forceinline__ bool check_header(const uint8_t* blk, const Layout<T, B>& L, uint32_t nvalues) {
  const uint32_t w1 = Ld::template load<uint32_t>(blk + 4);
  const uint2 w23 = Ld::template load<uint2>(blk + 8);
  return w1 == header_word1(L, nvalues) && w23.x == header_word2(L) && w23.y == 0u;
}

// ============================================================================ lane helpers ====

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31u; }

// Lanes of the group that `lane` belongs to, as a mask (lpg lanes, aligned).
__device__ __forceinline__ uint32_t group_lanes(uint32_t lane, uint32_t lpg) {
  const uint32_t base = lane & ~(lpg - 1u);
  return (lpg == 32u ? kFullMask : ((1u << lpg) - 1u)) << base;
}

// Whether `pred` holds on any lane of this lane's group (all lanes must call it).
__device__ __forceinline__ bool group_any(bool pred, uint32_t lane, uint32_t lpg) {
  return (__ballot_sync(kFullMask, pred) & group_lanes(lane, lpg)) != 0u;
}

// Values of this lane below `nvalues` (bit i: value 32*lane + i is valid).
__device__ __forceinline__ uint32_t valid_mask(uint32_t lane, uint32_t nvalues) {
  const uint32_t start = lane * 32u;
  if (nvalues >= start + 32u) return kFullMask;
  if (nvalues <= start) return 0u;
  return (1u << (nvalues - start)) - 1u;
}

__device__ __forceinline__ float min_nan_f32(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ======================================================================== min/max networks ====

struct OpsF32 {
  using V = float;
  __device__ static __forceinline__ V mn(V a, V b) { return fminf(a, b); }
  __device__ static __forceinline__ V mx(V a, V b) { return fmaxf(a, b); }
  __device__ static __forceinline__ V mn_nan(V a, V b) { return min_nan_f32(a, b); }
};

struct OpsBf16x2 {
  using V = __nv_bfloat162;
  __device__ static __forceinline__ V mn(V a, V b) { return __hmin2(a, b); }
  __device__ static __forceinline__ V mx(V a, V b) { return __hmax2(a, b); }
  __device__ static __forceinline__ V mn_nan(V a, V b) { return __hmin2_nan(a, b); }
  __device__ static __forceinline__ V from_word(uint32_t w) { return *reinterpret_cast<V*>(&w); }
  __device__ static __forceinline__ float low(V v) { return __low2float(v); }
  __device__ static __forceinline__ float high(V v) { return __high2float(v); }
};

struct OpsF16x2 {
  using V = __half2;
  __device__ static __forceinline__ V mn(V a, V b) { return __hmin2(a, b); }
  __device__ static __forceinline__ V mx(V a, V b) { return __hmax2(a, b); }
  __device__ static __forceinline__ V mn_nan(V a, V b) { return __hmin2_nan(a, b); }
  __device__ static __forceinline__ V from_word(uint32_t w) { return *reinterpret_cast<V*>(&w); }
  __device__ static __forceinline__ float low(V v) { return __low2float(v); }
  __device__ static __forceinline__ float high(V v) { return __high2float(v); }
};

// Merges two sorted lists (a: LA entries, b: LB entries) into the first LC entries of their sorted
// union (multiset): c_k = min over i + j = k of max(a_i, b_j), a_0 = b_0 = nothing. MAXSIDE sorts
// descending instead. The first entry of the ascending side propagates NaN (NaN detection).
template <class O, bool MAXSIDE, int LA, int LB, int LC>
__device__ __forceinline__ void merge_sorted(const typename O::V* a, const typename O::V* b, typename O::V* c) {
  using V = typename O::V;
#pragma unroll
  for (int k = 1; k <= LC; ++k) {
    V best = V();
    bool have = false;
#pragma unroll
    for (int i = 0; i <= k; ++i) {
      const int j = k - i;
      if (i > LA || j > LB) continue;
      V t;
      if (i == 0)
        t = b[j - 1];
      else if (j == 0)
        t = a[i - 1];
      else
        t = MAXSIDE ? O::mn(a[i - 1], b[j - 1]) : O::mx(a[i - 1], b[j - 1]);
      if (!have) {
        best = t;
        have = true;
      } else if (MAXSIDE) {
        best = O::mx(best, t);
      } else {
        best = (k == 1) ? O::mn_nan(best, t) : O::mn(best, t);
      }
    }
    c[k - 1] = best;
  }
}

// Reduces N nodes of sorted lists (length L) pairwise down to one list of length M.
template <class O, int M, int L, int N>
struct Tree {
  using V = typename O::V;
  __device__ static __forceinline__ void run(V (&lo)[N][M], V (&hi)[N][M], V (&rlo)[M], V (&rhi)[M]) {
    if constexpr (N == 1) {
      static_assert(L == M, "tree too shallow for M");
#pragma unroll
      for (int k = 0; k < M; ++k) {
        rlo[k] = lo[0][k];
        rhi[k] = hi[0][k];
      }
    } else {
      constexpr int LC = (2 * L < M) ? 2 * L : M;
      V nlo[N / 2][M], nhi[N / 2][M];
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        merge_sorted<O, false, L, L, LC>(lo[2 * i], lo[2 * i + 1], nlo[i]);
        merge_sorted<O, true, L, L, LC>(hi[2 * i], hi[2 * i + 1], nhi[i]);
      }
      Tree<O, M, LC, N / 2>::run(nlo, nhi, rlo, rhi);
    }
  }
};

// Leaves: pairs (a, b) of V give sorted lists of length min(M, 2).
template <class O, int M, int N>
__device__ __forceinline__ void tree_from_pairs(const typename O::V* x, typename O::V (&rlo)[M], typename O::V (&rhi)[M]) {
  using V = typename O::V;
  constexpr int LL = M < 2 ? M : 2;
  V lo[N / 2][M], hi[N / 2][M];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const V a = x[2 * i], b = x[2 * i + 1];
    lo[i][0] = O::mn_nan(a, b);
    hi[i][0] = O::mx(a, b);
    if constexpr (LL == 2) {
      lo[i][1] = O::mx(a, b);
      hi[i][1] = O::mn(a, b);
    }
  }
  Tree<O, M, LL, N / 2>::run(lo, hi, rlo, rhi);
}

// The M smallest (lo, ascending) and M largest (hi, descending) values of this lane, as a
// multiset; lo[0] is NaN if any value is NaN.
template <typename T, int M>
__device__ __forceinline__ void lane_top(const Vals<T>& x, float (&lo)[M], float (&hi)[M]) {
  if constexpr (Elem<T>::kWords == 32) {
    float f[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) f[i] = __uint_as_float(x.w[i]);
    tree_from_pairs<OpsF32, M, 32>(f, lo, hi);
  } else {
    using O = typename std::conditional<std::is_same<T, __half>::value, OpsF16x2, OpsBf16x2>::type;
    using V = typename O::V;
    V p[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) p[j] = O::from_word(x.w[j]);
    V plo[M], phi[M];
    tree_from_pairs<O, M, 16>(p, plo, phi);
    float elo[M], ehi[M], olo[M], ohi[M];
#pragma unroll
    for (int k = 0; k < M; ++k) {
      elo[k] = O::low(plo[k]);
      olo[k] = O::high(plo[k]);
      ehi[k] = O::low(phi[k]);
      ohi[k] = O::high(phi[k]);
    }
    merge_sorted<OpsF32, false, M, M, M>(elo, olo, lo);
    merge_sorted<OpsF32, true, M, M, M>(ehi, ohi, hi);
  }
}

// Merges the lists of all lanes of each group (butterfly over lpg lanes).
template <int M>
__device__ __forceinline__ void group_top(float (&lo)[M], float (&hi)[M], uint32_t lpg) {
  for (uint32_t s = 1; s < lpg; s <<= 1) {
    float plo[M], phi[M], nlo[M], nhi[M];
#pragma unroll
    for (int k = 0; k < M; ++k) {
      plo[k] = __shfl_xor_sync(kFullMask, lo[k], s);
      phi[k] = __shfl_xor_sync(kFullMask, hi[k], s);
    }
    merge_sorted<OpsF32, false, M, M, M>(lo, plo, nlo);
    merge_sorted<OpsF32, true, M, M, M>(hi, phi, nhi);
#pragma unroll
    for (int k = 0; k < M; ++k) {
      lo[k] = nlo[k];
      hi[k] = nhi[k];
    }
  }
}

// ============================================================================ index search ====
//
// Masks of the lane's values equal to a value. For f32 bit i is value i. For 16-bit types bit j
// is value 2j and bit 16 + j is value 2j + 1 (one packed compare per word).

template <typename T>
__device__ __forceinline__ uint32_t eq_mask(const Vals<T>& x, float t) {
  uint32_t m = 0;
  if constexpr (Elem<T>::kWords == 32) {
#pragma unroll
    for (int i = 0; i < 32; ++i) m |= (__uint_as_float(x.w[i]) == t) ? (1u << i) : 0u;
  } else if constexpr (std::is_same<T, __half>::value) {
    const __half2 tt = __float2half2_rn(t);
#pragma unroll
    for (int j = 0; j < 16; ++j) m |= __heq2_mask(OpsF16x2::from_word(x.w[j]), tt) & ((1u << j) | (1u << (16 + j)));
  } else {
    const __nv_bfloat162 tt = __float2bfloat162_rn(t);
#pragma unroll
    for (int j = 0; j < 16; ++j) m |= __heq2_mask(OpsBf16x2::from_word(x.w[j]), tt) & ((1u << j) | (1u << (16 + j)));
  }
  return m;
}

// Mask bit of value i (0..31) in the layout of eq_mask.
template <typename T>
__device__ __forceinline__ uint32_t mask_bit(uint32_t i) {
  if constexpr (Elem<T>::kWords == 32)
    return 1u << i;
  else
    return 1u << ((i >> 1) + ((i & 1u) << 4));
}

// Lowest value index in a non-empty mask.
template <typename T>
__device__ __forceinline__ uint32_t mask_first(uint32_t m) {
  if constexpr (Elem<T>::kWords == 32) {
    return (uint32_t)__ffs(m) - 1u;
  } else {
    const uint32_t e = m & 0xffffu, o = m >> 16;
    const uint32_t ie = e ? 2u * ((uint32_t)__ffs(e) - 1u) : 64u;
    const uint32_t io = o ? 2u * ((uint32_t)__ffs(o) - 1u) + 1u : 64u;
    return min(ie, io);
  }
}

// First index (inside the group) of a value equal to t, skipping group index `skip` (pass a value
// >= 256 to skip nothing). The value must exist in the group.
template <typename T>
__device__ __forceinline__ uint32_t group_find(const Vals<T>& x, float t, uint32_t skip, uint32_t lane, uint32_t lpg) {
  const uint32_t sub = lane & (lpg - 1u);
  uint32_t m = eq_mask<T>(x, t);
  if ((skip >> 5) == sub) m &= ~mask_bit<T>(skip & 31u);
  const uint32_t first = m ? mask_first<T>(m) : 0u;
  const uint32_t base = lane & ~(lpg - 1u);
  const uint32_t gm = (__ballot_sync(kFullMask, m != 0u) & group_lanes(lane, lpg)) >> base;
  const uint32_t owner = gm ? (uint32_t)__ffs(gm) - 1u : 0u;
  const uint32_t f = __shfl_sync(kFullMask, first, base + owner);
  return owner * 32u + f;
}

// ============================================================================ general path ====

// One candidate of a lexicographic (value, index) reduction.
struct Cand {
  float v;
  uint32_t idx;   // index inside the group
  uint32_t bits;  // the element's bits
  bool has;
};

__device__ __forceinline__ bool cand_better(const Cand& a, const Cand& b, bool want_max) {
  if (!a.has) return false;
  if (!b.has) return true;
  if (want_max ? (a.v > b.v) : (a.v < b.v)) return true;
  return a.v == b.v && a.idx < b.idx;
}

// The smallest (or largest) value of the lane among the values in `allowed`, first index on ties.
template <typename T>
__device__ __forceinline__ Cand lane_scan(const Vals<T>& x, uint32_t allowed, bool want_max, uint32_t sub) {
  Cand c;
  c.v = 0.f;
  c.idx = 0;
  c.bits = 0;
  c.has = false;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const float v = Elem<T>::value(x.w, i);
    const bool ok = (allowed >> i) & 1u;
    const bool better = ok && (!c.has || (want_max ? v > c.v : v < c.v));
    if (better) {
      c.v = v;
      c.idx = sub * 32u + (uint32_t)i;
      c.bits = Elem<T>::bits(x.w, i);
      c.has = true;
    }
  }
  return c;
}

__device__ __forceinline__ Cand group_best(Cand c, bool want_max, uint32_t lpg) {
  for (uint32_t s = 1; s < lpg; s <<= 1) {
    Cand o;
    o.v = __shfl_xor_sync(kFullMask, c.v, s);
    o.idx = __shfl_xor_sync(kFullMask, c.idx, s);
    o.bits = __shfl_xor_sync(kFullMask, c.bits, s);
    o.has = __shfl_xor_sync(kFullMask, (uint32_t)c.has, s) != 0u;
    if (cand_better(o, c, want_max)) c = o;
  }
  return c;
}

// ================================================================================ encoding ====

// Everything the group's first lane writes besides the codes.
struct GroupMeta {
  uint32_t lo_bits, hi_bits;
  uint32_t ke;  // valid spike slots
  uint32_t pos[4];
  uint32_t val_bits[4];
};

template <typename T, int B>
__device__ __forceinline__ void write_group_meta(uint8_t* blk, const Layout<T, B>& L, uint32_t j, const GroupMeta& m) {
  const uint32_t k = L.spikes;
  uint32_t pos[4], val[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    pos[s] = (uint32_t)s < m.ke ? m.pos[s] : 0u;
    val[s] = (uint32_t)s < m.ke ? m.val_bits[s] : 0u;
  }
  if constexpr (Elem<T>::kBytes == 4) {
    *reinterpret_cast<uint2*>(blk + L.range_off + 8u * j) = make_uint2(m.lo_bits, m.hi_bits);
    if (k == 2) {
      *reinterpret_cast<uint2*>(blk + L.sval_off + 8u * j) = make_uint2(val[0], val[1]);
      *reinterpret_cast<uint16_t*>(blk + L.spos_off + 2u * j) = (uint16_t)(pos[0] | (pos[1] << 8));
    } else if (k == 4) {
      *reinterpret_cast<uint4*>(blk + L.sval_off + 16u * j) = make_uint4(val[0], val[1], val[2], val[3]);
      *reinterpret_cast<uint32_t*>(blk + L.spos_off + 4u * j) = pos[0] | (pos[1] << 8) | (pos[2] << 16) | (pos[3] << 24);
    }
  } else {
    *reinterpret_cast<uint32_t*>(blk + L.range_off + 4u * j) = m.lo_bits | (m.hi_bits << 16);
    if (k == 2) {
      *reinterpret_cast<uint32_t*>(blk + L.sval_off + 4u * j) = val[0] | (val[1] << 16);
      *reinterpret_cast<uint16_t*>(blk + L.spos_off + 2u * j) = (uint16_t)(pos[0] | (pos[1] << 8));
    } else if (k == 4) {
      *reinterpret_cast<uint2*>(blk + L.sval_off + 8u * j) = make_uint2(val[0] | (val[1] << 16), val[2] | (val[3] << 16));
      *reinterpret_cast<uint32_t*>(blk + L.spos_off + 4u * j) = pos[0] | (pos[1] << 8) | (pos[2] << 16) | (pos[3] << 24);
    }
  }
}

template <int B>
__device__ __forceinline__ void store_planes(uint8_t* blk, const uint32_t (&words)[B], uint32_t lane) {
#pragma unroll
  for (int p = 0; p < Units<B>::kPlanes; ++p) {
    const int u = Units<B>::u(p);
    const int base = plane_word_base<B>(p);
    uint8_t* dst = blk + plane_offset<B>(p) + lane * 4u * (uint32_t)u;
    if (u == 1) {
      *reinterpret_cast<uint32_t*>(dst) = words[base];
    } else if (u == 2) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(words[base], words[base + 1]);
    } else if (u == 4) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[base], words[base + 1], words[base + 2], words[base + 3]);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[base], words[base + 1], words[base + 2], words[base + 3]);
      *reinterpret_cast<uint4*>(dst + 16) = make_uint4(words[base + 4], words[base + 5], words[base + 6], words[base + 7]);
    }
  }
}

// Codes of the lane's 32 values. CLAMP selects the general formula (NaN or t < 0 -> 0,
// t >= 2^b - 1 -> 2^b - 1); without it t must lie in [0, 2^b - 1 + 1/2) for every kept value
// (values outside give garbage confined to their own field, which keep_codes clears).
template <typename T, int B, bool CLAMP>
__device__ __forceinline__ void compute_codes(const Vals<T>& x, float lo, float r, uint32_t (&words)[B]) {
  const float maxc = (float)((1u << B) - 1u);
#pragma unroll
  for (int w = 0; w < B; ++w) words[w] = 0u;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const float v = Elem<T>::value(x.w, i);
    float t = __fmul_rn(__fsub_rn(v, lo), r);
    if (CLAMP) t = (t >= 0.0f) ? fminf(t, maxc) : 0.0f;
    const uint32_t q = __float_as_uint(__fadd_rn(t, kMagic));
    put_code<B>(words, i, q);
  }
}

// Range arithmetic shared by both paths (rule 3 to 4 of docs/codec.md): step, 1/step, and whether
// the range poisons the group.
struct Range {
  float step, r;
  bool bad;
};

template <int B>
__device__ __forceinline__ Range range_of(float lo, float hi) {
  const float maxc = (float)((1u << B) - 1u);
  Range g;
  const float range = __fsub_rn(hi, lo);
  g.step = __fdiv_rn(range, maxc);
  g.r = __fdiv_rn(1.0f, g.step);
  const float top = __fadd_rn(lo, __fmul_rn(maxc, g.step));
  g.bad = isinf(lo) || isinf(hi) || isinf(range) || isinf(top);
  return g;
}

// What an encoding path decides for the lane's group; the codes follow from it.
struct Plan {
  float lo;       // range start (f32)
  float r;        // 1 / step
  uint32_t keep;  // this lane's values that get a code (others: 0)
  bool clamp;     // codes need the general formula
  GroupMeta meta; // written by the group's first lane
};

// Fast path for one warp-block (see the file comment). Returns false when some group of the warp
// needs the general path.
template <typename T, int B, int M>
__device__ __forceinline__ bool plan_fast(const Vals<T>& x, const Layout<T, B>& L, uint32_t lane, Plan& plan) {
  float lo[M], hi[M];
  lane_top<T, M>(x, lo, hi);
  group_top<M>(lo, hi, L.lpg);
  bool clean = !isnan(lo[0]) && lo[M - 1] < hi[M - 1];
#pragma unroll
  for (int k = 0; k < M; ++k) clean = clean && lo[k] != 0.0f && hi[k] != 0.0f;
  const float lov = lo[M - 1], hiv = hi[M - 1];
  const Range rg = range_of<B>(lov, hiv);
  clean = clean && !rg.bad && !isinf(rg.r);
  if (!__all_sync(kFullMask, clean)) return false;

  const uint32_t sub = lane & (L.lpg - 1u);
  plan.lo = lov;
  plan.r = rg.r;
  plan.clamp = false;
  plan.meta.lo_bits = Elem<T>::exact_bits(lov);
  plan.meta.hi_bits = Elem<T>::exact_bits(hiv);
  plan.meta.ke = L.spikes;
  uint32_t spike_mask = 0;  // this lane's spike positions
  if constexpr (M >= 2) {
    plan.meta.pos[0] = group_find<T>(x, lo[0], 256u, lane, L.lpg);
    plan.meta.pos[1] = group_find<T>(x, hi[0], 256u, lane, L.lpg);
    plan.meta.val_bits[0] = Elem<T>::exact_bits(lo[0]);
    plan.meta.val_bits[1] = Elem<T>::exact_bits(hi[0]);
    if constexpr (M >= 3) {
      plan.meta.pos[2] = group_find<T>(x, lo[1], plan.meta.pos[0], lane, L.lpg);
      plan.meta.pos[3] = group_find<T>(x, hi[1], plan.meta.pos[1], lane, L.lpg);
      plan.meta.val_bits[2] = Elem<T>::exact_bits(lo[1]);
      plan.meta.val_bits[3] = Elem<T>::exact_bits(hi[1]);
    }
#pragma unroll
    for (int s = 0; s < 2 * (M - 1); ++s)
      if ((plan.meta.pos[s] >> 5) == sub) spike_mask |= 1u << (plan.meta.pos[s] & 31u);
  }
  plan.keep = ~spike_mask;
  return true;
}

// General path: the reference's selection, literally. Picks 0..k-1 alternate smallest / largest
// among the values not picked yet; then the smallest and the largest of the rest give the range.
// One scan site in a rolled loop keeps the code small (this path is rare).
template <typename T, int B>
__device__ __forceinline__ void plan_general(const Vals<T>& x, uint32_t nvalues, const Layout<T, B>& L, uint32_t lane,
                                             Plan& plan) {
  const uint32_t lpg = L.lpg, sub = lane & (lpg - 1u), j = lane >> L.lpg_log2;
  const uint32_t valid = valid_mask(lane, nvalues);
  bool lane_nan = false;
#pragma unroll
  for (int i = 0; i < 32; ++i) lane_nan = lane_nan || (((valid >> i) & 1u) && isnan(Elem<T>::value(x.w, i)));
  const bool nan = group_any(lane_nan, lane, lpg);
  const int glen = (int)nvalues - (int)(j << L.glog2);
  const uint32_t len = glen <= 0 ? 0u : min((uint32_t)glen, L.group);
  const uint32_t ke = min(L.spikes, len);

  GroupMeta& meta = plan.meta;
  meta.ke = ke;
#pragma unroll
  for (int t = 0; t < 4; ++t) meta.pos[t] = meta.val_bits[t] = 0;
  uint32_t picked = 0;
  Cand cl, ch;
  cl.has = ch.has = false;
  cl.v = ch.v = 0.0f;
  cl.bits = ch.bits = 0;
  cl.idx = ch.idx = 0;
#pragma unroll 1
  for (uint32_t s = 0; s < L.spikes + 2u; ++s) {  // warp-uniform trip count
    const bool want_max = s & 1u;
    const Cand c = group_best(lane_scan<T>(x, valid & ~picked, want_max, sub), want_max, lpg);
    if (s < L.spikes) {
      if (s < ke) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          if ((uint32_t)t == s) {
            meta.pos[t] = c.idx;
            meta.val_bits[t] = c.bits;
          }
        }
        if ((c.idx >> 5) == sub) picked |= 1u << (c.idx & 31u);
      }
    } else if (s == L.spikes) {
      cl = c;
    } else {
      ch = c;
    }
  }
  const float lov = cl.has ? cl.v : 0.0f, hiv = ch.has ? ch.v : 0.0f;
  meta.lo_bits = cl.has ? cl.bits : 0u;
  meta.hi_bits = ch.has ? ch.bits : 0u;
  const Range rg = range_of<B>(lov, hiv);
  const bool poisoned = nan || rg.bad;
  plan.lo = lov;
  plan.r = rg.r;
  plan.clamp = true;
  plan.keep = poisoned ? 0u : (valid & ~picked);
  if (poisoned) {
    meta.lo_bits = meta.hi_bits = Elem<T>::kNanBits;
    meta.ke = 0;
  }
}

// Encodes one block from the lane's values (`x`; values at or beyond `nvalues` are ignored) into
// `blk` (16-byte aligned, block_bytes bytes, global or shared memory). Every lane of the warp
// must call it with the same `blk`, `nvalues` and layout. Writes every byte of the block except,
// with HeaderMode::kKeepTag, the tag word.
template <typename T, int B>
__device__ __forceinline__ void encode(const Vals<T>& x, uint32_t nvalues, const Layout<T, B>& L, uint8_t* blk,
                                       HeaderMode mode) {
  const uint32_t lane = lane_id();
  Plan plan;
  bool fast = false;
  if (FC_CODEC_ABLATE & 1) {
    plan.lo = -4.0f;
    plan.r = 2.0f;
    plan.keep = kFullMask;
    plan.clamp = false;
    plan.meta = GroupMeta{};
    fast = true;
  } else if (nvalues == kBlockValues) {
    if (L.spikes == 0)
      fast = plan_fast<T, B, 1>(x, L, lane, plan);
    else if (L.spikes == 2)
      fast = plan_fast<T, B, 2>(x, L, lane, plan);
    else
      fast = plan_fast<T, B, 3>(x, L, lane, plan);
  }
  if (!fast) plan_general<T, B>(x, nvalues, L, lane, plan);
  uint32_t words[B];
  if (FC_CODEC_ABLATE & 2) {
#pragma unroll
    for (int w = 0; w < B; ++w) words[w] = x.w[w] ^ x.w[w + 8];
  } else if (!plan.clamp)
    compute_codes<T, B, false>(x, plan.lo, plan.r, words);
  else
    compute_codes<T, B, true>(x, plan.lo, plan.r, words);
  if (plan.keep != kFullMask) keep_codes<B>(words, plan.keep);
  store_planes<B>(blk, words, lane);
  if ((lane & (L.lpg - 1u)) == 0) write_group_meta<T, B>(blk, L, lane >> L.lpg_log2, plan.meta);
  if (lane == 0) {
    write_header<T, B>(blk, L, nvalues, mode);
    const uint32_t pad = L.block_bytes - L.pad_off;  // 0 or 8 for every format
    if (pad == 8u) *reinterpret_cast<uint2*>(blk + L.pad_off) = make_uint2(0u, 0u);
  }
}

// ================================================================================ decoding ====

// Lane-private spike scratch (32 f32 in shared memory, 16-byte chunks XOR-swizzled by lane so
// that the 16-byte accesses of 8 lanes hit distinct banks).
__device__ __forceinline__ uint32_t scratch_slot(uint32_t lane, uint32_t e) {
  return ((((e >> 2) ^ (lane & 7u))) << 2) | (e & 3u);
}

// The spike slots of one block that patch values of the calling lane (see decode_values).
struct LaneSpikes {
  uint32_t owned;  // bit s: slot s patches one of this lane's values (never set in poisoned groups)
  uint32_t pos4;   // slot s's position inside the group in byte s (the lane's value is pos & 31)
  float val[4];    // slot s's value, exact
};

// Decodes the lane's 32 values of one block into f32 (`v[i]` = value 32*lane + i) WITHOUT the
// spikes, which come back in `sp` for the caller to apply (first slot wins on a repeated
// position: apply the owned slots from the last to the first). Poisoned groups give the canonical
// f32 NaN and no owned slot. Values at or beyond `nvalues` are unspecified. `may_nan` is set when a
// decoded value of a non-poisoned group may be NaN (only possible for blocks that no encoder wrote:
// infinite ranges or NaN spikes). Every lane of the warp must call it with the same arguments. The
// header is not checked here.
template <typename T, int B, class Ld = LoadPlain>
__device__ __forceinline__ void decode_values(const uint8_t* blk, const Layout<T, B>& L, uint32_t nvalues, float (&v)[32],
                                              LaneSpikes& sp, bool& may_nan) {
  const uint32_t lane = lane_id();
  const uint32_t lpg = L.lpg, sub = lane & (lpg - 1u), j = lane >> L.lpg_log2;
  uint32_t words[B];
#pragma unroll
  for (int p = 0; p < Units<B>::kPlanes; ++p) {
    const int u = Units<B>::u(p);
    const int base = plane_word_base<B>(p);
    const uint8_t* src = blk + plane_offset<B>(p) + lane * 4u * (uint32_t)u;
    if (u == 1) {
      words[base] = Ld::template load<uint32_t>(src);
    } else if (u == 2) {
      const uint2 a = Ld::template load<uint2>(src);
      words[base] = a.x;
      words[base + 1] = a.y;
    } else {
#pragma unroll
      for (int c = 0; c < u / 4; ++c) {
        const uint4 a = Ld::template load<uint4>(src + 16 * c);
        words[base + 4 * c] = a.x;
        words[base + 4 * c + 1] = a.y;
        words[base + 4 * c + 2] = a.z;
        words[base + 4 * c + 3] = a.w;
      }
    }
  }
  float lo, hi;
  if constexpr (Elem<T>::kBytes == 4) {
    const uint2 r = Ld::template load<uint2>(blk + L.range_off + 8u * j);
    lo = __uint_as_float(r.x);
    hi = __uint_as_float(r.y);
  } else {
    const uint32_t r = Ld::template load<uint32_t>(blk + L.range_off + 4u * j);
    lo = Elem<T>::from_bits(r & 0xffffu);
    hi = Elem<T>::from_bits(r >> 16);
  }
  // The spike slots' loads too, before any of the loaded words is used: every load of the block
  // is then in flight at once (one round trip when the block is read across PCIe).
  const uint32_t k = L.spikes;
  uint32_t pos4 = 0;
  float sv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (k != 0) {
    if constexpr (Elem<T>::kBytes == 4) {
      if (k == 2) {
        pos4 = Ld::template load<uint16_t>(blk + L.spos_off + 2u * j);
        const uint2 a = Ld::template load<uint2>(blk + L.sval_off + 8u * j);
        sv[0] = __uint_as_float(a.x);
        sv[1] = __uint_as_float(a.y);
        sv[2] = sv[3] = 0.0f;
      } else {
        pos4 = Ld::template load<uint32_t>(blk + L.spos_off + 4u * j);
        const uint4 a = Ld::template load<uint4>(blk + L.sval_off + 16u * j);
        sv[0] = __uint_as_float(a.x);
        sv[1] = __uint_as_float(a.y);
        sv[2] = __uint_as_float(a.z);
        sv[3] = __uint_as_float(a.w);
      }
    } else {
      if (k == 2) {
        pos4 = Ld::template load<uint16_t>(blk + L.spos_off + 2u * j);
        const uint32_t a = Ld::template load<uint32_t>(blk + L.sval_off + 4u * j);
        sv[0] = Elem<T>::from_bits(a & 0xffffu);
        sv[1] = Elem<T>::from_bits(a >> 16);
        sv[2] = sv[3] = 0.0f;
      } else {
        pos4 = Ld::template load<uint32_t>(blk + L.spos_off + 4u * j);
        const uint2 a = Ld::template load<uint2>(blk + L.sval_off + 8u * j);
        sv[0] = Elem<T>::from_bits(a.x & 0xffffu);
        sv[1] = Elem<T>::from_bits(a.x >> 16);
        sv[2] = Elem<T>::from_bits(a.y & 0xffffu);
        sv[3] = Elem<T>::from_bits(a.y >> 16);
      }
    }
  }
  const float maxc = (float)((1u << B) - 1u);
  const float step = __fdiv_rn(__fsub_rn(hi, lo), maxc);
  const bool poisoned = isnan(lo) || isnan(hi);
  may_nan = !poisoned && (isinf(lo) || isinf(hi) || isinf(__fadd_rn(lo, __fmul_rn(maxc, step))));

  if (FC_CODEC_ABLATE & 16) {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __uint_as_float(words[i % B]);
  } else if (FC_CODEC_ABLATE & 8) {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __uint_as_float(get_code<B>(words, i) | kMagicBits);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const float fq = __fsub_rn(__uint_as_float(get_code<B>(words, i) | kMagicBits), kMagic);
      v[i] = __fadd_rn(lo, __fmul_rn(fq, step));
    }
  }

  // Spikes: slots s < ke with a position inside the group's valid values; the first slot wins on
  // a repeated position (patches are applied last slot first).
  sp.owned = 0;
  if (k != 0) {
    const int glen = (int)nvalues - (int)(j << L.glog2);
    const uint32_t len = glen <= 0 ? 0u : min((uint32_t)glen, L.group);
    const uint32_t ke = min(k, len);
    uint32_t owned = 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t p = (pos4 >> (8 * s)) & 0xffu;
      if ((uint32_t)s < ke && p < len && (p >> 5) == sub) {
        owned |= 1u << s;
        may_nan = may_nan || (!poisoned && isnan(sv[s]));
      }
    }
    sp.owned = poisoned ? 0u : owned;
    sp.pos4 = pos4;
#pragma unroll
    for (int s = 0; s < 4; ++s) sp.val[s] = sv[s];
  }
  if (poisoned) {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __uint_as_float(0x7FC00000u);
  }
}


// decode_values with the spikes applied in registers, through `scratch`: this warp's 4 KiB
// (FC_CODEC_SCRATCH_BYTES) of 16-byte aligned shared memory, used by the lanes that own a spike.
template <typename T, int B, class Ld = LoadPlain>
__device__ __forceinline__ void decode(const uint8_t* blk, const Layout<T, B>& L, uint32_t nvalues, float (&v)[32],
                                       float* scratch, bool& may_nan) {
  LaneSpikes sp;
  decode_values<T, B, Ld>(blk, L, nvalues, v, sp, may_nan);
  if (sp.owned != 0u) {
    const uint32_t lane = lane_id();
    float* mine = scratch + lane * 32u;
#pragma unroll
    for (int c = 0; c < 8; ++c)
      *reinterpret_cast<float4*>(mine + scratch_slot(lane, 4u * c)) = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
#pragma unroll
    for (int s = 3; s >= 0; --s)
      if ((sp.owned >> s) & 1u) mine[scratch_slot(lane, (sp.pos4 >> (8 * s)) & 31u)] = sp.val[s];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float4 a = *reinterpret_cast<const float4*>(mine + scratch_slot(lane, 4u * c));
      v[4 * c] = a.x;
      v[4 * c + 1] = a.y;
      v[4 * c + 2] = a.z;
      v[4 * c + 3] = a.w;
    }
  }
}

// The element bits that a decoded spike value becomes (exact; NaN -> canonical NaN).
template <typename T>
__device__ __forceinline__ uint32_t spike_bits(float v) {
  return isnan(v) ? Elem<T>::kNanBits : Elem<T>::exact_bits(v);
}

// Decodes one block and adds it into 32 f32 accumulators per lane: acc[i] = acc[i] + v[i].
template <typename T, int B, class Ld = LoadPlain>
__device__ __forceinline__ void decode_accumulate(const uint8_t* blk, const Layout<T, B>& L, uint32_t nvalues,
                                                  float (&acc)[32], float* scratch) {
  float v[32];
  bool may_nan;
  decode<T, B, Ld>(blk, L, nvalues, v, scratch, may_nan);
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], v[i]);
}

// Converts decoded f32 values to the lane's T bits (round to nearest even; NaN -> canonical NaN
// when `may_nan`, poisoned groups are already canonical).
template <typename T>
__device__ __forceinline__ void to_elements(const float (&v)[32], bool may_nan, Vals<T>& out) {
  if constexpr (Elem<T>::kWords == 32) {
#pragma unroll
    for (int i = 0; i < 32; ++i) out.w[i] = __float_as_uint(v[i]);
    if (may_nan) {
#pragma unroll
      for (int i = 0; i < 32; ++i) out.w[i] = Elem<T>::round_bits(v[i]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) out.w[j] = Elem<T>::round_pack(v[2 * j], v[2 * j + 1]);
    // The packed conversions turn NaN into a non-canonical NaN; poisoned lanes are all NaN.
    if (isnan(v[0]) || may_nan) {
#pragma unroll
      for (int j = 0; j < 16; ++j) out.w[j] = Elem<T>::round_bits(v[2 * j]) | (Elem<T>::round_bits(v[2 * j + 1]) << 16);
    }
  }
}

// ========================================================================= reduce building ====

// The fused reduce step for one block: decodes `ninputs` blocks (`blocks[i]`, format of layout
// Lin) in order 0..N-1 with f32 accumulation (acc = v_0, acc = acc + v_i), rounds to T and encodes
// with layout Lout into `out`.
template <typename T, int BI, int BO, class Ld = LoadPlain>
__device__ __forceinline__ void reduce_requantize(const uint8_t* const* blocks, uint32_t ninputs,
                                                  const Layout<T, BI>& Lin, uint32_t nvalues,
                                                  const Layout<T, BO>& Lout, uint8_t* out, float* scratch,
                                                  HeaderMode mode) {
  float acc[32];
  bool may_nan;
  decode<T, BI, Ld>(blocks[0], Lin, nvalues, acc, scratch, may_nan);
  for (uint32_t i = 1; i < ninputs; ++i) decode_accumulate<T, BI, Ld>(blocks[i], Lin, nvalues, acc, scratch);
  Vals<T> x;
  round_to_vals<T>(acc, x);
  encode<T, BO>(x, nvalues, Lout, out, mode);
}

}  // namespace codec
}  // namespace fc
