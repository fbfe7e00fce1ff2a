#pragma once
// tree_verify kernel: one CTA per sequence walks the draft tree from the root (semantics in
// tree_verify.h). Only the nodes the walk visits are read.
//
// Layout: the vocabulary is cut into one contiguous segment per warp (a multiple of 32 * VEC
// elements); inside its segment a warp reads 32 * VEC consecutive elements per step (lane l the
// VEC elements at l * VEC), so loads are coalesced 16-byte vectors. Every reduction has a fixed
// order: each lane folds its own elements in ascending order, warps combine with xor butterflies
// (whose pairwise combine is commutative, so all lanes agree bit for bit), and the CTA folds the
// per-warp results serially in warp order in every thread. Results never depend on scheduling.
//
// Per visited node:
//  - greedy: one pass, block argmax (lowest id on ties); the child whose token equals it is taken.
//  - sampling: one pass of online softmax statistics of logits * (1 / temperature): the max M and
//    per-segment masses seg_mass[w] = sum exp(x - M) (kept in shared memory), total R.
//    Child tests are scalar: r(x) = exp(l[x] / T - M) read from the one logit.
//    * without draft_probs a rejection zeroes r(x): x goes on a rejected list (shared memory) and
//      its mass leaves its segment, no pass over V;
//    * with draft_probs the first rejection at a node materialises the residual
//      P = max(p - q, 0) and Q = q without x in the fp32 workspace ([2, B, V]) in one pass that
//      also reduces their per-segment masses; later rejections update P and Q in place.
//  - the final residual sample (inverse CDF) picks the segment from seg_mass serially, and the
//    whole CTA rescans that segment with a block prefix sum: ~V / num_warps elements.
// Traffic for a walk visiting d nodes: greedy d reads of a logits row; sampling without draft
// d reads + one segment; with draft, each rejection adds a pass over the row (and P, Q).
//
// One CTA per sequence: at B < 132 SMs are idle (B = 1: one SM streams the visited rows;
// bench/model.py). The walk is sequential (the next node depends on the current node's argmax or
// rejection test), so spreading one sequence over several CTAs needs a grid-wide reduction per
// visited node: cooperative launch (a grid barrier per node, not available in the emulator) or
// one launch per tree level. A two-phase greedy variant (argmax of all N rows in parallel, then
// a walk over N tokens) would fill the GPU at the cost of reading unvisited rows; it is the
// candidate when GPU measurements show small-B verification latency matters.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/speculative/tree_verify.h"

#include <cmath>

namespace fastinfer::speculative {

constexpr int kMaxWarps = 32;
constexpr int kMaxThreads = kMaxWarps * 32;

struct TreeVerifyShared {
  float seg_mass[kMaxWarps];  // residual mass of each warp's vocabulary segment
  float red_a[kMaxWarps];     // per-warp partials of the current reduction
  float red_b[kMaxWarps];
  int red_i[kMaxWarps];
  int cand[kMaxWarps];        // inverse CDF: each warp's candidate token
};

__device__ __forceinline__ int64_t load_index(const void* base, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(base)[i] : static_cast<int64_t>(static_cast<const int32_t*>(base)[i]);
}

__device__ __forceinline__ void store_index(void* base, int64_t i, int64_t value, bool is64) {
  if (is64)
    static_cast<int64_t*>(base)[i] = value;
  else
    static_cast<int32_t*>(base)[i] = static_cast<int32_t>(value);
}

// Loads VEC consecutive elements as fp32 (the caller guarantees alignment and bounds).
template <int VEC, typename T>
__device__ __forceinline__ void load_f32(const T* ptr, float (&out)[VEC]) {
  Vec<T, VEC> v;
  v.load(ptr);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(v[i]);
}

template <int VEC>
__device__ __forceinline__ void store_f32(float* ptr, const float (&in)[VEC]) {
  Vec<float, VEC> v;
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = in[i];
  v.store(ptr);
}

// Online softmax accumulation of x into (m, s): s = sum exp(x_i - m). -inf inputs add nothing.
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = (m == -INFINITY ? 0.f : s * expf(m - x)) + 1.f;
    m = x;
  } else if (x != -INFINITY) {
    s += expf(x - m);
  }
}

