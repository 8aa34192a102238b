// Pass-through page copies between the device tier and host page records, all layers in one launch.
//
// Owns the SM copy kernels of kvtier's CUDA engine: a batch of (source slot, destination
// slot) pairs, each moving every (layer, plane) piece of a page and, when the device keeps
// them, its scales. Device pages are found through a table built once per engine (device
// memory, int64, rows of num_layers * planes):
//     table[0][row] data base, table[1][row] data page stride,
//     table[2][row] scale base, table[3][row] scale page stride,   row = layer * planes + plane
// so every layer and plane may live in its own tensor (an engine's per-layer KV) with any
// page stride (K and V interleaved per block). Host records are reached through their UVA
// device alias (pinned memory is mapped into the device's address space), so bytes cross
// PCIe once, read or written by the SMs; their layout is page_format.py's:
//     record + (layer * planes + plane) * plane_data_bytes          data
//     record + data_bytes + (layer * planes + plane) * scale bytes  scales
// Kernels: copy_<offload|reload|device>_w<word bytes>. It must never decide which pages
// move or convert dtypes (page_convert.cu does that); it moves bytes as they are.
//
// Compiled at run time by NVRTC through CuPy (kvtier/transfer/native.py), `nvcc -c`
// checks it offline.
//
// Work: per layer, data units (words of W bytes) numbered page, plane, word; then scale
// units (4-byte words). A chunk is THREADS * UNROLL units of one kind within one layer
// (16 KiB of data at W = 16); chunks are layer-major, see page_signal.cu. Each thread loads
// its UNROLL words before it stores any: PCIe reads of host memory take microseconds, and
// only many loads in flight hide that.

#include "page_signal.cu"

// KVTIER_COPY_UNROLL and KVTIER_COPY_STORE_EACH may be set with -D by measurement sweeps
// (scripts/both_directions_sweep.py); the engine's chunk counts assume the defaults
// (plans.COPY_CHUNK). KVTIER_COPY_STORE_EACH 1 stores each word right after its load.
#ifndef KVTIER_COPY_UNROLL
#define KVTIER_COPY_UNROLL 4
#endif
#ifndef KVTIER_COPY_STORE_EACH
#define KVTIER_COPY_STORE_EACH 0
#endif
#define KVTIER_COPY_CHUNK (KVTIER_THREADS * KVTIER_COPY_UNROLL)

#define KVTIER_OFFLOAD 0
#define KVTIER_RELOAD 1
#define KVTIER_DEVICE 2

struct CopyArgs {
    Signal signal;
    unsigned long long table;      // const long long[4][table_row]
    unsigned long long records;    // host records (device alias)
    unsigned long long src_slots;  // const int[num_pages]
    unsigned long long dst_slots;  // const int[num_pages]
    long long num_pages;
    long long first_layer;         // layer of chunk row 0 (per-layer launches move one layer)
    long long planes;
    long long table_row;           // num_layers * planes
    long long record_bytes;
    long long data_bytes;          // where a record's scale block starts
    long long plane_data_bytes;    // record bytes per (layer, plane) of data, padded
    long long piece_bytes;         // device bytes per (page, layer, plane)
    long long scale_piece_bytes;   // scale bytes per (page, layer, plane); 0: scales do not move
    long long data_chunks;         // data chunks per layer; the layer's scale chunks follow
};

// Address of unit `word` (of `width` bytes) of (page, layer, plane) on one side.
template <bool ON_DEVICE, bool SCALES>
__device__ __forceinline__ unsigned char* side_address(
    const CopyArgs& a, const long long* table, long long slot, long long layer, long long plane,
    long long byte) {
    const long long row = layer * a.planes + plane;
    if (ON_DEVICE) {
        const long long base = table[(SCALES ? 2 : 0) * a.table_row + row];
        const long long stride = table[(SCALES ? 3 : 1) * a.table_row + row];
        return reinterpret_cast<unsigned char*>(base + slot * stride + byte);
    }
    const long long at = SCALES ? a.data_bytes + row * a.scale_piece_bytes : row * a.plane_data_bytes;
    return reinterpret_cast<unsigned char*>(a.records + slot * a.record_bytes + at + byte);
}

