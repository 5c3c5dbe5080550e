// ds_odc GPU kernels and the thin host wrappers around NVSHMEM that the Python transport calls.
//
// Everything here is exported as extern "C" and takes raw pointers, sizes and a cudaStream_t, so that the pybind
// binding (odc_binding.cpp) stays plain C++ and the Python side (ds_odc/ops/nvshmem.py) owns all the policy.
//
// Two scatter-accumulate kernels:
//   * odc_scatter_add_p2p: fp32 reductions straight into the owners' accumulators through NVLink peer pointers
//     (16-byte vector reductions on Hopper). No staging memory; summation order across sources is not fixed.
//     The same kernel does plain read-modify-write into single-writer staging slots (the deterministic option).
//   * odc_scatter_add_rma: the generic path, built only from NVSHMEM get/put. Each source owns a private staging
//     slot on every owner and updates it read-modify-write (get chunk, add, put back), so no two writers ever touch
//     the same bytes and no float atomics are needed on the network.
// Both take a device array of Task records; blocks (or chunks) are assigned to tasks by a prefix sum computed on the
// host, so one launch serves every parameter of a bucket.
//
// One kernel waits for peers: odc_lockstep_barrier, the lock-step meeting of zero_optimization.odc.lockstep (a
// baseline for measuring, off by default). Its wait is bounded by a deadline on the device clock, so a peer that never
// comes makes it return, marking the peer missing, instead of hanging the stream.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <nvshmem.h>
#include <nvshmemx.h>