// Commutative combine of two (max, sum) pairs: identical results in both lanes of an xor pair.
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  const float a = m == -INFINITY ? 0.f : s * expf(m - mx);
  const float b = m2 == -INFINITY ? 0.f : s2 * expf(m2 - mx);
  m = mx;
  s = a + b;
}

// Two 32-bit values moved by one 64-bit shuffle (pairs are reduced together).
__device__ __forceinline__ unsigned long long pack2(float a, uint32_t b) {
  return static_cast<unsigned long long>(__float_as_uint(a)) | (static_cast<unsigned long long>(b) << 32);
}
__device__ __forceinline__ float unpack_lo(unsigned long long x) { return __uint_as_float(static_cast<uint32_t>(x)); }
__device__ __forceinline__ uint32_t unpack_hi(unsigned long long x) { return static_cast<uint32_t>(x >> 32); }

// Sums of (a, b) over the warp, in every lane.
__device__ __forceinline__ void warp_sum2(float& a, float& b) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long o = __shfl_xor_sync(kFullWarpMask, pack2(a, __float_as_uint(b)), off);
    a += unpack_lo(o);
    b += __uint_as_float(unpack_hi(o));
  }
}

// (value, index) argmax with the lowest index on ties; index < 0 means "empty". Commutative.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
  const bool take = i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i));
  if (take) {
    v = v2;
    i = i2;
  }
}

template <typename T, int VEC>
struct Walker {
  const TreeVerifyParams& p;
  TreeVerifyShared& sh;
  int* rejected;  // dynamic smem [N]: tokens rejected at the current node (no-draft sampling)
  int64_t b;
  int V, N, lane, warp, num_warps;
  int seg_len;    // elements per warp segment (multiple of 32 * VEC)
  bool is64;
  float inv_temp;
  float* P;       // workspace rows of this sequence (draft sampling)
  float* Q;

  __device__ int seg_begin(int w) const { return min(V, w * seg_len); }
  __device__ int seg_end(int w) const { return min(V, (w + 1) * seg_len); }

  __device__ const T* logits_row(int node) const {
    return static_cast<const T*>(p.target_logits) + (b * N + node) * static_cast<int64_t>(V);
  }

