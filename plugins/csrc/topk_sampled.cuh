// DSA-TRT kernels: the sampled select of one row (topk_select.cuh), for slices read from global
// memory: sampled_select_emit, with the full select of topk_cluster.cuh as its fallback.
#pragma once

#include "topk_emit.cuh"

namespace dsa_topk {

// ---- Sampled threshold: one full read for slices that are not cached in shared memory.
//
// The full select (topk_cluster.cuh) reads such a slice twice (the caller's pass 0, one shared atomic per key, and
// the sweep) and crowded rows a third time. Here a sample of the row decides the threshold
// region, and one read of the slice does the rest:
// 1. Every CTA stages runs of 8 vectors (128-byte lines), one per 8 * stride vectors of its slice,
//    in its bitmap area (the sample fits: stride >= 16); after a cluster barrier every CTA loads
//    the whole cluster's sample (<= kThreads * kSamplePer keys) into registers and finds its m-th
//    largest key to 22 bits, m = 1.5 k / stride (two local radix passes): T_low, the same in
//    every CTA. The first pass also finds the first digit of the sample's (k / stride)-th
//    largest key, a guess at the threshold's.
// 2. One sweep: keys >= T_low become candidates (key, position); no histogram. When the row's
//    candidates number at least k (then every key of the top k is one) and at most kCandCap, the
//    candidate step of the select finishes exactly as above, its first radix pass replaced by a
//    count when the guessed first digit is right.
// The sample is 8 keys per thread of the gather (1/32 of a 128K row over 2 or 4 CTAs; m = 96 for
// k = 2048: the candidates' count varies by ~10%, 3072 expected between k and the cap). A larger
// sample (1/16) costs more in its loads, gather and first-pass atomics than its tighter bound
// saves.
// 3. A sample whose 22-bit bin at T_low holds more keys than the cap allows, all of one value t
//    (massive ties, e.g. ReLU scores of exact zeros): the sweep marks keys > t as selected and
//    keys == t as tied, and the row is done if count(> t) < k <= count(>= t).
// Otherwise (a sample that misjudged the row) the function returns false and the caller runs the
// full select: exact either way.
constexpr int kSampleStride = 16;                 // slice vectors per sampled vector, at least
constexpr int kSampleRun = 8;                     // consecutive vectors of a sampled run
constexpr int kSamplePer = 8;                     // sampled keys per thread of the gather, at most
constexpr int kSampleEstCap = kCandCap * 7 / 8;   // candidates the sample may predict, at most

// Whether a row of L keys (cluster-uniform) may take the sampled path: k large enough for a
// stable sample quantile, 1.5 k candidates within the cap, and a row much longer than k.
__host__ __device__ constexpr bool sampled_path_possible(const int k) { return k >= 512 && 3 * k / 2 <= kSampleEstCap; }
__device__ __forceinline__ bool sampled_select_applies(const int L, const int k) {
  return sampled_path_possible(k) && L >= 16 * k;
}

// Step 1a: stage this CTA's share of the sample (ns vectors: runs of kSampleRun vectors, one run
// per kSampleRun * stride vectors of the slice) in samp, as keys; positions past n_local as key 0
// (the smallest). All loads in flight at once. Block-wide.
template <int kThreads, class FetchRaw>
__device__ __forceinline__ void stage_sample(uint4* samp, const int ns, const int stride, const int n_local,
                                             const int nvec, FetchRaw& fetch_raw) {
  constexpr int kVecsPer = kSamplePer / 4;
  const int tid = threadIdx.x;
  auto sample_vec = [&](int i) { return i / kSampleRun * (kSampleRun * stride) + i % kSampleRun; };
  if (nvec > 0) {
    uint4 q[kVecsPer];
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) q[j] = order_keys(fetch_raw(min(sample_vec(tid + j * kThreads), nvec - 1)));
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) {
      const int i = tid + j * kThreads, v = sample_vec(i), e0 = 4 * v;
      if (i < ns) {
        const bool in = v < nvec;
        samp[i] = make_uint4(in && e0 < n_local ? q[j].x : 0u, in && e0 + 1 < n_local ? q[j].y : 0u,
                             in && e0 + 2 < n_local ? q[j].z : 0u, in && e0 + 3 < n_local ? q[j].w : 0u);
      }
    }
  } else {
    for (int i = tid; i < ns; i += kThreads) samp[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Step 1b, after barrier (S): the whole cluster's sample (C * ns vectors, ns per CTA) into this
// thread's registers sk, vector tid + j * kThreads in sk[j] (0 past the sample). Unpredicated
// remote loads (a clamped address), masked after.
template <int kThreads>
__device__ __forceinline__ void gather_sample(const uint4* samp, const int ns, const int C,
                                              uint4 (&sk)[kSamplePer / 4]) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < kSamplePer / 4; ++j) {
    const int g = tid + j * kThreads, r = g / ns;
    const uint4 q = ld_cluster_v4(cluster_addr(samp + (r < C ? g - r * ns : 0), min(r, C - 1)));
    sk[j] = r < C ? q : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Step 3's test: whether the sampled keys matching `prefix` at `shift` are all one value (into
// t_key; x.kmin / x.kmax start at their neutral values). Block-wide; cluster-uniform (every CTA
// holds the same sample).
template <int kThreads>
__device__ __forceinline__ bool sample_one_value(const uint4 (&sk)[kSamplePer / 4], const uint32_t prefix,
                                                 const int shift, const int lane, SelectScratch<kThreads>& x,
                                                 uint32_t& t_key) {
  uint32_t mn = 0xFFFFFFFFu, mx = 0u;
#pragma unroll
  for (int j = 0; j < kSamplePer / 4; ++j) {
    const uint32_t kk[4] = {sk[j].x, sk[j].y, sk[j].z, sk[j].w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if ((kk[e] >> shift) == prefix) {
        mn = min(mn, kk[e]);
        mx = max(mx, kk[e]);
      }
  }
  mn = __reduce_min_sync(0xffffffffu, mn);
  mx = __reduce_max_sync(0xffffffffu, mx);
  if (lane == 0) {
    atomicMin(&x.kmin, mn);
    atomicMax(&x.kmax, mx);
  }
  __syncthreads();
  t_key = x.kmin;
  return t_key == x.kmax;
}

// Vectors of the sampled sweep in flight per thread.
constexpr int kSweepUnroll = 8;

// Step 3, one batch of the sweep: keys > t_key set bits of the selection bitmap (shared address
// sel_s), keys == t_key of the tie bitmap (tie_s); vector v holds bits [4 (v % 8), + 4) of word
// v / 8.
template <int kThreads>
__device__ __forceinline__ void mark_tied_batch(const uint4 (&q)[kSweepUnroll], const int v0, const uint32_t t_key,
                                                const int n_local, const uint32_t sel_s, const uint32_t tie_s) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int u = 0; u < kSweepUnroll; ++u) {
    const int v = v0 + u * kThreads + tid;
    const uint32_t valid = (1u << min(max(n_local - 4 * v, 0), 4)) - 1u;
    const uint4 key = order_keys(q[u]);
    const uint32_t kk[4] = {key.x, key.y, key.z, key.w};
    uint32_t gm = 0, em = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) gm |= (uint32_t)(kk[e] > t_key) << e;
    asm volatile("" : "+r"(gm));  // packed before the == compares (see sweep_mark in topk_cluster.cuh)
#pragma unroll
    for (int e = 0; e < 4; ++e) em |= (uint32_t)(kk[e] == t_key) << e;
    gm &= valid;
    em &= valid;
    red_or_shared_if(gm != 0, sel_s + 4 * (v >> 3), gm << (4 * (v & 7)));
    red_or_shared_if(em != 0, tie_s + 4 * (v >> 3), em << (4 * (v & 7)));
  }
}