namespace {

// One (segment, destination rank) piece of work. Layout shared with Python (6 x int64 per task).
struct Task {
  int64_t dst;    // fp32 destination: a peer pointer (P2P kernel) or a symmetric address (RMA kernel)
  int64_t src;    // local source elements (bf16, fp16 or fp32)
  int64_t n;      // number of elements
  int64_t first;  // first block (P2P) or first chunk (RMA) of this task in the launch
  int64_t pe;     // destination PE (RMA kernel only)
  int64_t pad;
};

// Tasks travel as a kernel parameter (no host-to-device copy per call); Hopper-era drivers take up to 32 KiB of
// parameters, and a call with more tasks is split into several launches.
constexpr int kMaxTasks = 256;
struct TaskTable {
  Task t[kMaxTasks];
};

constexpr int kP2PThreads = 256;
constexpr int kQuadsPerThread = 4;
constexpr int64_t kP2PElemsPerBlock = int64_t(kP2PThreads) * kQuadsPerThread * 4;  // 4096

constexpr int kRmaThreads = 512;
constexpr int64_t kRmaChunkElems = 8192;  // 32 KiB of fp32 per CTA in flight

enum SrcDtype { kF32 = 0, kBF16 = 1, kF16 = 2 };

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// Task whose range of blocks (or chunks) contains `index`: the last task with first <= index.
__device__ __forceinline__ int find_task(const TaskTable& tasks, int ntasks, int64_t index) {
  int lo = 0, hi = ntasks - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (tasks.t[mid].first <= index) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// System scope: the destination is another GPU's memory and other GPUs reduce into the same words concurrently.
__device__ __forceinline__ void red_add_v4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               :: "l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  atomicAdd_system(dst + 0, a); atomicAdd_system(dst + 1, b);
  atomicAdd_system(dst + 2, c); atomicAdd_system(dst + 3, d);
#endif
}

// How a P2P task adds into its destination.
enum P2PMode {
  kAtomicScalar = 0,  // one fp32 reduction per element
  kAtomicVector = 1,  // 16-byte fp32 vector reductions (sm_90+), scalar head and tail
  kPlainRmw = 2,      // plain load-add-store: only for destinations with a single writer (staging slots)
};

template <int kMode>
__device__ __forceinline__ void add_one(float* dst, float v) {
  if (kMode == kPlainRmw) *dst += v; else atomicAdd_system(dst, v);
}

template <typename T, int kMode>
__global__ void __launch_bounds__(kP2PThreads) scatter_add_p2p_kernel(const __grid_constant__ TaskTable tasks,
                                                                        int ntasks, float scale) {
  const Task t = tasks.t[find_task(tasks, ntasks, blockIdx.x)];
  float* dst = reinterpret_cast<float*>(t.dst);
  const T* src = reinterpret_cast<const T*>(t.src);
  const int64_t block = int64_t(blockIdx.x) - t.first;
  if (kMode == kAtomicScalar) {
    const int64_t begin = block * kP2PElemsPerBlock;
    const int64_t end = min(t.n, begin + kP2PElemsPerBlock);
    for (int64_t i = begin + threadIdx.x; i < end; i += kP2PThreads) add_one<kMode>(dst + i, scale * to_f32(src[i]));
  } else {
    // 16-byte accesses need 16-byte aligned destinations: peel a scalar head (and tail) in the task's first block.
    const int64_t head = min(t.n, int64_t(((16 - (t.dst & 15)) & 15) >> 2));
    const int64_t quads = (t.n - head) >> 2;
    const int64_t tail = head + quads * 4;
    if (block == 0) {
      if (threadIdx.x < head) add_one<kMode>(dst + threadIdx.x, scale * to_f32(src[threadIdx.x]));
      if (threadIdx.x < t.n - tail) add_one<kMode>(dst + tail + threadIdx.x, scale * to_f32(src[tail + threadIdx.x]));
    }
    const int64_t qbegin = block * (kP2PElemsPerBlock / 4);
    const int64_t qend = min(quads, qbegin + kP2PElemsPerBlock / 4);
    for (int64_t q = qbegin + threadIdx.x; q < qend; q += kP2PThreads) {
      const int64_t i = head + q * 4;
      const float a = scale * to_f32(src[i]), b = scale * to_f32(src[i + 1]);
      const float c = scale * to_f32(src[i + 2]), d = scale * to_f32(src[i + 3]);
      if (kMode == kAtomicVector) {
        red_add_v4(dst + i, a, b, c, d);
      } else {
        float4* p = reinterpret_cast<float4*>(dst + i);
        float4 v = *p;
        v.x += a; v.y += b; v.z += c; v.w += d;
        *p = v;
      }
    }
  }
  // Make this rank's writes visible system-wide before the kernel counts as complete (the fence relies on it).
  __threadfence_system();
}

template <typename T>
__global__ void __launch_bounds__(kRmaThreads) scatter_add_rma_kernel(const __grid_constant__ TaskTable tasks,
                                                                     int ntasks, int64_t nchunks, float scale,
                                                                     float* scratch) {
  // scratch is symmetric (remote transports may only read/write registered memory); one chunk per CTA.
  float* buf = scratch + int64_t(blockIdx.x) * kRmaChunkElems;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Task t = tasks.t[find_task(tasks, ntasks, c)];
    const int64_t start = (c - t.first) * kRmaChunkElems;
    const int64_t len = min(kRmaChunkElems, t.n - start);
    float* remote = reinterpret_cast<float*>(t.dst) + start;
    const T* src = reinterpret_cast<const T*>(t.src) + start;
    nvshmemx_getmem_block(buf, remote, size_t(len) * sizeof(float), int(t.pe));
    __syncthreads();
    for (int64_t i = threadIdx.x; i < len; i += kRmaThreads) buf[i] += scale * to_f32(src[i]);
    __threadfence();  // a NIC, not these threads, may read buf for the put
    __syncthreads();
    nvshmemx_putmem_block(remote, buf, size_t(len) * sizeof(float), int(t.pe));
    __syncthreads();  // buf is reused by the next chunk
  }
}

// -- lock-step meetings -------------------------------------------------------------------------------------------

constexpr int kLockstepThreads = 32;

__device__ __forceinline__ unsigned long long device_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One CTA. `peers[p]`: rank p's copy of the symmetric counter array (a peer pointer; this rank's own for p == me);
// `counts`: this rank's copy, where entry s counts the meetings rank s has reached. Thread t announces this rank's
// arrival to ranks t, t + 32, ... (one system-scope increment of entry `me` of their copies), then waits until
// entries t, t + 32, ... of its own copy reach `epoch`, or until `timeout_ns` has passed on the device clock. A rank
// still missing then is marked in stats[2 + rank], and stats[1] is set: every later meeting returns at once (the host
// raises at its next fence). stats[0] adds up the nanoseconds this kernel waited.
__global__ void __launch_bounds__(kLockstepThreads) lockstep_barrier_kernel(
    const int64_t* peers, unsigned long long* counts, int world, int me, unsigned long long epoch,
    unsigned long long timeout_ns, unsigned long long* stats) {
  const unsigned long long start = device_clock_ns();
  const unsigned long long deadline = start + timeout_ns;
  __threadfence_system();  // what this stream wrote before the meeting, before peers can see the arrival
  for (int p = threadIdx.x; p < world; p += kLockstepThreads) {
    atomicAdd_system(reinterpret_cast<unsigned long long*>(peers[p]) + me, 1ULL);
  }
  volatile unsigned long long* arrived = counts;
  volatile unsigned long long* failed = stats + 1;
  for (int q = threadIdx.x; q < world; q += kLockstepThreads) {
    unsigned long long now = start;
    while (now < deadline && arrived[q] < epoch && *failed == 0) {
      __nanosleep(128);
      now = device_clock_ns();
    }
    if (arrived[q] < epoch && now >= deadline) {
      atomicExch(stats + 2 + q, 1ULL);
      atomicExch(stats + 1, 1ULL);
    }
  }
  __threadfence_system();  // what peers wrote before arriving, before this stream's next work reads it
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(stats, device_clock_ns() - start);
}

