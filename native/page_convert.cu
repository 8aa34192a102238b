// Fused dtype conversion between bf16/fp16 device pages and fp8 + fp32-scale host records.
//
// Owns the two converting copies of kvtier's CUDA engine:
//   upcast_pages_*   reload: host fp8 record (+ its scales) -> bf16/fp16 device pages,
//                    dequant = float(q) * scale, rounded to nearest even, in one pass;
//   quantize_pages_* offload: bf16/fp16 device pages -> amax per scale group ->
//                    scale = amax / fp8_max (1 where amax == 0) ->
//                    q = clamp(x / scale, +-fp8_max) rounded to nearest even fp8,
//                    written with the scales straight into the pinned host record.
// Both match kvtier/format/codec.py bit for bit (quantized bytes, scales, dequantized
// values) as the codec computes on the CPU, for every granularity and layout. It must never
// choose a dtype, granularity or which pages move: the engine passes all of that in.
//
// Conversions use the hardware cvt instructions through inline PTX: exactly what
// cuda_fp8.h's __nv_cvt_* and cuda_bf16.h's __float2bfloat16_rn compile to, but with no
// header, so NVRTC builds this file without locating the CUDA include directory.
// cvt.rn.satfinite.{e4m3,e5m2}x2.f32 and cvt.rn.f16x2.{e4m3,e5m2}x2 need sm_89 or newer;
// the engine loads this module only there. Division and products are IEEE (the module
// is compiled with --prec-div=true --ftz=false --fmad=false): no reciprocal, no flush.
//
// Scale groups (see codec._reduce_dims): a plane holds `groups_per_piece` groups, group g
// starting at element g * group_stride and made of `seg_count` runs of `seg_len`
// contiguous elements, `seg_stride` apart. Group g's scale is the g-th fp32 of the
// plane's scale block, which is the scale_shape order of page_format.py. For upcast the
// scale of element e is (e / scale_div) % scale_mod.
//
// Launch: 1-D grid, 256 threads, grid-stride. Quantize: a team of `team_size` lanes (a
// power of two <= 32, so a team never straddles a warp) owns one scale group: amax by a
// team shuffle reduction, then the team rereads its group (an L2 hit) and stores fp8.
// Upcast: one thread per VEC elements, no reduction needed. VEC is 16 (16 fp8 bytes =
// one 16-byte PCIe transaction per thread) when every group run and plane is a multiple
// of 16 elements, else 1.

#define KVTIER_THREADS 256
#define KVTIER_UNROLL 2

__device__ __forceinline__ float bf16_to_float(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}

__device__ __forceinline__ float f16_to_float(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

template <bool IN_BF16>
__device__ __forceinline__ float wide_to_float(unsigned short bits) {
    return IN_BF16 ? bf16_to_float(bits) : f16_to_float(bits);
}

// Two floats -> two packed bf16/fp16 (lo in the low half: the lower address).
template <bool OUT_BF16>
__device__ __forceinline__ unsigned int float2_to_wide2(float lo, float hi) {
    unsigned int packed;
    if (OUT_BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    }
    return packed;
}

// Two floats -> two fp8 bytes, saturating to +-max (lo in the low byte).
template <bool E4M3>
__device__ __forceinline__ unsigned int float2_to_fp8x2(float lo, float hi) {
    unsigned short packed;
    if (E4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    }
    return packed;
}

// Two fp8 bytes (low byte first) -> two floats, exactly (every fp8 value is an fp16 value).
template <bool E4M3>
__device__ __forceinline__ void fp8x2_to_float2(unsigned int two_bytes, float& lo, float& hi) {
    unsigned int halves;
    const unsigned short packed = (unsigned short)two_bytes;
    if (E4M3) {
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(packed));
    } else {
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(halves) : "h"(packed));
    }
    lo = f16_to_float((unsigned short)(halves & 0xFFFFu));
    hi = f16_to_float((unsigned short)(halves >> 16));
}

// ---- reload: fp8 + scales -> bf16/fp16 ------------------------------------------------

