// A probe, not a production kernel: the GEMM chain of pi0.5's action-expert layers (qkv, o,
// gate_up + GeGLU, down, with the residual + AdaRMS norms between them) as ONE persistent CUDA
// kernel, to measure what the hand-written megakernel route could give the batch-1 denoise loop.
//
// What it does differently from the per-kernel loop and round 3's persistent Triton kernel:
// - each CTA owns one tile of every GEMM phase; its weight tile is brought into shared memory by one
//   bulk copy (cp.async.bulk + mbarrier) issued as soon as the buffer is free, i.e. one or two phases
//   BEFORE the phase's inputs exist, so HBM streams weights while the dependency chain runs;
// - phases wait on per-phase counters (release add / acquire poll), not grid barriers; only the
//   activations (a few KB per tile, from L2) are on the critical path after the wait;
// - operands are pre-swizzled in global memory (16-byte units XOR row & 7) so one bulk copy fills a
//   bank-conflict-free shared-memory tile; activations are stored chunk-major (64 columns a chunk).
// The attention is NOT here: phase 1 stands in for RoPE + attention + merge (it copies q's columns
// out of the qkv partials), so this times the layer minus attention.
//
// Compile-time shape (pi0.5 expert): D 1024, qkv 2560 (q 2048 + k 256 + v 256), F 4096; rows <= 64.
// The typedefs, pack_bf16x2, smem_u32 and mma_bf16 come from experiments/cuda_common.cuh
// (experiments/cuda_source.py puts it in front of this file).

