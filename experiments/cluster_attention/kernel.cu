// A probe, not a production kernel: the expert's attention, its KV-split merge and the o projection as
// ONE kernel for the denoise loop at small batch (experiments/cluster_attention/fused.py launches it;
// measured slower than the three kernels it replaces, docs/predict.md round 20).
//
// Why: in the per-kernel loop these are three dependent launches per layer-step (split-KV attention,
// merge, o), ~12.4 us of the ~34 us critical path at PhyAI batch 1, each mostly fixed latency. Here
// one thread-block cluster per (sample, head) holds SPLITS CTAs, one per slice of the keys:
//   1. before the PDL wait each CTA copies its slice of W_o (NCOLS output rows x the head's 256
//      input columns) into shared memory: weights do not depend on the predecessor;
//   2. after it: the head's query rows and the CTA's keys/values, S = Q K^T, a softmax over the
//      slice (max m, sum l), O = P V unnormalised, all in shared memory / registers;
//   3. cluster barrier; each CTA merges HD/SPLITS columns of O from every peer's shared memory
//      (distributed shared memory, no global round trip) with weights exp2(m_j - M) / L and pushes
//      the merged bf16 columns into every peer's A tile;
//   4. cluster barrier; each CTA multiplies the merged head output (rows x 256) by its W_o slice and
//      writes fp32 partials out[head, row, cols]: the o projection split over heads, which the
//      residual + AdaRMS kernel after it sums (as it sums the skinny o kernel's split-K partials).
// Shapes are compile-time (#defines prepended by the launcher): HD head dim, ROWS_PAD query rows
// padded to 16 (one warp per 16 rows; at least 4 warps, the others help with the copies and the o
// projection's columns), KEYS keys per CTA at most (multiple of 16), SPLITS CTAs per cluster,
// NCOLS o columns per CTA (WIDTH / SPLITS), HEADS, WIDTH (o output), QW = HEADS * HD (o input).
// The typedefs, pack_bf16x2, smem_u32 and mma_bf16 come from experiments/cuda_common.cuh
// (experiments/cuda_source.py puts it after the #defines and before this file).


#define MMA_WARPS (ROWS_PAD / 16)                            // one warp per 16 query rows
#define WARPS (MMA_WARPS * ((4 + MMA_WARPS - 1) / MMA_WARPS))  // at least 4: the copies and o's columns share
#define THREADS (WARPS * 32)
#define COL_GROUPS (WARPS / MMA_WARPS)                       // warps per row tile in the o projection
#define O_TILES ((NCOLS / 8 + COL_GROUPS - 1) / COL_GROUPS)  // o's 8-column tiles per warp (at most)
#define HDP (HD + 8)           // bf16 row stride of the Q/K/V/W/A tiles: 4-byte fragment loads conflict-free
#define OPS (HD + 4)           // fp32 row stride of the O partial
#define DS (HD / SPLITS)       // O columns each CTA merges
#define NEG_INF (-__int_as_float(0x7f800000))
#ifndef ROLL_K
#define ROLL_K 0  // 1: the S = Q K^T and o projection loops over K not unrolled (a smaller kernel: the probe's
#endif            // check of whether instruction fetch of the straight-line code costs time)
#if ROLL_K
#define K_UNROLL _Pragma("unroll 1")
#else
#define K_UNROLL _Pragma("unroll 4")
#endif
#ifndef LATE_W
#define LATE_W 0  // 1: W_o's slice copied after S = Q K^T into the K tile (when the early layout does not fit)
#endif
#ifndef STAMPS
#define STAMPS 0  // 1: thread 0 of each CTA records clock64 at each phase (experiments/probe_cluster_attention.py)
#endif
#define N_STAMPS 10  // 8 phase clocks, then globaltimer at the start and the end

__device__ __forceinline__ void stamp(long long* stamps, int phase) {
#if STAMPS
    if (threadIdx.x == 0) {
        long long* row = stamps + ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * N_STAMPS;
        row[phase] = clock64();
        if (phase == 0 || phase == 7) {
            long long ns;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
            row[phase == 0 ? 8 : 9] = ns;
        }
    }
#endif
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    // 16 bytes global -> shared; zero-filled when !valid (src-size 0), so masked rows read as zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ uint32_t peer_addr(const void* local, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(local)), "r"(rank));
    return r;
}

__device__ __forceinline__ float ld_peer_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ void ld_peer_f32x4(uint32_t addr, float* v) {
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(addr));
}

__device__ __forceinline__ void st_peer_u32x2(uint32_t addr, uint32_t a, uint32_t b) {
    asm volatile("st.shared::cluster.v2.u32 [%0], {%1,%2};" ::"r"(addr), "r"(a), "r"(b));
}