template <bool E4M3, bool OUT_BF16, int VEC>
__device__ __forceinline__ void upcast_pages_body(
    const unsigned char* __restrict__ host_data, const unsigned char* __restrict__ host_scales,
    unsigned short* __restrict__ dev_pages,
    const long long* __restrict__ host_slots, const long long* __restrict__ dev_slots,
    long long num_pages, long long num_pieces, long long plane_elems,
    long long host_slot_stride, long long host_data_piece_stride, long long host_scale_piece_stride,
    long long dev_slot_stride, long long dev_piece_stride,
    long long scale_div, long long scale_mod) {
    const long long chunks_per_piece = plane_elems / VEC;
    const long long chunks_per_page = chunks_per_piece * num_pieces;
    const long long total = chunks_per_page * num_pages;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x; first < total;
         first += stride * KVTIER_UNROLL) {
        uint4 raw[KVTIER_UNROLL];
        float scale[KVTIER_UNROLL];
        long long out_at[KVTIER_UNROLL];
#pragma unroll
        for (int k = 0; k < KVTIER_UNROLL; ++k) {
            const long long unit = first + k * stride;
            out_at[k] = -1;
            if (unit < total) {
                const long long page = unit / chunks_per_page;
                const long long in_page = unit - page * chunks_per_page;
                const long long piece = in_page / chunks_per_piece;
                const long long elem = (in_page - piece * chunks_per_piece) * VEC;
                const long long record = host_slots[page] * host_slot_stride;
                const unsigned char* src = host_data + record + piece * host_data_piece_stride + elem;
                const long long scale_index = (elem / scale_div) % scale_mod;
                scale[k] = *reinterpret_cast<const float*>(
                    host_scales + record + piece * host_scale_piece_stride + scale_index * 4);
                if (VEC == 16) {
                    raw[k] = *reinterpret_cast<const uint4*>(src);
                } else {
                    raw[k].x = *src;
                }
                out_at[k] = dev_slots[page] * dev_slot_stride + piece * dev_piece_stride + elem;
            }
        }
#pragma unroll
        for (int k = 0; k < KVTIER_UNROLL; ++k) {
            if (out_at[k] < 0) {
                continue;
            }
            if (VEC == 16) {
                const unsigned int in_words[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
                unsigned int out_words[8];
#pragma unroll
                for (int w = 0; w < 4; ++w) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float lo, hi;
                        fp8x2_to_float2<E4M3>(in_words[w] >> (16 * h), lo, hi);
                        out_words[2 * w + h] = float2_to_wide2<OUT_BF16>(lo * scale[k], hi * scale[k]);
                    }
                }
                uint4* dst = reinterpret_cast<uint4*>(dev_pages + out_at[k]);
                dst[0] = make_uint4(out_words[0], out_words[1], out_words[2], out_words[3]);
                dst[1] = make_uint4(out_words[4], out_words[5], out_words[6], out_words[7]);
            } else {
                float lo, hi;
                fp8x2_to_float2<E4M3>(raw[k].x, lo, hi);
                dev_pages[out_at[k]] = (unsigned short)(float2_to_wide2<OUT_BF16>(lo * scale[k], 0.0f) & 0xFFFFu);
            }
        }
    }
}

// ---- offload: bf16/fp16 -> amax -> fp8 + scales ---------------------------------------

template <bool IN_BF16, int VEC>
__device__ __forceinline__ float chunk_amax(const unsigned short* __restrict__ src, float amax) {
    if (VEC == 16) {
        const uint4 a = reinterpret_cast<const uint4*>(src)[0];
        const uint4 b = reinterpret_cast<const uint4*>(src)[1];
        const unsigned int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            amax = fmaxf(amax, fabsf(wide_to_float<IN_BF16>((unsigned short)(words[w] & 0xFFFFu))));
            amax = fmaxf(amax, fabsf(wide_to_float<IN_BF16>((unsigned short)(words[w] >> 16))));
        }
        return amax;
    }
    return fmaxf(amax, fabsf(wide_to_float<IN_BF16>(src[0])));
}

