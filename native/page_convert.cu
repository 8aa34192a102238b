// Fused dtype conversion between bf16/fp16 device pages and fp8 + fp32-scale records, all layers in one launch.
//
// Owns the two converting copies of kvtier's CUDA engine:
//   upcast_<fp8>_<wide>_v*   reload: fp8 record (+ its scales) -> bf16/fp16 device pages,
//                            dequant = float(q) * scale, rounded to nearest even, in one pass;
//   quantize_<wide>_<fp8>_v* offload: bf16/fp16 device pages -> amax per scale group ->
//                            scale = amax / fp8_max (1 where amax == 0) ->
//                            q = clamp(x / scale, +-fp8_max) rounded to nearest even fp8,
//                            written with the scales straight into the pinned host record.
// Both match kvtier/format/codec.py bit for bit (quantized bytes, scales, dequantized
// values) as the codec computes on the CPU, for every granularity and layout. A page with a
// NaN or an infinity in any scale group cannot be encoded: its amax (a NaN-propagating
// max) is not finite, so the kernel writes none of that group and sets failed[page] = 1 in
// pinned host memory, which the ticket reads; the rest of the batch is encoded as usual.
// It must never choose a dtype, granularity or which pages move: the engine passes all of
// that in.
//
// Device pages are found through the engine's table (page_copy.cu describes it), records
// are laid out as page_format.py says; records are host memory (through their device
// alias) or, for the staged reload, a device staging buffer laid out the same way.
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
// Work and signals: chunks never span layers and are numbered layer-major (page_signal.cu).
// Upcast: a chunk is THREADS * UNROLL units of VEC elements (page, plane, element order),
// one thread per unit, no reduction. Quantize: a chunk is THREADS / team_size scale groups;
// a team of `team_size` lanes (a power of two <= 32, so a team never straddles a warp)
// owns one group: amax by a team shuffle reduction, then the team rereads its group (an L2
// hit) and stores fp8. VEC is 16 (16 fp8 bytes = one 16-byte PCIe transaction per thread)
// when every group run, plane, device base and page stride allows it, else 1.

#include "page_signal.cu"

#define KVTIER_CONVERT_UNROLL 2
#define KVTIER_CONVERT_CHUNK (KVTIER_THREADS * KVTIER_CONVERT_UNROLL)

struct UpcastArgs {
    Signal signal;
    unsigned long long table;        // const long long[4][table_row] (page_copy.cu)
    unsigned long long records;      // fp8 records: host alias or device staging
    unsigned long long src_slots;    // const int[num_pages]: record of each page
    unsigned long long dst_slots;    // const int[num_pages]: device slot of each page
    long long num_pages;
    long long first_layer;
    long long planes;
    long long table_row;
    long long record_bytes;
    long long data_bytes;
    long long plane_data_bytes;
    long long plane_scale_bytes;
    long long plane_elems;
    long long scale_div;
    long long scale_mod;
};

struct QuantizeArgs {
    Signal signal;
    unsigned long long table;
    unsigned long long records;      // host records (device alias)
    unsigned long long src_slots;    // const int[num_pages]: device slot of each page
    unsigned long long dst_slots;    // const int[num_pages]: record of each page
    unsigned long long failed;       // int[num_pages] in pinned host memory, zeroed by the engine
    long long num_pages;
    long long first_layer;
    long long planes;
    long long table_row;
    long long record_bytes;
    long long data_bytes;
    long long plane_data_bytes;
    long long plane_scale_bytes;
    long long groups_per_piece;
    long long group_stride;
    long long seg_count;
    long long seg_len;
    long long seg_stride;
    long long team_size;
    long long fp8_max;               // 448 or 57344: integers, exact as floats
};

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
__device__ __forceinline__ void upcast_chunk(const UpcastArgs& a, long long layer, long long first_unit) {
    const long long* table = reinterpret_cast<const long long*>(a.table);
    const int* src_slots = reinterpret_cast<const int*>(a.src_slots);
    const int* dst_slots = reinterpret_cast<const int*>(a.dst_slots);
    const long long units_per_piece = a.plane_elems / VEC;
    const long long units = a.num_pages * a.planes * units_per_piece;
    uint4 raw[KVTIER_CONVERT_UNROLL];
    float scale[KVTIER_CONVERT_UNROLL];
    unsigned short* out[KVTIER_CONVERT_UNROLL];
#pragma unroll
    for (int k = 0; k < KVTIER_CONVERT_UNROLL; ++k) {
        const long long unit = first_unit + k * KVTIER_THREADS + threadIdx.x;
        out[k] = nullptr;
        if (unit < units) {
            const long long piece = unit / units_per_piece;
            const long long elem = (unit - piece * units_per_piece) * VEC;
            const long long page = piece / a.planes;
            const long long plane = piece - page * a.planes;
            const long long row = layer * a.planes + plane;
            const unsigned char* record = reinterpret_cast<const unsigned char*>(a.records) + (long long)src_slots[page] * a.record_bytes;
            const unsigned char* src = record + row * a.plane_data_bytes + elem;
            const long long scale_index = (elem / a.scale_div) % a.scale_mod;
            scale[k] = *reinterpret_cast<const float*>(record + a.data_bytes + row * a.plane_scale_bytes + scale_index * 4);
            if (VEC == 16) {
                raw[k] = *reinterpret_cast<const uint4*>(src);
            } else {
                raw[k].x = *src;
            }
            out[k] = reinterpret_cast<unsigned short*>(
                table[row] + (long long)dst_slots[page] * table[a.table_row + row] + elem * 2);
        }
    }
#pragma unroll
    for (int k = 0; k < KVTIER_CONVERT_UNROLL; ++k) {
        if (out[k] == nullptr) {
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
            uint4* dst = reinterpret_cast<uint4*>(out[k]);
            dst[0] = make_uint4(out_words[0], out_words[1], out_words[2], out_words[3]);
            dst[1] = make_uint4(out_words[4], out_words[5], out_words[6], out_words[7]);
        } else {
            float lo, hi;
            fp8x2_to_float2<E4M3>(raw[k].x, lo, hi);
            out[k][0] = (unsigned short)(float2_to_wide2<OUT_BF16>(lo * scale[k], 0.0f) & 0xFFFFu);
        }
    }
}

