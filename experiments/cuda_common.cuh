// Device helpers shared by the run-time-compiled (NVRTC) probe kernels: experiments/megakernel/layer_chain.cu
// and experiments/cluster_attention/kernel.cu. experiments/cuda_source.py puts this file in front of a
// kernel's source. No CUDA headers (NVRTC on a machine without the toolkit finds none): bf16 is its
// 16-bit pattern.

typedef unsigned short bf16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// c (16 x 8 fp32) += a (16 x 16 bf16, row-major fragment) x b (16 x 8 bf16, column fragment b0, b1)
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