template <bool IN_BF16, bool E4M3>
__device__ __forceinline__ unsigned int quantize_pair(unsigned int word, float scale, float fp8_max) {
    const float lo = fminf(fmaxf(wide_to_float<IN_BF16>((unsigned short)(word & 0xFFFFu)) / scale, -fp8_max), fp8_max);
    const float hi = fminf(fmaxf(wide_to_float<IN_BF16>((unsigned short)(word >> 16)) / scale, -fp8_max), fp8_max);
    return float2_to_fp8x2<E4M3>(lo, hi);
}

template <bool IN_BF16, bool E4M3, int VEC>
__device__ __forceinline__ void quantize_chunk(
    const unsigned short* __restrict__ src, unsigned char* __restrict__ dst, float scale, float fp8_max) {
    if (VEC == 16) {
        const uint4 a = reinterpret_cast<const uint4*>(src)[0];
        const uint4 b = reinterpret_cast<const uint4*>(src)[1];
        const unsigned int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        unsigned int out[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            out[w] = quantize_pair<IN_BF16, E4M3>(words[2 * w], scale, fp8_max)
                   | (quantize_pair<IN_BF16, E4M3>(words[2 * w + 1], scale, fp8_max) << 16);
        }
        *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
        const float value = fminf(fmaxf(wide_to_float<IN_BF16>(src[0]) / scale, -fp8_max), fp8_max);
        dst[0] = (unsigned char)(float2_to_fp8x2<E4M3>(value, 0.0f) & 0xFFu);
    }
}

template <bool IN_BF16, bool E4M3, int VEC>
__device__ __forceinline__ void quantize_pages_body(
    const unsigned short* __restrict__ dev_pages, unsigned char* __restrict__ host_data,
    unsigned char* __restrict__ host_scales,
    const long long* __restrict__ dev_slots, const long long* __restrict__ host_slots,
    long long num_pages, long long num_pieces,
    long long dev_slot_stride, long long dev_piece_stride,
    long long host_slot_stride, long long host_data_piece_stride, long long host_scale_piece_stride,
    long long groups_per_piece, long long group_stride, long long seg_count, long long seg_len,
    long long seg_stride, long long team_size, float fp8_max) {
    const int lane = threadIdx.x & 31;
    const int team = (int)team_size;
    const int team_lane = lane & (team - 1);
    const long long teams_per_warp = 32 / team;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long num_warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long groups_per_page = groups_per_piece * num_pieces;
    const long long total_groups = groups_per_page * num_pages;
    const long long chunks_per_seg = seg_len / VEC;
    const long long chunks = seg_count * chunks_per_seg;
    // The loop bound depends on the warp only, so every lane reaches every shuffle.
    for (long long warp_first = warp * teams_per_warp; warp_first < total_groups;
         warp_first += num_warps * teams_per_warp) {
        const long long group_id = warp_first + lane / team;
        const bool valid = group_id < total_groups;
        const unsigned short* src = dev_pages;
        unsigned char* dst = host_data;
        unsigned char* scale_dst = host_scales;
        float amax = 0.0f;
        if (valid) {
            const long long page = group_id / groups_per_page;
            const long long in_page = group_id - page * groups_per_page;
            const long long piece = in_page / groups_per_piece;
            const long long group = in_page - piece * groups_per_piece;
            const long long record = host_slots[page] * host_slot_stride;
            src = dev_pages + dev_slots[page] * dev_slot_stride + piece * dev_piece_stride + group * group_stride;
            dst = host_data + record + piece * host_data_piece_stride + group * group_stride;
            scale_dst = host_scales + record + piece * host_scale_piece_stride + group * 4;
            for (long long c = team_lane; c < chunks; c += team) {
                const long long seg = c / chunks_per_seg;
                const long long at = seg * seg_stride + (c - seg * chunks_per_seg) * VEC;
                amax = chunk_amax<IN_BF16, VEC>(src + at, amax);
            }
        }
        for (int offset = team >> 1; offset > 0; offset >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
        }
        if (valid) {
            const float scale = amax > 0.0f ? amax / fp8_max : 1.0f;
            if (team_lane == 0) {
                *reinterpret_cast<float*>(scale_dst) = scale;
            }
            for (long long c = team_lane; c < chunks; c += team) {
                const long long seg = c / chunks_per_seg;
                const long long at = seg * seg_stride + (c - seg * chunks_per_seg) * VEC;
                quantize_chunk<IN_BF16, E4M3, VEC>(src + at, dst + at, scale, fp8_max);
            }
        }
    }
}

