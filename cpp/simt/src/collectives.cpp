// fastinfer simt: semantics of the warp collectives (computed once all lanes of the mask arrived).
#include <fastinfer/simt/device.h>

#include <algorithm>

namespace fastinfer::simt::detail {

namespace {
inline void copy_val(LaneIO* dst, const LaneIO* src) {
  dst->out[0] = src->in[0];
  dst->out[1] = src->in[1];
}
inline bool valid_width(int w) { return w >= 1 && w <= 32 && (w & (w - 1)) == 0; }

// mode: 0 idx, 1 up, 2 down, 3 xor  (CUDA Programming Guide, warp shuffle functions)
void shfl(LaneIO* const* lanes, unsigned mask, int mode, const char* name) {
  LaneIO tmp[32];
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1) tmp[l] = *lanes[l];
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    const LaneIO& me = tmp[l];
    int w = me.b;
    if (!valid_width(w)) fault(kFaultGeneric, "%s: width %d is not a power of two in [1, 32]", name, w);
    int seg = l & ~(w - 1);
    int src = l;
    switch (mode) {
      case 0: src = seg + (me.a & (w - 1)); break;
      case 1: src = l - me.a; if (src < seg) src = l; break;
      case 2: src = l + me.a; if (src >= seg + w) src = l; break;
      default: src = l ^ me.a; if (src >= seg + w || src < 0 || src > 31) src = l; break;
    }
    if (!(mask >> src & 1))
      fault(kFaultGeneric, "%s: lane %d reads lane %d, which is not in mask 0x%08x (undefined result)", name, l, src,
            mask);
    copy_val(lanes[l], &tmp[src]);
  }
}
}  // namespace

void coll_shfl_idx(LaneIO* const* lanes, unsigned mask) { shfl(lanes, mask, 0, "__shfl_sync"); }
void coll_shfl_up(LaneIO* const* lanes, unsigned mask) { shfl(lanes, mask, 1, "__shfl_up_sync"); }
void coll_shfl_down(LaneIO* const* lanes, unsigned mask) { shfl(lanes, mask, 2, "__shfl_down_sync"); }
void coll_shfl_xor(LaneIO* const* lanes, unsigned mask) { shfl(lanes, mask, 3, "__shfl_xor_sync"); }

void coll_vote(LaneIO* const* lanes, unsigned mask) {
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1) && lanes[l]->in[0]) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1) lanes[l]->out[0] = ballot;
}

void coll_syncwarp(LaneIO* const*, unsigned) {}

void coll_match_any(LaneIO* const* lanes, unsigned mask) {
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    unsigned m = 0;
    for (int j = 0; j < 32; ++j)
      if ((mask >> j & 1) && lanes[j]->in[0] == lanes[l]->in[0] && lanes[j]->in[1] == lanes[l]->in[1]) m |= 1u << j;
    lanes[l]->out[2] = m;
  }
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1) lanes[l]->out[0] = lanes[l]->out[2];
}

void coll_reduce(LaneIO* const* lanes, unsigned mask) {
  int first = __builtin_ctz(mask);
  int op = lanes[first]->a, sgn = lanes[first]->b;
  uint32_t acc = lanes[first]->in[0];
  for (int l = first + 1; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    uint32_t v = lanes[l]->in[0];
    switch (op) {
      case 0: acc += v; break;
      case 1: acc = sgn ? (uint32_t)std::min((int32_t)acc, (int32_t)v) : std::min(acc, v); break;
      case 2: acc = sgn ? (uint32_t)std::max((int32_t)acc, (int32_t)v) : std::max(acc, v); break;
      case 3: acc &= v; break;
      case 4: acc |= v; break;
      default: acc ^= v; break;
    }
  }
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1) lanes[l]->out[0] = acc;
}

}  // namespace fastinfer::simt::detail