template <bool E4M3, bool OUT_BF16, int VEC>
__device__ __forceinline__ void upcast_pages_body(const UpcastArgs& a) {
    const long long per_layer = a.signal.chunks_per_layer;
    const long long total = per_layer * a.signal.num_layers;
    for (long long chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
        const long long row = chunk / per_layer;
        upcast_chunk<E4M3, OUT_BF16, VEC>(a, a.first_layer + row, (chunk - row * per_layer) * KVTIER_CONVERT_CHUNK);
        chunk_landed<false>(a.signal, row);
    }
}

// ---- offload: bf16/fp16 -> amax -> fp8 + scales ---------------------------------------

// max that propagates NaN (fmaxf drops it): a group holding a NaN must not look finite.
__device__ __forceinline__ float nan_max(float a, float b) {
    return (a != a || a > b) ? a : b;
}

template <bool IN_BF16, int VEC>
__device__ __forceinline__ float chunk_amax(const unsigned short* __restrict__ src, float amax) {
    if (VEC == 16) {
        const uint4 a = reinterpret_cast<const uint4*>(src)[0];
        const uint4 b = reinterpret_cast<const uint4*>(src)[1];
        const unsigned int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            amax = nan_max(amax, fabsf(wide_to_float<IN_BF16>((unsigned short)(words[w] & 0xFFFFu))));
            amax = nan_max(amax, fabsf(wide_to_float<IN_BF16>((unsigned short)(words[w] >> 16))));
        }
        return amax;
    }
    return nan_max(amax, fabsf(wide_to_float<IN_BF16>(src[0])));
}

template <bool IN_BF16, bool E4M3>
__device__ __forceinline__ unsigned int quantize_pair(unsigned int word, float scale, float fp8_max) {
    const float lo = fminf(fmaxf(wide_to_float<IN_BF16>((unsigned short)(word & 0xFFFFu)) / scale, -fp8_max), fp8_max);
    const float hi = fminf(fmaxf(wide_to_float<IN_BF16>((unsigned short)(word >> 16)) / scale, -fp8_max), fp8_max);
    return float2_to_fp8x2<E4M3>(lo, hi);
}