// Four 8 x 8 bf16 matrices from shared memory, lane L giving the address of row L % 8 of matrix L / 8
// (the HDP row stride keeps each 8-row access on distinct banks); .trans delivers their transposes.
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// The A fragment (16 x 16) of a row-major tile's rows r0.., columns k..: matrices (rows 0-7 | 8-15) x
// (columns k | k + 8) in the mma's a0..a3 order
__device__ __forceinline__ void load_a(uint32_t* a, const bf16_t* tile, int r0, int k, int lane) {
    ldsm_x4(a, tile + (r0 + (lane & 15)) * HDP + k + (lane >> 4) * 8);
}

// B fragments of two 8-column tiles n0, n0 + 8 (16 deep, from k) of a tile stored n-major with K contiguous
// (K rows for S = Q K^T, W_o rows for the o projection): b[0], b[1] for n0, b[2], b[3] for n0 + 8
__device__ __forceinline__ void load_b_pair(uint32_t* b, const bf16_t* tile, int n0, int k, int lane) {
    ldsm_x4(b, tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * HDP + k + ((lane >> 3) & 1) * 8);
}

// One warp's 16 query rows (r0..) against the CTA's key slice: S = Q K^T (KEYS / 8 n-tiles of 8 keys)
// and the slice's softmax in the exp2 domain: s becomes P, with row max m and row sum l (keys >= nkeys
// masked). The thread holds rows g (accumulator entries 0, 1) and g + 8 (2, 3).
__device__ __forceinline__ void scores_softmax(const bf16_t* sQ, const bf16_t* sK, int r0, int lane, int nkeys,
                                               float scale_log2, float (&s)[KEYS / 8][4], float (&m)[2],
                                               float (&l)[2]) {
    const int t = lane & 3;
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
K_UNROLL
    for (int k = 0; k < HD; k += 16) {
        uint32_t a[4];
        load_a(a, sQ, r0, k, lane);
#pragma unroll
        for (int n = 0; n < KEYS / 8; n += 2) {
            uint32_t b[4];
            load_b_pair(b, sK, n * 8, k, lane);
            mma_bf16(s[n], a, b[0], b[1]);
            mma_bf16(s[n + 1], a, b[2], b[3]);
        }
    }
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            bool ok = n * 8 + 2 * t + (c & 1) < nkeys;
            s[n][c] = ok ? s[n][c] * scale_log2 : NEG_INF;
            m[c >> 1] = fmaxf(m[c >> 1], s[n][c]);
        }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the row's other entries sit in the lanes with the same g
        m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffff, m[h], 1));
        m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffff, m[h], 2));
    }
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float mh = m[c >> 1];
            s[n][c] = mh == NEG_INF ? 0.f : exp2f(s[n][c] - mh);  // masked keys: exp2(-inf) = 0
            l[c >> 1] += s[n][c];
        }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
    }
}

// O = P V, unnormalised: P's accumulator layout is the A fragment of the next mma, with keys as its K.
__device__ __forceinline__ void weigh_values(const bf16_t* sV, int lane, const float (&s)[KEYS / 8][4],
                                             float (&o)[HD / 8][4]) {
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
        uint32_t a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                         pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                         pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        // V is key-major: the transposed matrices (keys 0-7 | 8-15) x (columns d | d + 8) are the B
        // fragments of the column tiles d and d + 8
        const bf16_t* v0 = sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * HDP + (lane >> 4) * 8;
#pragma unroll
        for (int d = 0; d < HD / 8; d += 2) {
            uint32_t b[4];
            ldsm_x4_trans(b, v0 + d * 8);
            mma_bf16(o[d], a, b[0], b[1]);
            mma_bf16(o[d + 1], a, b[2], b[3]);
        }
    }
}

// The CTA's key slice [k0, k0 + nkeys) of sample b's cache rows into a KEYS-row tile; rows past nkeys zero.
__device__ __forceinline__ void copy_keys(bf16_t* tile, const bf16_t* cache, int b, int slots, int k0, int nkeys,
                                          int tid) {
    for (int i = tid; i < KEYS * (HD / 8); i += THREADS) {
        int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
        bool ok = r < nkeys;
        cp_async16(tile + r * HDP + c, cache + ((size_t)b * slots + (ok ? k0 + r : 0)) * HD + c, ok);
    }
}