thread_local char g_error[512] = {0};

int set_error(cudaError_t err, const char* where) {
  if (err == cudaSuccess) return 0;
  snprintf(g_error, sizeof(g_error), "%s: %s", where, cudaGetErrorString(err));
  return int(err);
}

}  // namespace

extern "C" {

const char* odc_last_error() { return g_error; }
int64_t odc_rma_chunk_elems() { return kRmaChunkElems; }

// -- runtime ------------------------------------------------------------------------------------------------------

int odc_init_status() { return nvshmemx_init_status(); }

// Registers this extension's device code with an NVSHMEM runtime that someone else (nvshmem4py, torch) initialised.
// Every module that links libnvshmem_device.a has its own copy of the device-side state, which the host library
// fills only for registered modules. On an initialised runtime this skips the bootstrap; never call it before.
int odc_attach() {
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
    snprintf(g_error, sizeof(g_error), "odc_attach: NVSHMEM is not initialised (status %d)", nvshmemx_init_status());
    return -1;
  }
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version);
  if (status != 0) snprintf(g_error, sizeof(g_error), "odc_attach: nvshmemi_init_thread returned %d", status);
  return status;
}

int odc_my_pe() { return nvshmem_my_pe(); }
int odc_n_pes() { return nvshmem_n_pes(); }

void* odc_malloc(size_t nbytes) { return nvshmem_malloc(nbytes); }  // collective; NULL when the heap cannot grow
void odc_free(void* ptr) { nvshmem_free(ptr); }                      // collective
void* odc_peer_ptr(void* sym, int pe) { return nvshmem_ptr(sym, pe); }  // NULL when pe is not load/store reachable

// -- gather: copy-engine reads --------------------------------------------------------------------------------------

// Peer-pointer path: plain device-to-device copies from the peers' mapped memory (copy engines over NVLink).
// (cudaMemcpyBatchAsync was measured slower at every size on 2x H200 and saved no host time: see docs/BENCHMARKS.md.)
int odc_copy_batch(int n, const int64_t* dst, const int64_t* src, const int64_t* nbytes, void* stream) {
  for (int i = 0; i < n; ++i) {
    if (nbytes[i] == 0) continue;
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                                      size_t(nbytes[i]), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) return set_error(err, "odc_copy_batch: cudaMemcpyAsync");
  }
  return 0;
}

// Generic path: stream-ordered NVSHMEM gets from symmetric addresses on `pes`.
int odc_get_batch(int n, const int64_t* dst, const int64_t* src, const int64_t* nbytes, const int64_t* pes,
                  void* stream) {
  for (int i = 0; i < n; ++i) {
    if (nbytes[i] == 0) continue;
    nvshmemx_getmem_on_stream(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                              size_t(nbytes[i]), int(pes[i]), static_cast<cudaStream_t>(stream));
  }
  return set_error(cudaGetLastError(), "odc_get_batch");
}

int odc_quiet_on_stream(void* stream) {
  nvshmemx_quiet_on_stream(static_cast<cudaStream_t>(stream));
  return set_error(cudaGetLastError(), "odc_quiet_on_stream");
}

// -- scatter-accumulate -------------------------------------------------------------------------------------------

// Fills `table` with tasks [begin, end) and numbers their blocks/chunks of `unit` elements; returns the total.
static int64_t fill_table(TaskTable* table, const Task* tasks, int begin, int end, int64_t unit) {
  int64_t total = 0;
  for (int i = begin; i < end; ++i) {
    table->t[i - begin] = tasks[i];
    table->t[i - begin].first = total;
    total += (tasks[i].n + unit - 1) / unit;
  }
  return total;
}

