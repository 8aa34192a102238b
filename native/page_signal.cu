// Per-layer completion signals and the chunk walk shared by every kernel of native/.
//
// Owns the protocol by which one kernel launch that moves every layer of a transfer tells
// the host and other streams, layer by layer, that a layer's bytes have landed:
//   - the work of a launch is cut into chunks that never span two layers, numbered
//     layer-major; block b takes chunks b, b + gridDim.x, ... so early layers finish first;
//   - a block signals a layer once, after the last of its chunks of that layer (LayerSignal:
//     the chunk loop opens a layer at its first chunk there and closes it on moving to the
//     next layer or at the end): every thread fences (gpu scope when the destination is device
//     memory, system scope when it is host memory), the block meets at __syncthreads(), and
//     thread 0 adds one to arrived[layer]. Chunks of one layer are consecutive numbers, so
//     min(gridDim.x, chunks_per_layer) blocks visit each layer: that is the count that
//     completes it. Signalling per chunk instead fenced every 16 KiB and, measured on the
//     H200, cost 6-15 % of copy bandwidth and a third of the quantize kernel's;
//   - the block whose add completes the layer resets the counter (the next launch on the
//     same stream starts only after this kernel has ended), fences at system scope and
//     stores flags[layer] = seq; a second counter lets the block that completes the last
//     layer store flags[num_layers] = seq (the whole transfer).
// flags live in pinned host memory mapped into the device: the host reads them with no CUDA
// call, and cuStreamWaitValue32(..., seq, GEQ) orders another stream after one layer. seq is
// a per-stream 32-bit sequence number; readers compare cyclically ((int)(flag - seq) >= 0).
// Counters live in device memory, zeroed once by the engine, one set per engine stream.
// It must never touch page bytes: the kernels that include it move them.
//
// Included by page_copy.cu and page_convert.cu (NVRTC finds it through the include path the
// engine passes; nvcc -I native).

#ifndef KVTIER_PAGE_SIGNAL
#define KVTIER_PAGE_SIGNAL

// Overridable with -D for measurement sweeps only (scripts/both_directions_sweep.py); the
// engine launches this block size (plans.THREADS).
#ifndef KVTIER_THREADS
#define KVTIER_THREADS 256
#endif

struct Signal {
    unsigned long long flags;     // int32[num_layers + 1], device alias of pinned host memory; 0: no signals
    unsigned long long arrived;   // int32[num_layers] in device memory, zero between launches
    unsigned long long finished;  // int32[1] in device memory, zero between launches
    long long seq;                // this launch's sequence number on its stream
    long long num_layers;         // layers of this launch (its chunks cover them all)
    long long chunks_per_layer;
};

// Called by every thread of the block after its last chunk of `layer` (block-uniform).
template <bool SYSTEM>
__device__ __forceinline__ void layer_landed(const Signal& signal, long long layer) {
    if (signal.flags == 0) {
        return;
    }
    if (SYSTEM) {
        __threadfence_system();
    } else {
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int* arrived = reinterpret_cast<int*>(signal.arrived);
        const long long visitors =
            signal.chunks_per_layer < (long long)gridDim.x ? signal.chunks_per_layer : (long long)gridDim.x;
        if (atomicAdd(arrived + layer, 1) + 1 == (int)visitors) {
            arrived[layer] = 0;
            __threadfence_system();
            volatile int* flags = reinterpret_cast<volatile int*>(signal.flags);
            flags[layer] = (int)signal.seq;
            int* finished = reinterpret_cast<int*>(signal.finished);
            if (atomicAdd(finished, 1) + 1 == (int)signal.num_layers) {
                *finished = 0;
                __threadfence_system();
                flags[signal.num_layers] = (int)signal.seq;
            }
        }
    }
}

// The chunk loop's bookkeeping: `visit(row)` before each chunk signals the layer the block
// just left; `close()` after the loop signals the last one.
template <bool SYSTEM>
struct LayerSignal {
    const Signal& signal;
    long long open;
    __device__ __forceinline__ explicit LayerSignal(const Signal& s) : signal(s), open(-1) {}
    __device__ __forceinline__ void visit(long long row) {
        if (row != open) {
            if (open >= 0) {
                layer_landed<SYSTEM>(signal, open);
            }
            open = row;
        }
    }
    __device__ __forceinline__ void close() {
        if (open >= 0) {
            layer_landed<SYSTEM>(signal, open);
        }
    }
};

#endif  // KVTIER_PAGE_SIGNAL