// The CTA's W_o slice (NCOLS output rows x the head's HD input columns) into sW.
__device__ __forceinline__ void copy_w(bf16_t* sW, const bf16_t* w_src, int tid) {
    for (int i = tid; i < NCOLS * (HD / 8); i += THREADS) {
        int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
        cp_async16(sW + r * HDP + c, w_src + (size_t)r * QW + c, true);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS) cluster_attention_o(
    const bf16_t* __restrict__ q,        // (B, T, HEADS, HD): the RoPE'd queries
    const bf16_t* __restrict__ k_cache,  // (B, SLOTS, 1, HD)
    const bf16_t* __restrict__ v_cache,  // (B, SLOTS, 1, HD)
    const bf16_t* __restrict__ w_o,      // (WIDTH, QW)
    const int* __restrict__ key_len,     // (B,): sample b attends to keys [0, key_len[b])
    float* __restrict__ out,             // (HEADS, B * T, WIDTH): per-head partials of the o projection
    int T, int SLOTS, float scale_log2, long long* stamps) {
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* sQ = (bf16_t*)smem;                                 // ROWS_PAD x HDP
    bf16_t* sK = sQ + ROWS_PAD * HDP;                           // KEYS x HDP
    bf16_t* sV = sK + KEYS * HDP;                               // KEYS x HDP
#if LATE_W  // W_o's slice over sK once S is computed, the merged output over sQ, the O partial over sV
    bf16_t* sW = sK;
    float* sM = (float*)(sV + KEYS * HDP);
    float* sO = (float*)sV;
    bf16_t* sA = sQ;
#else       // W_o's slice in its own tile (copied before the PDL wait), O over sQ + sK, the merged output over sV
    bf16_t* sW = sV + KEYS * HDP;                               // NCOLS x HDP
    float* sM = (float*)(sW + NCOLS * HDP);
    float* sO = (float*)smem;                                   // ROWS_PAD x OPS
    bf16_t* sA = sV;                                            // ROWS_PAD x HDP
#endif
    float* sL = sM + ROWS_PAD;                                  // ROWS_PAD: this CTA's row sum (sM: row max)
    float* sWt = sL + ROWS_PAD;                                 // SPLITS x ROWS_PAD merge weights
    float* sMall = sWt + SPLITS * ROWS_PAD;                     // SPLITS x ROWS_PAD: every peer's row max
    float* sLall = sMall + SPLITS * ROWS_PAD;                   // ... and row sum

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t split = cluster_rank();
    const int head = blockIdx.y, b = blockIdx.z;
    const int M = gridDim.z * T;
    stamp(stamps, 0);

    // 1. this CTA's W_o slice, before the PDL wait (weights never depend on the predecessor): into shared
    //    memory, or (LATE_W, no room yet) into L2, 128-byte lines
    const bf16_t* w_src = w_o + (size_t)(split * NCOLS) * QW + head * HD;
#if LATE_W
    for (int i = tid; i < NCOLS * (HD / 64); i += THREADS)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w_src + (size_t)(i / (HD / 64)) * QW + (i % (HD / 64)) * 64));
#else
    copy_w(sW, w_src, tid);
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stamp(stamps, 1);

    // 2. queries, this CTA's keys and values
    const int len = key_len[b];
    const int chunk = (len + SPLITS - 1) / SPLITS;  // <= KEYS: len <= SLOTS (host check)
    const int k0 = split * chunk;
    const int nkeys = min(max(len - k0, 0), chunk);
    for (int i = tid; i < ROWS_PAD * (HD / 8); i += THREADS) {
        int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
        bool ok = r < T;
        cp_async16(sQ + r * HDP + c, q + ((size_t)(b * T + (ok ? r : 0)) * HEADS + head) * HD + c, ok);
    }
    copy_keys(sK, k_cache, b, SLOTS, k0, nkeys, tid);
    asm volatile("cp.async.commit_group;" ::: "memory");
    copy_keys(sV, v_cache, b, SLOTS, k0, nkeys, tid);  // V lands while S = Q K^T is computed
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 1;" ::: "memory");
    __syncthreads();
    stamp(stamps, 2);

    // S = Q K^T, softmax and O = P V for this warp's 16 rows (warps past MMA_WARPS only copied)
    const int r0 = (warp % MMA_WARPS) * 16;
    float s[KEYS / 8][4], o[HD / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    if (warp < MMA_WARPS) scores_softmax(sQ, sK, r0, lane, nkeys, scale_log2, s, m, l);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // V is in; every warp is done with sK (LATE_W: the W_o slice goes there)
#if LATE_W
    copy_w(sW, w_src, tid);
#endif
    if (warp < MMA_WARPS) weigh_values(sV, lane, s, o);
    __syncthreads();  // every warp is done with sQ, sK and sV: sO goes over them
    stamp(stamps, 3);
    if (warp < MMA_WARPS) {
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            float* p = sO + (r0 + g) * OPS + d * 8 + 2 * t;
            p[0] = o[d][0];
            p[1] = o[d][1];
            p[8 * OPS] = o[d][2];
            p[8 * OPS + 1] = o[d][3];
        }
        if (t == 0) {
            sM[r0 + g] = m[0];
            sM[r0 + g + 8] = m[1];
            sL[r0 + g] = l[0];
            sL[r0 + g + 8] = l[1];
        }
    }
    cluster_sync();  // every CTA's m, l and O are in its shared memory (and sV is free for sA)
    stamp(stamps, 4);

    // 3. merge: every peer's row max and sum (one remote load each, all in flight), the weights
    //    w_j = exp2(m_j - max_j m_j) / sum_j w_j l_j per row, then this CTA's DS columns