template <int DIRECTION, typename Word, bool SCALES>
__device__ __forceinline__ void copy_chunk(const CopyArgs& a, long long layer, long long first_unit) {
    const long long* table = reinterpret_cast<const long long*>(a.table);
    const int* src_slots = reinterpret_cast<const int*>(a.src_slots);
    const int* dst_slots = reinterpret_cast<const int*>(a.dst_slots);
    const long long width = (long long)sizeof(Word);
    const long long words_per_piece = (SCALES ? a.scale_piece_bytes : a.piece_bytes) / width;
    const long long units = a.num_pages * a.planes * words_per_piece;
    Word words[KVTIER_COPY_UNROLL];
    unsigned char* dst_at[KVTIER_COPY_UNROLL];
#pragma unroll
    for (int k = 0; k < KVTIER_COPY_UNROLL; ++k) {
        const long long unit = first_unit + k * KVTIER_THREADS + threadIdx.x;
        dst_at[k] = nullptr;
        if (unit < units) {
            const long long piece = unit / words_per_piece;
            const long long byte = (unit - piece * words_per_piece) * width;
            const long long page = piece / a.planes;
            const long long plane = piece - page * a.planes;
            const unsigned char* src = side_address<DIRECTION != KVTIER_RELOAD, SCALES>(
                a, table, src_slots[page], layer, plane, byte);
            dst_at[k] = side_address<DIRECTION != KVTIER_OFFLOAD, SCALES>(a, table, dst_slots[page], layer, plane, byte);
            words[k] = *reinterpret_cast<const Word*>(src);
            if (KVTIER_COPY_STORE_EACH) {
                *reinterpret_cast<Word*>(dst_at[k]) = words[k];
                dst_at[k] = nullptr;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < KVTIER_COPY_UNROLL; ++k) {
        if (dst_at[k] != nullptr) {
            *reinterpret_cast<Word*>(dst_at[k]) = words[k];
        }
    }
}

template <int DIRECTION, typename Word>
__device__ __forceinline__ void copy_pages_body(const CopyArgs& a) {
    const long long per_layer = a.signal.chunks_per_layer;
    const long long total = per_layer * a.signal.num_layers;
    LayerSignal<DIRECTION == KVTIER_OFFLOAD> signal(a.signal);
    for (long long chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
        const long long row = chunk / per_layer;
        const long long in_layer = chunk - row * per_layer;
        const long long layer = a.first_layer + row;
        signal.visit(row);
        if (in_layer < a.data_chunks) {
            copy_chunk<DIRECTION, Word, false>(a, layer, in_layer * KVTIER_COPY_CHUNK);
        } else {
            copy_chunk<DIRECTION, unsigned int, true>(a, layer, (in_layer - a.data_chunks) * KVTIER_COPY_CHUNK);
        }
    }
    signal.close();
}

#define KVTIER_COPY_KERNEL(NAME, DIRECTION, WORD)                                               \
    extern "C" __global__ void __launch_bounds__(KVTIER_THREADS) NAME(const CopyArgs args) {     \
        copy_pages_body<DIRECTION, WORD>(args);                                                 \
    }

// One kernel per direction and data access width; the engine picks the widest width that
// divides every base, stride and size of the data side. Scales always move as 4-byte words.
KVTIER_COPY_KERNEL(copy_offload_w16, KVTIER_OFFLOAD, uint4)
KVTIER_COPY_KERNEL(copy_offload_w8, KVTIER_OFFLOAD, unsigned long long)
KVTIER_COPY_KERNEL(copy_offload_w4, KVTIER_OFFLOAD, unsigned int)
KVTIER_COPY_KERNEL(copy_offload_w2, KVTIER_OFFLOAD, unsigned short)
KVTIER_COPY_KERNEL(copy_offload_w1, KVTIER_OFFLOAD, unsigned char)
KVTIER_COPY_KERNEL(copy_reload_w16, KVTIER_RELOAD, uint4)
KVTIER_COPY_KERNEL(copy_reload_w8, KVTIER_RELOAD, unsigned long long)
KVTIER_COPY_KERNEL(copy_reload_w4, KVTIER_RELOAD, unsigned int)
KVTIER_COPY_KERNEL(copy_reload_w2, KVTIER_RELOAD, unsigned short)
KVTIER_COPY_KERNEL(copy_reload_w1, KVTIER_RELOAD, unsigned char)
KVTIER_COPY_KERNEL(copy_device_w16, KVTIER_DEVICE, uint4)
KVTIER_COPY_KERNEL(copy_device_w8, KVTIER_DEVICE, unsigned long long)
KVTIER_COPY_KERNEL(copy_device_w4, KVTIER_DEVICE, unsigned int)
KVTIER_COPY_KERNEL(copy_device_w2, KVTIER_DEVICE, unsigned short)
KVTIER_COPY_KERNEL(copy_device_w1, KVTIER_DEVICE, unsigned char)