template <bool IN_BF16, bool E4M3, int VEC>
__device__ __forceinline__ void quantize_run(
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
__device__ __forceinline__ void quantize_chunk(const QuantizeArgs& a, long long layer, long long first_group) {
    const long long* table = reinterpret_cast<const long long*>(a.table);
    const int* src_slots = reinterpret_cast<const int*>(a.src_slots);
    const int* dst_slots = reinterpret_cast<const int*>(a.dst_slots);
    const int team = (int)a.team_size;
    const int team_lane = threadIdx.x & (team - 1);
    const long long groups = a.num_pages * a.planes * a.groups_per_piece;
    const long long group_id = first_group + threadIdx.x / team;
    const long long runs_per_seg = a.seg_len / VEC;
    const long long runs = a.seg_count * runs_per_seg;
    const float fp8_max = (float)a.fp8_max;
    const bool valid = group_id < groups;
    const unsigned short* src = nullptr;
    unsigned char* dst = nullptr;
    unsigned char* record = nullptr;
    long long page = 0;
    long long row = 0;
    long long group = 0;
    float amax = 0.0f;
    if (valid) {
        const long long piece = group_id / a.groups_per_piece;
        group = group_id - piece * a.groups_per_piece;
        page = piece / a.planes;
        const long long plane = piece - page * a.planes;
        row = layer * a.planes + plane;
        src = reinterpret_cast<const unsigned short*>(table[row] + (long long)src_slots[page] * table[a.table_row + row])
            + group * a.group_stride;
        record = reinterpret_cast<unsigned char*>(a.records) + (long long)dst_slots[page] * a.record_bytes;
        dst = record + row * a.plane_data_bytes + group * a.group_stride;
        for (long long c = team_lane; c < runs; c += team) {
            const long long seg = c / runs_per_seg;
            amax = chunk_amax<IN_BF16, VEC>(src + seg * a.seg_stride + (c - seg * runs_per_seg) * VEC, amax);
        }
    }
    // Every lane of the warp reaches every shuffle: teams never straddle warps, and lanes
    // past the last group take part with amax 0.
    for (int offset = team >> 1; offset > 0; offset >>= 1) {
        amax = nan_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
    }
    if (!valid) {
        return;
    }
    if (!(amax <= 3.402823466e38f)) {
        if (team_lane == 0) {
            reinterpret_cast<int*>(a.failed)[page] = 1;
        }
        return;
    }
    const float scale = amax > 0.0f ? amax / fp8_max : 1.0f;
    if (team_lane == 0) {
        *reinterpret_cast<float*>(record + a.data_bytes + row * a.plane_scale_bytes + group * 4) = scale;
    }
    for (long long c = team_lane; c < runs; c += team) {
        const long long seg = c / runs_per_seg;
        const long long at = seg * a.seg_stride + (c - seg * runs_per_seg) * VEC;
        quantize_run<IN_BF16, E4M3, VEC>(src + at, dst + at, scale, fp8_max);
    }
}

template <bool IN_BF16, bool E4M3, int VEC>
__device__ __forceinline__ void quantize_pages_body(const QuantizeArgs& a) {
    const long long per_layer = a.signal.chunks_per_layer;
    const long long total = per_layer * a.signal.num_layers;
    const long long groups_per_chunk = KVTIER_THREADS / a.team_size;
    for (long long chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
        const long long row = chunk / per_layer;
        quantize_chunk<IN_BF16, E4M3, VEC>(a, a.first_layer + row, (chunk - row * per_layer) * groups_per_chunk);
        chunk_landed<true>(a.signal, row);
    }
}

#define KVTIER_UPCAST_KERNEL(NAME, E4M3, OUT_BF16, VEC)                                         \
    extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(const UpcastArgs args) {   \
        upcast_pages_body<E4M3, OUT_BF16, VEC>(args);                                           \
    }

#define KVTIER_QUANTIZE_KERNEL(NAME, IN_BF16, E4M3, VEC)                                        \
    extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(const QuantizeArgs args) { \
        quantize_pages_body<IN_BF16, E4M3, VEC>(args);                                          \
    }

// Names: <op>_<from>_<to>_v<elements per thread>.
KVTIER_UPCAST_KERNEL(upcast_e4m3_bf16_v16, true, true, 16)
KVTIER_UPCAST_KERNEL(upcast_e4m3_bf16_v1, true, true, 1)
KVTIER_UPCAST_KERNEL(upcast_e4m3_fp16_v16, true, false, 16)
KVTIER_UPCAST_KERNEL(upcast_e4m3_fp16_v1, true, false, 1)
KVTIER_UPCAST_KERNEL(upcast_e5m2_bf16_v16, false, true, 16)
KVTIER_UPCAST_KERNEL(upcast_e5m2_bf16_v1, false, true, 1)
KVTIER_UPCAST_KERNEL(upcast_e5m2_fp16_v16, false, false, 16)
KVTIER_UPCAST_KERNEL(upcast_e5m2_fp16_v1, false, false, 1)

KVTIER_QUANTIZE_KERNEL(quantize_bf16_e4m3_v16, true, true, 16)
KVTIER_QUANTIZE_KERNEL(quantize_bf16_e4m3_v1, true, true, 1)
KVTIER_QUANTIZE_KERNEL(quantize_fp16_e4m3_v16, false, true, 16)
KVTIER_QUANTIZE_KERNEL(quantize_fp16_e4m3_v1, false, true, 1)
KVTIER_QUANTIZE_KERNEL(quantize_bf16_e5m2_v16, true, false, 16)
KVTIER_QUANTIZE_KERNEL(quantize_bf16_e5m2_v1, true, false, 1)
KVTIER_QUANTIZE_KERNEL(quantize_fp16_e5m2_v16, false, false, 16)
KVTIER_QUANTIZE_KERNEL(quantize_fp16_e5m2_v1, false, false, 1)