#pragma unroll
    for (int p0 = 0; p0 < SPLITS * ROWS_PAD; p0 += THREADS) {
        const int p = p0 + tid, j = p / ROWS_PAD, i = p % ROWS_PAD;
        if (p < SPLITS * ROWS_PAD) {
            sMall[p] = ld_peer_f32(peer_addr(sM + i, j));
            sLall[p] = ld_peer_f32(peer_addr(sL + i, j));
        }
    }
    __syncthreads();
    for (int i = tid; i < ROWS_PAD; i += THREADS) {
        float mx = NEG_INF, total = 0.f;
#pragma unroll
        for (int j = 0; j < SPLITS; ++j) mx = fmaxf(mx, sMall[j * ROWS_PAD + i]);
#pragma unroll
        for (int j = 0; j < SPLITS; ++j) {
            float mj = sMall[j * ROWS_PAD + i];
            float w = mj == NEG_INF ? 0.f : exp2f(mj - mx);
            sWt[j * ROWS_PAD + i] = w;
            total += w * sLall[j * ROWS_PAD + i];
        }
        float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
        for (int j = 0; j < SPLITS; ++j) sWt[j * ROWS_PAD + i] *= inv;
    }
    __syncthreads();
    for (int i = tid; i < ROWS_PAD * (DS / 4); i += THREADS) {
        int r = i / (DS / 4), c = split * DS + (i % (DS / 4)) * 4;
        float v[SPLITS][4], acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < SPLITS; ++j) ld_peer_f32x4(peer_addr(sO + r * OPS + c, j), v[j]);
#pragma unroll
        for (int j = 0; j < SPLITS; ++j) {
            float w = sWt[j * ROWS_PAD + r];
            acc[0] += w * v[j][0];
            acc[1] += w * v[j][1];
            acc[2] += w * v[j][2];
            acc[3] += w * v[j][3];
        }
        uint32_t lo = pack_bf16x2(acc[0], acc[1]), hi = pack_bf16x2(acc[2], acc[3]);
#pragma unroll
        for (int j = 0; j < SPLITS; ++j) st_peer_u32x2(peer_addr(sA + r * HDP + c, j), lo, hi);
    }
    stamp(stamps, 5);
#if LATE_W
    cp_async_wait_all();  // this thread's W_o copies; the barrier makes everyone's visible
#endif
    cluster_sync();  // every CTA's sA holds the whole merged head output; no peer reads sO any more
    stamp(stamps, 6);

    // 4. o projection: 16 rows (warp % MMA_WARPS) x the 8-column tiles cg * O_TILES .. + O_TILES - 1 of the
    //    CTA's NCOLS columns (cg = warp / MMA_WARPS), K = the head's HD columns
    const int n_first = (warp / MMA_WARPS) * O_TILES;
    float acc[O_TILES][4];
#pragma unroll
    for (int j = 0; j < O_TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
K_UNROLL
    for (int k = 0; k < HD; k += 16) {
        uint32_t a[4];
        load_a(a, sA, r0, k, lane);
#pragma unroll
        for (int j = 0; j < O_TILES; j += 2) {
            const int n = n_first + j;
            if (j + 1 < O_TILES && n + 1 < NCOLS / 8) {
                uint32_t b[4];
                load_b_pair(b, sW, n * 8, k, lane);
                mma_bf16(acc[j], a, b[0], b[1]);
                mma_bf16(acc[j + 1], a, b[2], b[3]);
            } else if (n < NCOLS / 8) {
                const bf16_t* p = sW + (n * 8 + g) * HDP + k + 2 * t;
                mma_bf16(acc[j], a, *(const uint32_t*)p, *(const uint32_t*)(p + 8));
            }
        }
    }
    float* dst = out + ((size_t)head * M + b * T) * WIDTH + split * NCOLS;
    const int ra = r0 + g, rb = r0 + g + 8;
#pragma unroll
    for (int j = 0; j < O_TILES; ++j) {
        const int n = n_first + j, col = n * 8 + 2 * t;
        if (n >= NCOLS / 8) continue;
        if (ra < T) *(float2*)(dst + (size_t)ra * WIDTH + col) = make_float2(acc[j][0], acc[j][1]);
        if (rb < T) *(float2*)(dst + (size_t)rb * WIDTH + col) = make_float2(acc[j][2], acc[j][3]);
    }
    stamp(stamps, 7);
}