__device__ __forceinline__ bf16_t to_bf16(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

#define D 1024
#define QKV_N 2560
#define ATT_N 2048
#define F 4096
#define ROWS 64          // mma rows (4 m16 tiles); rows >= M are never written and stay zero
#define CHUNK 64         // activation columns per chunk (128-byte rows, 8 swizzle units)
#define CHUNK_BYTES (ROWS * CHUNK * 2)
#define X_STAGES 4
#define THREADS 256
#define PHASES 7

// phase tiles: N columns in tiles of TN, K in S splits of KR; tile t = n_tile * S + split
#define Q_TN 80
#define Q_KR 256
#define Q_S 4
#define O_TN 64
#define O_KR 256
#define O_S 8
#define G_TN 64      // 32 (gate, up) row pairs, interleaved
#define G_KR 1024
#define DN_TN 64
#define DN_KR 512
#define DN_S 8
#define TILES 128    // every GEMM phase has 128 tiles

#define BUF_A_BYTES (G_TN * G_KR * 2)   // qkv / gate_up weight tiles (131072)
#define BUF_B_BYTES (DN_TN * DN_KR * 2) // o / down weight tiles (65536)
#define SMEM_BYTES (BUF_A_BYTES + BUF_B_BYTES + X_STAGES * CHUNK_BYTES)

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred P1;\n"
        "LAB_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
        "@P1 bra DONE;\n\t"
        "bra LAB_WAIT;\n"
        "DONE:\n\t}" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// one bulk copy global -> shared, completing `bytes` on `bar` (the caller set expect_tx)
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void load_async(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    mbar_expect(bar, bytes);
    bulk_copy(dst, src, bytes, bar);
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// 32-bit word index of element (row, k) in a swizzled row-major tile whose rows are `row_words` words
// (16-byte unit u of row r lives at unit u ^ (r & 7))
__device__ __forceinline__ int swz_word(int row, int k, int row_words) {
    return row * row_words + ((((k >> 3) ^ (row & 7))) << 2) + ((k & 7) >> 1);
}

// element offset of (row, col) in a chunk-major swizzled activation (chunks of ROWS x CHUNK)
__device__ __forceinline__ int act_offset(int row, int col) {
    int chunk = col / CHUNK, c = col % CHUNK;
    return chunk * ROWS * CHUNK + row * CHUNK + ((((c >> 3) ^ (row & 7))) << 3) + (c & 7);
}

struct Args {
    const bf16_t *wq, *wo, *wgu, *wd;  // packed tiles, all layers
    const float* mod;                         // (layers, 2 norms, 3 [scale, shift, gate], D)
    bf16_t *xa, *att, *xm, *g;         // chunk-major activations
    float *pq, *po, *pd, *h;                  // split-K partials; residual (ROWS, D)
    uint32_t* counters;                       // (layers, PHASES), zero at launch
    long long* clocks;                        // (grid, layers, PHASES, 3) or null
    int M, layers, prefetch;
    bool no_waits, no_work;
};

struct Pipe {  // per-CTA state, the same in every thread
    uint64_t* w_bar;   // [2]: buffer A, buffer B
    uint64_t* x_bar;   // [X_STAGES]
    unsigned char* buf_a;
    unsigned char* buf_b;
    unsigned char* x_ring;
    uint32_t x_seq;    // chunks consumed so far (stage and parity of the next one)
};

__device__ __forceinline__ void wait_phase(const Args& a, const uint32_t* counter, uint32_t target) {
    if (threadIdx.x == 0 && !a.no_waits) {
        while (ld_acquire(counter) < target) {
        }
        // the activations read next by bulk copies were written through the generic proxy
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __syncthreads();
}

__device__ __forceinline__ void signal_phase(uint32_t* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
    }
}

__device__ __forceinline__ void stamp(const Args& a, int layer, int phase, int which) {
    if (a.clocks != nullptr && threadIdx.x == 0)
        a.clocks[((blockIdx.x * a.layers + layer) * PHASES + phase) * 3 + which] = clock64();
}

// Weight tile `tile` of a phase into a buffer (only CTAs that own a tile)
__device__ __forceinline__ void fetch_weights(const Args& a, const bf16_t* w_layer, int tile_bytes,
                                              unsigned char* buf, uint64_t* bar) {
    if (threadIdx.x == 0 && blockIdx.x < TILES && !a.no_work) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        load_async(buf, reinterpret_cast<const unsigned char*>(w_layer) + (size_t)blockIdx.x * tile_bytes,
                   tile_bytes, bar);
    }
}

// out (ROWS x TN) += x (ROWS x KR, chunks from global) @ Wtile^T (TN x KR in `wbuf`).
// Warp w: rows (w & 3) * 16, columns (w >> 2) * TN / 2, J = TN / 16 n8 blocks.
template <int TN, int KR>
__device__ __forceinline__ void gemm_tile(Pipe& p, const bf16_t* x_chunks, const unsigned char* wbuf,
                                          float (*acc)[4], int M) {
    // only the M valid rows are copied (contiguous at each chunk's start); the rows past them hold
    // stale shared memory, which reaches only the accumulator rows that are never stored
    const uint32_t x_bytes = (uint32_t)M * CHUNK * 2;
    constexpr int J = TN / 16;
    constexpr int NCH = KR / CHUNK;
    constexpr int W_ROW_WORDS = KR / 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * (TN / 2);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wbuf);
#pragma unroll
    for (int j = 0; j < J; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const uint32_t first = p.x_seq;
    if (threadIdx.x == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        for (int c = 0; c < NCH && c < X_STAGES; ++c) {
            uint32_t s = (first + c) % X_STAGES;
            load_async(p.x_ring + s * CHUNK_BYTES, x_chunks + (size_t)c * ROWS * CHUNK, x_bytes, &p.x_bar[s]);
        }
    }
    for (int c = 0; c < NCH; ++c) {
        const uint32_t seq = first + c, s = seq % X_STAGES;
        mbar_wait(&p.x_bar[s], (seq / X_STAGES) & 1);
        const uint32_t* x = reinterpret_cast<const uint32_t*>(p.x_ring + s * CHUNK_BYTES);
#pragma unroll
        for (int kk = 0; kk < CHUNK; kk += 16) {
            uint32_t a[4];
            a[0] = x[swz_word(m0 + g, kk + 2 * t, CHUNK / 2)];
            a[1] = x[swz_word(m0 + g + 8, kk + 2 * t, CHUNK / 2)];
            a[2] = x[swz_word(m0 + g, kk + 8 + 2 * t, CHUNK / 2)];
            a[3] = x[swz_word(m0 + g + 8, kk + 8 + 2 * t, CHUNK / 2)];
            const int k = c * CHUNK + kk + 2 * t;
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const int n = n0 + j * 8 + g;
                mma_bf16(acc[j], a, w[swz_word(n, k, W_ROW_WORDS)], w[swz_word(n, k + 8, W_ROW_WORDS)]);
            }
        }
        __syncthreads();  // every warp is done with this stage
        if (threadIdx.x == 0 && c + X_STAGES < NCH) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            load_async(p.x_ring + s * CHUNK_BYTES, x_chunks + (size_t)(c + X_STAGES) * ROWS * CHUNK, x_bytes,
                       &p.x_bar[s]);
        }
    }
    p.x_seq = first + NCH;
}