#define KVTIER_UPCAST_KERNEL(NAME, E4M3, OUT_BF16, VEC)                                         \
    extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(                          \
        const unsigned char* __restrict__ host_data, const unsigned char* __restrict__ host_scales, \
        unsigned short* __restrict__ dev_pages,                                                 \
        const long long* __restrict__ host_slots, const long long* __restrict__ dev_slots,      \
        long long num_pages, long long num_pieces, long long plane_elems,                       \
        long long host_slot_stride, long long host_data_piece_stride,                           \
        long long host_scale_piece_stride, long long dev_slot_stride, long long dev_piece_stride, \
        long long scale_div, long long scale_mod) {                                             \
        upcast_pages_body<E4M3, OUT_BF16, VEC>(                                                 \
            host_data, host_scales, dev_pages, host_slots, dev_slots, num_pages, num_pieces,    \
            plane_elems, host_slot_stride, host_data_piece_stride, host_scale_piece_stride,     \
            dev_slot_stride, dev_piece_stride, scale_div, scale_mod);                           \
    }

#define KVTIER_QUANTIZE_KERNEL(NAME, IN_BF16, E4M3, VEC)                                        \
    extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(                          \
        const unsigned short* __restrict__ dev_pages, unsigned char* __restrict__ host_data,    \
        unsigned char* __restrict__ host_scales,                                                \
        const long long* __restrict__ dev_slots, const long long* __restrict__ host_slots,      \
        long long num_pages, long long num_pieces,                                              \
        long long dev_slot_stride, long long dev_piece_stride,                                  \
        long long host_slot_stride, long long host_data_piece_stride,                           \
        long long host_scale_piece_stride, long long groups_per_piece, long long group_stride,  \
        long long seg_count, long long seg_len, long long seg_stride, long long team_size,      \
        float fp8_max) {                                                                        \
        quantize_pages_body<IN_BF16, E4M3, VEC>(                                                \
            dev_pages, host_data, host_scales, dev_slots, host_slots, num_pages, num_pieces,    \
            dev_slot_stride, dev_piece_stride, host_slot_stride, host_data_piece_stride,        \
            host_scale_piece_stride, groups_per_piece, group_stride, seg_count, seg_len,        \
            seg_stride, team_size, fp8_max);                                                    \
    }

// Names: <op>_<fp8 kind>_<wide dtype>_v<elements per thread>.
KVTIER_UPCAST_KERNEL(upcast_pages_e4m3_bf16_v16, true, true, 16)
KVTIER_UPCAST_KERNEL(upcast_pages_e4m3_bf16_v1, true, true, 1)
KVTIER_UPCAST_KERNEL(upcast_pages_e4m3_fp16_v16, true, false, 16)
KVTIER_UPCAST_KERNEL(upcast_pages_e4m3_fp16_v1, true, false, 1)
KVTIER_UPCAST_KERNEL(upcast_pages_e5m2_bf16_v16, false, true, 16)
KVTIER_UPCAST_KERNEL(upcast_pages_e5m2_bf16_v1, false, true, 1)
KVTIER_UPCAST_KERNEL(upcast_pages_e5m2_fp16_v16, false, false, 16)
KVTIER_UPCAST_KERNEL(upcast_pages_e5m2_fp16_v1, false, false, 1)

KVTIER_QUANTIZE_KERNEL(quantize_pages_e4m3_bf16_v16, true, true, 16)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e4m3_bf16_v1, true, true, 1)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e4m3_fp16_v16, false, true, 16)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e4m3_fp16_v1, false, true, 1)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e5m2_bf16_v16, true, false, 16)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e5m2_bf16_v1, true, false, 1)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e5m2_fp16_v16, false, false, 16)
KVTIER_QUANTIZE_KERNEL(quantize_pages_e5m2_fp16_v1, false, false, 1)