int odc_scatter_add_p2p(const int64_t* host_tasks, int ntasks, int src_dtype, float scale, int mode, void* stream) {
  if (mode < kAtomicScalar || mode > kPlainRmw) {
    snprintf(g_error, sizeof(g_error), "odc_scatter_add_p2p: bad mode %d", mode);
    return -1;
  }
  const Task* tasks = reinterpret_cast<const Task*>(host_tasks);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TaskTable table;
  for (int begin = 0; begin < ntasks; begin += kMaxTasks) {
    const int count = ntasks - begin < kMaxTasks ? ntasks - begin : kMaxTasks;
    const int64_t nblocks = fill_table(&table, tasks, begin, begin + count, kP2PElemsPerBlock);
    if (nblocks == 0) continue;
    const dim3 grid(static_cast<unsigned>(nblocks));
#define ODC_LAUNCH_P2P(T)                                                                                            \
  (mode == kAtomicScalar   ? scatter_add_p2p_kernel<T, kAtomicScalar><<<grid, kP2PThreads, 0, s>>>(table, count, scale) \
   : mode == kAtomicVector ? scatter_add_p2p_kernel<T, kAtomicVector><<<grid, kP2PThreads, 0, s>>>(table, count, scale) \
                           : scatter_add_p2p_kernel<T, kPlainRmw><<<grid, kP2PThreads, 0, s>>>(table, count, scale))
    switch (src_dtype) {
      case kF32: ODC_LAUNCH_P2P(float); break;
      case kBF16: ODC_LAUNCH_P2P(__nv_bfloat16); break;
      case kF16: ODC_LAUNCH_P2P(__half); break;
      default: snprintf(g_error, sizeof(g_error), "odc_scatter_add_p2p: bad dtype %d", src_dtype); return -1;
    }
#undef ODC_LAUNCH_P2P
    if (int err = set_error(cudaGetLastError(), "odc_scatter_add_p2p launch")) return err;
  }
  return 0;
}

int odc_scatter_add_rma(const int64_t* host_tasks, int ntasks, int src_dtype, float scale, float* scratch, int ctas,
                        void* stream) {
  const Task* tasks = reinterpret_cast<const Task*>(host_tasks);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  TaskTable table;
  for (int begin = 0; begin < ntasks; begin += kMaxTasks) {
    const int count = ntasks - begin < kMaxTasks ? ntasks - begin : kMaxTasks;
    const int64_t nchunks = fill_table(&table, tasks, begin, begin + count, kRmaChunkElems);
    if (nchunks == 0) continue;
    const unsigned grid = static_cast<unsigned>(nchunks < ctas ? nchunks : ctas);
    switch (src_dtype) {
      case kF32: scatter_add_rma_kernel<float><<<grid, kRmaThreads, 0, s>>>(table, count, nchunks, scale, scratch); break;
      case kBF16:
        scatter_add_rma_kernel<__nv_bfloat16><<<grid, kRmaThreads, 0, s>>>(table, count, nchunks, scale, scratch);
        break;
      case kF16: scatter_add_rma_kernel<__half><<<grid, kRmaThreads, 0, s>>>(table, count, nchunks, scale, scratch); break;
      default: snprintf(g_error, sizeof(g_error), "odc_scatter_add_rma: bad dtype %d", src_dtype); return -1;
    }
    if (int err = set_error(cudaGetLastError(), "odc_scatter_add_rma launch")) return err;
  }
  return 0;
}

// -- lock-step meetings ---------------------------------------------------------------------------------------------

// `peers`: device array of `world` addresses (every rank's copy of the counter array); `counts`: this rank's copy;
// `stats`: device array of 2 + world entries (see lockstep_barrier_kernel). Ordered on `stream`: the host does not
// wait.
int odc_lockstep_barrier(const int64_t* peers, unsigned long long* counts, int world, int me, unsigned long long epoch,
                         unsigned long long timeout_ns, unsigned long long* stats, void* stream) {
  lockstep_barrier_kernel<<<1, kLockstepThreads, 0, static_cast<cudaStream_t>(stream)>>>(peers, counts, world, me,
                                                                                          epoch, timeout_ns, stats);
  return set_error(cudaGetLastError(), "odc_lockstep_barrier launch");
}

}  // extern "C"