// split-K partial tile -> out[split] (ROWS x N fp32), rows < M
template <int TN>
__device__ __forceinline__ void store_partial(float (*acc)[4], float* out, int N, int col0, int M) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = (warp & 3) * 16 + g;
    const int c0 = col0 + (warp >> 2) * (TN / 2) + 2 * t;
#pragma unroll
    for (int j = 0; j < TN / 16; ++j) {
        const int col = c0 + j * 8;
        if (r0 < M) __stcg(reinterpret_cast<float2*>(out + (size_t)r0 * N + col), make_float2(acc[j][0], acc[j][1]));
        if (r0 + 8 < M)
            __stcg(reinterpret_cast<float2*>(out + (size_t)(r0 + 8) * N + col), make_float2(acc[j][2], acc[j][3]));
    }
}

// One split-K GEMM phase's tile: tile t = n_tile * S + split of x (chunk-major, K slice split) @ the
// weight tile waiting in `wbuf` (its mbarrier at `parity`), stored as split's fp32 partial of out (S, ROWS, N)
template <int TN, int KR, int S>
__device__ __forceinline__ void split_k_tile(Pipe& p, int tile, const bf16_t* x, unsigned char* wbuf,
                                             uint64_t* w_bar, uint32_t parity, float* out, int N, float (*acc)[4],
                                             int M) {
    const int split = tile % S, n_tile = tile / S;
    mbar_wait(w_bar, parity);
    gemm_tile<TN, KR>(p, x + (size_t)(split * KR / CHUNK) * ROWS * CHUNK, wbuf, acc, M);
    store_partial<TN>(acc, out + (size_t)split * ROWS * N, N, n_tile * TN, M);
}

__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// gate/up pairs interleaved in the tile's columns: (c0, c1) is (gate, up) of one feature
__device__ __forceinline__ void store_geglu(float (*acc)[4], bf16_t* g_act, int pair0, int M) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = (warp & 3) * 16 + g;
    const int p0 = pair0 + (warp >> 2) * (G_TN / 4) + t;
#pragma unroll
    for (int j = 0; j < G_TN / 16; ++j) {
        const int f = p0 + j * 4;
        if (r0 < M) g_act[act_offset(r0, f)] = to_bf16(gelu_tanh(acc[j][0]) * acc[j][1]);
        if (r0 + 8 < M) g_act[act_offset(r0 + 8, f)] = to_bf16(gelu_tanh(acc[j][2]) * acc[j][3]);
    }
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) s += scratch[w];
    __syncthreads();
    return s;
}

// h[r] += gate * sum(partials[r]); x[r] = AdaRMS(h[r]) (bf16, chunk-major); one row per CTA
template <int SPLITS>
__device__ void add_norm_rows(const Args& a, const float* parts, const float* mod, bf16_t* x_out,
                              float* scratch) {
    const int c = threadIdx.x * 4;
    const float4 scale = *reinterpret_cast<const float4*>(mod + c);
    const float4 shift = *reinterpret_cast<const float4*>(mod + D + c);
    const float4 gate = *reinterpret_cast<const float4*>(mod + 2 * D + c);
    for (int r = blockIdx.x; r < a.M; r += gridDim.x) {
        float4 y = __ldcg(reinterpret_cast<const float4*>(parts + (size_t)r * D + c));
#pragma unroll
        for (int s = 1; s < SPLITS; ++s) {
            float4 v = __ldcg(reinterpret_cast<const float4*>(parts + ((size_t)s * ROWS + r) * D + c));
            y.x += v.x; y.y += v.y; y.z += v.z; y.w += v.w;
        }
        float4 h = *reinterpret_cast<float4*>(a.h + (size_t)r * D + c);
        h.x += gate.x * y.x; h.y += gate.y * y.y; h.z += gate.z * y.z; h.w += gate.w * y.w;
        *reinterpret_cast<float4*>(a.h + (size_t)r * D + c) = h;
        const float ss = block_sum(h.x * h.x + h.y * h.y + h.z * h.z + h.w * h.w, scratch);
        const float rstd = rsqrtf(ss / D + 1e-6f);
        const uint2 packed = make_uint2(
            pack_bf16x2(h.x * rstd * (1.f + scale.x) + shift.x, h.y * rstd * (1.f + scale.y) + shift.y),
            pack_bf16x2(h.z * rstd * (1.f + scale.z) + shift.z, h.w * rstd * (1.f + scale.w) + shift.w));
        __stcg(reinterpret_cast<uint2*>(x_out + act_offset(r, c)), packed);
    }
}