  // ---- greedy: block argmax of a logits row (raw logits; temperature does not matter) ----------
  __device__ int block_argmax(const T* row) {
    float bv = -INFINITY;
    int bi = -1;
    const int end = seg_end(warp);
    for (int v = seg_begin(warp) + lane * VEC; v < end; v += 32 * VEC) {
      float x[VEC];
      load_f32<VEC>(row + v, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (bi < 0 || x[i] > bv) {
          bv = x[i];
          bi = v + i;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const unsigned long long o = __shfl_xor_sync(kFullWarpMask, pack2(bv, static_cast<uint32_t>(bi)), off);
      argmax_merge(bv, bi, unpack_lo(o), static_cast<int>(unpack_hi(o)));
    }
    if (lane == 0) {
      sh.red_a[warp] = bv;
      sh.red_i[warp] = bi;
    }
    __syncthreads();
    bv = -INFINITY;
    bi = -1;
    for (int w = 0; w < num_warps; ++w) argmax_merge(bv, bi, sh.red_a[w], sh.red_i[w]);
    __syncthreads();
    return bi < 0 ? 0 : bi;
  }

  // ---- sampling: softmax statistics; fills seg_mass, returns the max, sets the total ----------
  __device__ float softmax_stats(const T* row, float& total) {
    float m = -INFINITY, s = 0.f;
    const int end = seg_end(warp);
    for (int v = seg_begin(warp) + lane * VEC; v < end; v += 32 * VEC) {
      float x[VEC];
      load_f32<VEC>(row + v, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) online_add(m, s, x[i] * inv_temp);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const unsigned long long o = __shfl_xor_sync(kFullWarpMask, pack2(m, __float_as_uint(s)), off);
      online_merge(m, s, unpack_lo(o), __uint_as_float(unpack_hi(o)));
    }
    if (lane == 0) {
      sh.red_a[warp] = m;
      sh.red_b[warp] = s;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int w = 0; w < num_warps; ++w) mx = fmaxf(mx, sh.red_a[w]);
    total = 0.f;
    for (int w = 0; w < num_warps; ++w) {
      const float mw = sh.red_a[w];
      const float mass = mw == -INFINITY ? 0.f : sh.red_b[w] * expf(mw - mx);
      if (static_cast<int>(threadIdx.x) == w) sh.seg_mass[w] = mass;
      total += mass;
    }
    __syncthreads();
    return mx;
  }

  __device__ float total_mass() const {
    float t = 0.f;
    for (int w = 0; w < num_warps; ++w) t += sh.seg_mass[w];
    return t;
  }

  __device__ bool is_rejected(int v, int num_rejected) const {
    for (int k = 0; k < num_rejected; ++k)
      if (rejected[k] == v) return true;
    return false;
  }

  // ---- draft sampling: residual update after rejecting token x --------------------------------
  // fresh: P from the logits (p = exp(l / T - mx) / total) and Q from draft_probs (as given);
  // else from the workspace. P <- max(p - q, 0), Q <- q with Q[x] = 0 (both unnormalised; their
  // totals returned in total and q_total, per-segment masses of P in seg_mass).
  __device__ void residual_update(const T* row, const float* draft_row, bool fresh, float mx, int x, float& total,
                                  float& q_total) {
    __syncthreads();  // every thread has read P[x], Q[x] and seg_mass for the test
    const float inv_p = total > 0.f ? 1.f / total : 0.f;
    const float inv_q = fresh ? 1.f : (q_total > 0.f ? 1.f / q_total : 0.f);
    float sp = 0.f, sq = 0.f;
    const int end = seg_end(warp);
    for (int v = seg_begin(warp) + lane * VEC; v < end; v += 32 * VEC) {
      float pv[VEC], qv[VEC];
      if (fresh) {
        load_f32<VEC>(row + v, pv);
        load_f32<VEC>(draft_row + v, qv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) pv[i] = expf(pv[i] * inv_temp - mx) * inv_p;
      } else {
        load_f32<VEC>(P + v, pv);
        load_f32<VEC>(Q + v, qv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) pv[i] *= inv_p;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        pv[i] = fmaxf(pv[i] - qv[i] * inv_q, 0.f);
        if (v + i == x) qv[i] = 0.f;
        sp += pv[i];
        sq += qv[i];
      }
      store_f32<VEC>(P + v, pv);
      store_f32<VEC>(Q + v, qv);
    }
    warp_sum2(sp, sq);
    if (lane == 0) {
      sh.red_a[warp] = sp;
      sh.red_b[warp] = sq;
      sh.seg_mass[warp] = sp;
    }
    __syncthreads();  // also orders the P/Q stores before any later read of P[y], Q[y]
    total = 0.f;
    q_total = 0.f;
    for (int w = 0; w < num_warps; ++w) {
      total += sh.red_a[w];
      q_total += sh.red_b[w];
    }
    __syncthreads();
  }

  // Residual r(v) at the last node for the inverse-CDF rescan.
  __device__ void residual_values(const T* row, bool materialised, float mx, int num_rejected, int v,
                                  float (&r)[VEC]) const {
    if (materialised) {
      load_f32<VEC>(P + v, r);
      return;
    }
    load_f32<VEC>(row + v, r);
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      r[i] = is_rejected(v + i, num_rejected) ? 0.f : expf(r[i] * inv_temp - mx);
  }

  // ---- inverse CDF: smallest t with cumsum(r)[t] > u * total ------------------------------------
  // The segment is picked serially from seg_mass; the whole CTA then scans it in tiles of
  // blockDim * VEC elements (one tile for V <= 256k at 16-bit logits). Prefix sums are formed so
  // that thread t's exclusive prefix is bit-identical to thread t-1's inclusive one (warp
  // Hillis-Steele scan, warp bases accumulated serially in warp order): the first thread whose
  // inclusive prefix exceeds the threshold holds mass and its walk lands on a token with r > 0.
  __device__ int sample_residual(const T* row, bool materialised, float mx, int num_rejected, float total, float u) {
    const float thr = u * total;
    int wsel = -1, wlast = -1;
    float before = 0.f, acc = 0.f;
    for (int w = 0; w < num_warps; ++w) {
      const float m = sh.seg_mass[w];
      if (m > 0.f) wlast = w;
      if (wsel < 0) {
        if (acc + m > thr) {
          wsel = w;
          before = acc;
        }
        acc += m;
      }
    }
    const bool fallback = wsel < 0;  // rounding left no crossing: largest t with r[t] > 0
    if (fallback) wsel = wlast;
    if (wsel < 0) return 0;  // no mass anywhere (uniform decision: no barrier needed)
    const int sb = seg_begin(wsel), se = seg_end(wsel);
    const int step = static_cast<int>(blockDim.x) * VEC;
    float running = before;
    if (!fallback) {
      for (int tile = sb; tile < se; tile += step) {
        const int v = tile + static_cast<int>(threadIdx.x) * VEC;
        float r[VEC];
        float local = 0.f;
        if (v < se) {
          residual_values(row, materialised, mx, num_rejected, v, r);
#pragma unroll
          for (int i = 0; i < VEC; ++i) local += r[i];
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) r[i] = 0.f;
        }
        float incl = local;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float y = __shfl_up_sync(kFullWarpMask, incl, off);
          if (lane >= off) incl += y;
        }
        float excl = __shfl_up_sync(kFullWarpMask, incl, 1);
        if (lane == 0) excl = 0.f;
        if (lane == 31) sh.red_a[warp] = incl;
        __syncthreads();
        float base = running, my_base = 0.f;
        for (int w = 0; w < num_warps; ++w) {
          if (w == warp) my_base = base;
          base += sh.red_a[w];
        }
        const bool cross = my_base + incl > thr;
        const unsigned ballot = __ballot_sync(kFullWarpMask, cross);
        const int first = ballot != 0u ? __ffs(static_cast<int>(ballot)) - 1 : -1;
        if (lane == 0) sh.red_i[warp] = first;
        if (cross && lane == first) {
          float c = my_base + excl;
          int t = -1, last = -1;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            if (r[i] > 0.f) last = v + i;
            c += r[i];
            if (t < 0 && c > thr) t = v + i;
          }
          sh.cand[warp] = t >= 0 ? t : last;
        }
        __syncthreads();
        int token = -1;
        for (int w = 0; w < num_warps && token < 0; ++w)
          if (sh.red_i[w] >= 0) token = sh.cand[w];  // the first crossing warp's (>= 0, see above)
        __syncthreads();  // sh.red_a / red_i / cand are rewritten by the next tile
        if (token >= 0) return token;
        running = base;
      }
    }
    // Fallback (rounding only): the largest token of the segment with r > 0.
    int last_pos = -1;
    for (int v = sb + static_cast<int>(threadIdx.x) * VEC; v < se; v += step) {
      float r[VEC];
      residual_values(row, materialised, mx, num_rejected, v, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (r[i] > 0.f) last_pos = v + i;
    }
    last_pos = warp_reduce_max(last_pos);
    if (lane == 0) sh.red_i[warp] = last_pos;
    __syncthreads();
    for (int w = 0; w < num_warps; ++w) last_pos = max(last_pos, sh.red_i[w]);
    return last_pos < 0 ? 0 : last_pos;  // the walk's last use of sh: no trailing barrier needed
  }
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) tree_verify_kernel(const TreeVerifyParams p) {
  __shared__ TreeVerifyShared sh;
  const int64_t b = blockIdx.x;
  const int N = p.num_nodes, V = p.vocab_size;
  const bool is64 = p.index_type == IndexType::kInt64;
  const bool draft = p.draft_probs != nullptr;
  const int num_warps = static_cast<int>(blockDim.x) / 32;
  const int num_vecs = (V + VEC - 1) / VEC;
  const int vecs_per_lane = (num_vecs + num_warps * 32 - 1) / (num_warps * 32);

  Walker<T, VEC> w{p, sh, dynamic_smem<int>(), b, V, N, static_cast<int>(threadIdx.x % 32),
                   static_cast<int>(threadIdx.x / 32), num_warps, vecs_per_lane * 32 * VEC, is64,
                   p.greedy ? 1.f : 1.f / p.temperature[b], nullptr, nullptr};
  if (draft && !p.greedy) {
    w.P = p.workspace + b * static_cast<int64_t>(V);
    w.Q = p.workspace + (static_cast<int64_t>(p.batch_size) + b) * V;
  }
  const int64_t tok_base = b * N;
  const float* uniforms = p.uniforms + b * (N + 1);

  int cur = 0, depth = 0, next = 0;
  if (threadIdx.x == 0) store_index(p.accepted_nodes, tok_base, 0, is64);
  for (;;) {
    const T* row = w.logits_row(cur);
    int chosen = -1;
    if (p.greedy) {
      const int best = w.block_argmax(row);
      for (int c = cur + 1; c < N && chosen < 0; ++c)
        if (load_index(p.parents, tok_base + c, is64) == cur && load_index(p.draft_tokens, tok_base + c, is64) == best)
          chosen = c;
      if (chosen < 0) next = best;
    } else {
      float total;
      const float mx = w.softmax_stats(row, total);
      const float* draft_row = draft ? p.draft_probs + (b * N + cur) * static_cast<int64_t>(V) : nullptr;
      bool materialised = false;  // draft: residual P, Q live in the workspace
      float q_total = 1.f;
      int num_rejected = 0;
      for (int c = cur + 1; c < N && chosen < 0; ++c) {
        if (load_index(p.parents, tok_base + c, is64) != cur) continue;
        const int64_t x64 = load_index(p.draft_tokens, tok_base + c, is64);
        const bool valid = x64 >= 0 && x64 < V;
        const int x = valid ? static_cast<int>(x64) : 0;
        const float u = uniforms[c];
        if (draft) {
          float px = 0.f, qx = 0.f;
          if (valid) {
            if (materialised) {
              px = total > 0.f ? w.P[x] / total : 0.f;
              qx = q_total > 0.f ? w.Q[x] / q_total : 0.f;
            } else {
              px = expf(to_float(row[x]) * w.inv_temp - mx) / total;
              qx = draft_row[x];
            }
          }
          if (u * qx < px) {
            chosen = c;
          } else if (valid) {
            w.residual_update(row, draft_row, !materialised, mx, x, total, q_total);
            materialised = true;
          }
        } else {
          const float rx = valid && !w.is_rejected(x, num_rejected) ? expf(to_float(row[x]) * w.inv_temp - mx) : 0.f;
          if (u * total < rx) {
            chosen = c;
          } else if (rx > 0.f) {  // zero r(x) and take its mass out of its segment
            __syncthreads();      // every thread has read seg_mass and the rejected list
            if (threadIdx.x == 0) {
              w.rejected[num_rejected] = x;
              const int s = x / w.seg_len;
              sh.seg_mass[s] = fmaxf(sh.seg_mass[s] - rx, 0.f);
            }
            __syncthreads();
            ++num_rejected;
            total = w.total_mass();
          }
        }
      }
      if (chosen < 0) next = w.sample_residual(row, materialised, mx, num_rejected, total, uniforms[N]);
    }
    if (chosen < 0) break;
    cur = chosen;
    ++depth;
    if (threadIdx.x == 0) store_index(p.accepted_nodes, tok_base + depth, cur, is64);
  }
  for (int i = depth + 1 + static_cast<int>(threadIdx.x); i < N; i += blockDim.x)
    store_index(p.accepted_nodes, tok_base + i, -1, is64);
  if (threadIdx.x == 0) {
    store_index(p.num_accepted, b, depth, is64);
    store_index(p.next_token, b, next, is64);
  }
}

}  // namespace fastinfer::speculative
