// Pass-through page copies between the device tier and pinned host page records.
//
// Owns the SM copy kernels of kvtier's CUDA engine: a batch of (source slot, destination
// slot) pairs, each moving `num_pieces` pieces of `piece_bytes` bytes whose addresses are
//     base + slot * slot_stride + piece * piece_stride
// on either side. One kernel covers offload gather (device layer-major planes -> host
// records), reload scatter (host records -> device planes), their scale blocks, and
// device-to-device page copies: only the strides differ, and the engine computes them
// from the PageFormat. Host records are reached through their UVA device pointer
// (cudaHostRegister'ed memory is mapped into the device address space), so bytes cross
// PCIe once, written or read straight by the SMs.
// It must never decide which pages move or convert dtypes (page_convert.cu does that);
// it moves bytes as they are.
//
// Compiled at run time by NVRTC through CuPy (kvtier/transfer/native.py); it includes
// no header, so it builds wherever NVRTC runs, and `nvcc -c` checks it offline.
//
// Launch: 1-D grid of at most a few blocks per SM (the engine caps it, so a copy does not
// take every SM from the model), 256 threads, grid-stride over "units" of WORD bytes.
// Units are numbered page-major, then piece, then word, so neighbouring threads touch
// neighbouring bytes of one piece and a warp issues one wide transaction. Each thread
// loads UNROLL words before it stores any: PCIe reads of host memory take microseconds,
// and only many loads in flight hide that.

#define KVTIER_THREADS 256
#define KVTIER_UNROLL 4

template <typename Word>
__device__ __forceinline__ void copy_pages_body(
    const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
    const long long* __restrict__ src_slots, const long long* __restrict__ dst_slots,
    long long num_pages, long long num_pieces, long long piece_bytes,
    long long src_slot_stride, long long src_piece_stride,
    long long dst_slot_stride, long long dst_piece_stride) {
    // The engine picks Word so that every base, stride and piece size is a multiple of
    // sizeof(Word): no unit straddles a piece and every access is naturally aligned.
    const long long words_per_piece = piece_bytes / (long long)sizeof(Word);
    const long long words_per_page = words_per_piece * num_pieces;
    const long long total = words_per_page * num_pages;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x; first < total;
         first += stride * KVTIER_UNROLL) {
        Word words[KVTIER_UNROLL];
        long long dst_at[KVTIER_UNROLL];
#pragma unroll
        for (int k = 0; k < KVTIER_UNROLL; ++k) {
            const long long unit = first + k * stride;
            dst_at[k] = -1;
            if (unit < total) {
                const long long page = unit / words_per_page;
                const long long in_page = unit - page * words_per_page;
                const long long piece = in_page / words_per_piece;
                const long long byte = (in_page - piece * words_per_piece) * (long long)sizeof(Word);
                const long long src_at = src_slots[page] * src_slot_stride + piece * src_piece_stride + byte;
                dst_at[k] = dst_slots[page] * dst_slot_stride + piece * dst_piece_stride + byte;
                words[k] = *reinterpret_cast<const Word*>(src + src_at);
            }
        }
#pragma unroll
        for (int k = 0; k < KVTIER_UNROLL; ++k) {
            if (dst_at[k] >= 0) {
                *reinterpret_cast<Word*>(dst + dst_at[k]) = words[k];
            }
        }
    }
}

#define KVTIER_COPY_KERNEL(NAME, WORD)                                                          \
    extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(                          \
        const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,                 \
        const long long* __restrict__ src_slots, const long long* __restrict__ dst_slots,       \
        long long num_pages, long long num_pieces, long long piece_bytes,                       \
        long long src_slot_stride, long long src_piece_stride,                                  \
        long long dst_slot_stride, long long dst_piece_stride) {                                \
        copy_pages_body<WORD>(src, dst, src_slots, dst_slots, num_pages, num_pieces,            \
                              piece_bytes, src_slot_stride, src_piece_stride,                   \
                              dst_slot_stride, dst_piece_stride);                               \
    }

// One kernel per access width; the engine picks the widest that the alignment allows.
KVTIER_COPY_KERNEL(copy_pages_w16, uint4)
KVTIER_COPY_KERNEL(copy_pages_w8, unsigned long long)
KVTIER_COPY_KERNEL(copy_pages_w4, unsigned int)
KVTIER_COPY_KERNEL(copy_pages_w2, unsigned short)
KVTIER_COPY_KERNEL(copy_pages_w1, unsigned char)