// stand-in for RoPE + attention + merge: att[r] = bf16(sum over qkv splits of q's columns)
__device__ void attention_stand_in(const Args& a) {
    const int c = threadIdx.x * 8;
    for (int r = blockIdx.x; r < a.M; r += gridDim.x) {
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int s = 0; s < Q_S; ++s) {
            const float* src = a.pq + ((size_t)s * ROWS + r) * QKV_N + c;
            float4 u0 = __ldcg(reinterpret_cast<const float4*>(src));
            float4 u1 = __ldcg(reinterpret_cast<const float4*>(src + 4));
            v[0] += u0.x; v[1] += u0.y; v[2] += u0.z; v[3] += u0.w;
            v[4] += u1.x; v[5] += u1.y; v[6] += u1.z; v[7] += u1.w;
        }
        uint4 out;
        uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
        __stcg(reinterpret_cast<uint4*>(a.att + act_offset(r, c)), out);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    layer_chain(const bf16_t* wq, const bf16_t* wo, const bf16_t* wgu, const bf16_t* wd,
                const float* mod, bf16_t* xa, bf16_t* att, bf16_t* xm, bf16_t* g,
                float* pq, float* po, float* pd, float* h, uint32_t* counters, long long* clocks, int use_clocks,
                int M, int layers, int flags) {
    // flags: 1 = weight prefetch (else each tile is fetched after its phase's wait);
    //        2 = no waits (profiling only: the phases race and the results are garbage);
    //        4 = no work, only the waits and signals (profiling only: the chain's sync latency)
    const Args a{wq, wo, wgu, wd, mod, xa, att, xm, g, pq, po, pd, h, counters, use_clocks ? clocks : nullptr,
                 M, layers, flags & 1, (flags & 2) != 0, (flags & 4) != 0};
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[2 + X_STAGES];
    __shared__ float scratch[THREADS / 32];
    Pipe p;
    p.w_bar = bars;
    p.x_bar = bars + 2;
    p.buf_a = smem;
    p.buf_b = smem + BUF_A_BYTES;
    p.x_ring = smem + BUF_A_BYTES + BUF_B_BYTES;
    p.x_seq = 0;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 2 + X_STAGES; ++i) mbar_init(&bars[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const bool owner = blockIdx.x < TILES && !a.no_work;
    const int tile = blockIdx.x;
    const size_t q_layer = (size_t)QKV_N * D, o_layer = (size_t)D * ATT_N, g_layer = (size_t)2 * F * D,
                 d_layer = (size_t)D * F;
    constexpr int Q_BYTES = Q_TN * Q_KR * 2, O_BYTES = O_TN * O_KR * 2, G_BYTES = G_TN * G_KR * 2,
                  D_BYTES = DN_TN * DN_KR * 2;
    float acc[5][4];
    if (a.prefetch) {
        fetch_weights(a, a.wq, Q_BYTES, p.buf_a, &p.w_bar[0]);
        fetch_weights(a, a.wo, O_BYTES, p.buf_b, &p.w_bar[1]);
    }
    for (int layer = 0; layer < a.layers; ++layer) {
        uint32_t* cnt = a.counters + layer * PHASES;
        const float* mod = a.mod + (size_t)layer * 6 * D;
        const uint32_t use = 2 * layer;  // w_bar parities: A and B are each used twice a layer
        // phase 0: qkv partials (x_a from the previous layer's phase 6)
        stamp(a, layer, 0, 0);
        if (layer > 0) wait_phase(a, a.counters + (layer - 1) * PHASES + 6, gridDim.x);
        if (!a.prefetch) fetch_weights(a, a.wq + layer * q_layer, Q_BYTES, p.buf_a, &p.w_bar[0]);
        stamp(a, layer, 0, 1);
        if (owner)
            split_k_tile<Q_TN, Q_KR, Q_S>(p, tile, a.xa, p.buf_a, &p.w_bar[0], use & 1, a.pq, QKV_N, acc, a.M);
        signal_phase(&cnt[0]);
        if (a.prefetch) fetch_weights(a, a.wgu + layer * g_layer, G_BYTES, p.buf_a, &p.w_bar[0]);
        stamp(a, layer, 0, 2);
        // phase 1: attention stand-in
        stamp(a, layer, 1, 0);
        wait_phase(a, &cnt[0], gridDim.x);
        stamp(a, layer, 1, 1);
        if (!a.no_work) attention_stand_in(a);
        signal_phase(&cnt[1]);
        stamp(a, layer, 1, 2);
        // phase 2: o partials
        stamp(a, layer, 2, 0);
        wait_phase(a, &cnt[1], gridDim.x);
        if (!a.prefetch) fetch_weights(a, a.wo + layer * o_layer, O_BYTES, p.buf_b, &p.w_bar[1]);
        stamp(a, layer, 2, 1);
        if (owner)
            split_k_tile<O_TN, O_KR, O_S>(p, tile, a.att, p.buf_b, &p.w_bar[1], use & 1, a.po, D, acc, a.M);
        signal_phase(&cnt[2]);
        if (a.prefetch) fetch_weights(a, a.wd + layer * d_layer, D_BYTES, p.buf_b, &p.w_bar[1]);
        stamp(a, layer, 2, 2);
        // phase 3: residual + AdaRMS before the MLP
        stamp(a, layer, 3, 0);
        wait_phase(a, &cnt[2], gridDim.x);
        stamp(a, layer, 3, 1);
        if (!a.no_work) add_norm_rows<O_S>(a, a.po, mod, a.xm, scratch);
        signal_phase(&cnt[3]);
        stamp(a, layer, 3, 2);
        // phase 4: gate_up + GeGLU
        stamp(a, layer, 4, 0);
        wait_phase(a, &cnt[3], gridDim.x);
        if (!a.prefetch) fetch_weights(a, a.wgu + layer * g_layer, G_BYTES, p.buf_a, &p.w_bar[0]);
        stamp(a, layer, 4, 1);
        if (owner) {
            mbar_wait(&p.w_bar[0], (use + 1) & 1);
            gemm_tile<G_TN, G_KR>(p, a.xm, p.buf_a, acc, a.M);
            store_geglu(acc, a.g, tile * (G_TN / 2), a.M);
        }
        signal_phase(&cnt[4]);
        if (a.prefetch && layer + 1 < a.layers)
            fetch_weights(a, a.wq + (layer + 1) * q_layer, Q_BYTES, p.buf_a, &p.w_bar[0]);
        stamp(a, layer, 4, 2);
        // phase 5: down partials
        stamp(a, layer, 5, 0);
        wait_phase(a, &cnt[4], gridDim.x);
        if (!a.prefetch) fetch_weights(a, a.wd + layer * d_layer, D_BYTES, p.buf_b, &p.w_bar[1]);
        stamp(a, layer, 5, 1);
        if (owner)
            split_k_tile<DN_TN, DN_KR, DN_S>(p, tile, a.g, p.buf_b, &p.w_bar[1], (use + 1) & 1, a.pd, D, acc,
                                             a.M);
        signal_phase(&cnt[5]);
        if (a.prefetch && layer + 1 < a.layers)
            fetch_weights(a, a.wo + (layer + 1) * o_layer, O_BYTES, p.buf_b, &p.w_bar[1]);
        stamp(a, layer, 5, 2);
        // phase 6: residual + AdaRMS before the next layer's qkv
        stamp(a, layer, 6, 0);
        wait_phase(a, &cnt[5], gridDim.x);
        stamp(a, layer, 6, 1);
        if (!a.no_work) add_norm_rows<DN_S>(a, a.pd, mod + 3 * D, a.xa, scratch);
        signal_phase(&cnt[6]);
        stamp(a, layer, 6, 2);
    }
}