// Step 2, one batch of the sweep: keys >= t_low -> candidates (key, position) in s.cand (past the
// cap only counted). Per key one compare of its float bits b: key(b) >= t_low <=> sortable(b) >=
// thr (signed), sortable(b) = b with the magnitude bits flipped when negative, and for t_low >=
// key(+0.0) (thr >= 0, kNonneg) simply b >= thr. Then one shared atomic per warp and batch (lane
// 31 adds the warp's total, a scan gives each lane its slots). With an atomic per thread and
// vector and keys converted on load, the sweep was bound by these visits; now by its loads.
// Marking candidates in a bitmap instead (fewer instructions, the keys read again after the
// sweep) is slower.
template <int kThreads, bool kNonneg>
__device__ __forceinline__ void collect_candidates_batch(const uint4 (&q)[kSweepUnroll], const int v0,
                                                         const int32_t thr, const int n_local, const int start,
                                                         const int lane, const SelectSmem<kThreads>& s) {
  SelectScratch<kThreads>& x = *s.x;
  const int tid = threadIdx.x;
  const bool whole = v0 + kSweepUnroll * kThreads <= n_local / 4;  // CTA-uniform: no vector to mask
  uint32_t ems = 0;  // bit 4u + e: key e of vector u is a candidate
#pragma unroll
  for (int u = 0; u < kSweepUnroll; ++u) {
    const uint32_t kk[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
    uint32_t em = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int32_t b = (int32_t)kk[e];
      const int32_t sortable = kNonneg ? b : (b ^ ((b >> 31) & 0x7FFFFFFF));
      em |= (uint32_t)(sortable >= thr) << e;
    }
    if (!whole) em &= (1u << min(max(n_local - 4 * (v0 + u * kThreads + tid), 0), 4)) - 1u;
    ems |= em << (4 * u);
  }
  const uint32_t n = (uint32_t)__popc(ems);
  const uint32_t incl = warp_inclusive_scan(n);
  const uint32_t total = __shfl_sync(0xffffffffu, incl, 31);
  if (total == 0) return;  // warp-uniform
  uint32_t base = 0;
  if (lane == 31) base = atomicAdd(&x.ncand, total);
  uint32_t slot = __shfl_sync(0xffffffffu, base, 31) + incl - n;
#pragma unroll
  for (int u = 0; u < kSweepUnroll; ++u) {
    const uint32_t kk[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
    const uint32_t pos = (uint32_t)(start + 4 * (v0 + u * kThreads + tid));
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (ems & (1u << (4 * u + e))) {
        if (slot < (uint32_t)kCandCap) s.cand[slot] = make_uint2(order_key_bits(kk[e]), pos + e);
        ++slot;
      }
  }
}

// The k (< L) largest keys of the row -> out, as cluster_select_emit, or false (cluster-uniform,
// nothing written, every CTA past a cluster barrier) when the sample does not settle the row.
// s.hist0 is not used; fetch_raw(v) returns the float bits of local positions [4v, 4v + 4) (as
// fetch of cluster_select_emit, before order_key). Any cp.async of the calling thread (the slice's
// page ids) completes inside.
template <int kThreads, class FetchRaw>
__device__ __forceinline__ bool sampled_select_emit(cg::cluster_group& cluster, const SelectSmem<kThreads> s,
                                                    const int n_local, const int start, const int chunk,
                                                    const int k, FetchRaw fetch_raw, const RowOutput& out) {
  constexpr int kSampleVecs = kThreads * kSamplePer / 4;  // cluster-wide sampled vectors, at most
  constexpr int kVecsPer = kSamplePer / 4;
  const int C = (int)cluster.num_blocks();
  const int tid = threadIdx.x, lane = tid & 31;
  SelectScratch<kThreads>& x = *s.x;
  const int nvec = (n_local + 3) / 4;
  const int nvec_chunk = chunk / 4;
  const int runs_max = kSampleVecs / C / kSampleRun;
  const int stride = max(kSampleStride, (nvec_chunk + kSampleRun * runs_max - 1) / (kSampleRun * runs_max));
  const int ns = (nvec_chunk + kSampleRun * stride - 1) / (kSampleRun * stride) * kSampleRun;  // per CTA: C * ns <= kSampleVecs
  if (ns * 16 > select_bitmap_bytes(chunk)) return false;  // (uniform) the sample is staged in the bitmaps
  const uint32_t m = (uint32_t)((3 * k + 2 * stride - 1) / (2 * stride));
  uint4* samp = reinterpret_cast<uint4*>(s.bits);
  if (tid == 0) {
    x.ncand = 0;
    x.kmin = 0xFFFFFFFFu;
    x.kmax = 0u;
  }

  // ---- 1. sample (positions past n_local as key 0, the smallest), all loads in flight at once
  stage_sample<kThreads>(samp, ns, stride, n_local, nvec, fetch_raw);
  cluster.sync();  // (S) every CTA's sample is staged
  uint4 sk[kVecsPer];
  gather_sample<kThreads>(samp, ns, C, sk);
  cluster_arrive();  // this CTA's remote reads of the samples are done (waited for before they are overwritten)
  // The sample's m-th largest key to 22 bits: two local passes of 11 bits (warp-aggregated: a
  // sample of massive ties would otherwise serialise on one bin).
  uint32_t prefix = 0, k_rem = m, count = 0;
  int shift = 32;
  int guess = -1;  // the first digit of the sample's (k / stride)-th largest key: the row's threshold's, likely
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const int dshift = pass == 0 ? 21 : 10;
    for (int i = tid; i < kBins; i += kThreads) s.hist1[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) hist_add4_matching(smem_addr(s.hist1), sk[j], prefix, shift, dshift);
    __syncthreads();
    local_threshold<kThreads>(s.hist1, kBins, k_rem, x, pass == 0 ? (uint32_t)max(k / stride, 1) : 0u);
    if (pass == 0) guess = (int)x.sel2;
    prefix = (shift == 32 ? 0u : prefix << (shift - dshift)) | x.sel[0];
    k_rem = x.sel[1];
    count = x.sel[2];
    shift = dshift;
    __syncthreads();  // x.sel is rewritten by the next pass
  }
  const uint32_t t_low = prefix << shift;
  // Sampled keys >= t_low, scaled: the candidates to expect. Past the cap: one tied value, or the
  // full select (before the slice is read).
  const bool ties = (uint64_t)(m - k_rem + count) * (uint64_t)stride > (uint64_t)kSampleEstCap;
  uint32_t t_key = 0;
  if (ties && !sample_one_value<kThreads>(sk, prefix, shift, lane, x, t_key)) {  // cluster-uniform
    cluster_wait();  // every CTA's sample reads are done (the select rewrites the bitmaps)
    return false;
  }

  // ---- 2. one sweep: visit(keys of vector v, v) for every vector of the slice, kUnroll loads in
  // flight per thread (clamped to a real vector; visit ignores v >= nvec). Nothing else is read
  // meanwhile: copying the slice's head to shared memory (cp.async or bulk copies) queues the
  // other CTAs' samples behind it in DRAM, and L2 prefetches of it stall the warps about as long
  // as the sweep then saves.
  // visit(q, v0) gets a batch: q[u] holds the float bits of vector v0 + u * kThreads + tid.
  constexpr int kUnroll = kSweepUnroll;
  auto sweep = [&](auto&& visit) {
    for (int v0 = 0; v0 < nvec; v0 += kUnroll * kThreads) {
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) q[u] = fetch_raw(min(v0 + u * kThreads + tid, nvec - 1));
      visit(q, v0);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // the caller's page ids
  };
  const int nwords = (n_local + 31) / 32;
  uint32_t* sel_bits = s.bits;
  uint32_t* tie_bits = s.bits + select_bitmap_bytes(chunk) / 8;
  auto zero_bitmaps = [&] {
    for (int i = tid; i < nwords; i += kThreads) {
      sel_bits[i] = 0;
      tie_bits[i] = 0;
    }
  };

  if (ties) {
    // ---- 3. keys > t_key selected, == t_key tied (vector v holds bits [4 (v % 8), + 4) of word v / 8)
    cluster_wait();  // the other CTAs have read this CTA's sample
    zero_bitmaps();
    __syncthreads();
    const uint32_t sel_s = smem_addr(sel_bits), tie_s = smem_addr(tie_bits);
    sweep([&](const uint4 (&q)[kUnroll], const int v0) {
      mark_tied_batch<kThreads>(q, v0, t_key, n_local, sel_s, tie_s);
    });
    __syncthreads();  // the bitmaps are complete
    const EmitCounts c = emit_counts<kThreads, true>(cluster, s, n_local, chunk);
    if (!(c.row_sel < (uint32_t)k && (uint64_t)c.row_sel + c.row_tie >= (uint64_t)k))
      return false;  // (uniform) the full select rewrites x.totals only after barriers every CTA passes
    emit_write<kThreads>(s, start, chunk, (uint32_t)k - c.row_sel, c, out);
    return true;
  }

  // ---- 2. keys >= t_low -> candidates (collect_candidates_batch), then the candidate step of the
  // select
  const int32_t thr = (int32_t)(t_low ^ 0x80000000u);
  if (thr >= 0)
    sweep([&](const uint4 (&q)[kUnroll], const int v0) {
      collect_candidates_batch<kThreads, true>(q, v0, thr, n_local, start, lane, s);
    });
  else
    sweep([&](const uint4 (&q)[kUnroll], const int v0) {
      collect_candidates_batch<kThreads, false>(q, v0, thr, n_local, start, lane, s);
    });
  cluster_wait();  // (pairs the arrive after the sample reads)
  cluster.sync();  // (C) every CTA's candidates are written
  const uint32_t total = candidate_offsets<kThreads>(C, x);
  if (total < (uint32_t)k || total > (uint32_t)kCandCap) {  // cluster-uniform
    cluster.sync();  // the other CTAs have read this CTA's candidate count
    return false;
  }
  zero_bitmaps();
  __syncthreads();
  const uint32_t k_ties =
      candidate_select_mark<kThreads>(s, C, start, n_local, total, 0u, 32, (uint32_t)k, sel_bits, tie_bits, guess);
  __syncthreads();  // the bitmaps are complete
  emit_selected<kThreads>(cluster, s, n_local, start, chunk, k_ties, out);
  return true;
}

}  // namespace dsa_topk
