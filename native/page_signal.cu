// Per-layer completion signals and the chunk walk shared by every kernel of native/.
//
// Owns the protocol by which one kernel launch that moves every layer of a transfer tells
// the host and other streams, layer by layer, that a layer's bytes have landed:
//   - the work of a launch is cut into chunks that never span two layers, numbered
//     layer-major; block b takes chunks b, b + gridDim.x, ... so early layers finish first;
//   - after a chunk every thread fences (gpu scope when the destination is device memory,
//     system scope when it is host memory), the block meets at __syncthreads(), and thread 0
//     adds one to arrived[layer];
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

#define KVTIER_THREADS 256

struct Signal {
    unsigned long long flags;     // int32[num_layers + 1], device alias of pinned host memory; 0: no signals
    unsigned long long arrived;   // int32[num_layers] in device memory, zero between launches
    unsigned long long finished;  // int32[1] in device memory, zero between launches
    long long seq;                // this launch's sequence number on its stream
    long long num_layers;         // layers of this launch (its chunks cover them all)
    long long chunks_per_layer;
};

// Called by every thread of the block after its share of a chunk of `layer` (block-uniform).
template <bool SYSTEM>
__device__ __forceinline__ void chunk_landed(const Signal& signal, long long layer) {
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
        if (atomicAdd(arrived + layer, 1) + 1 == (int)signal.chunks_per_layer) {
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

#endif  // KVTIER_PAGE_SIGNAL
