// Python binding of the ds_odc NVSHMEM extension.
//
// Plain C++ over pybind11: no CUDA or NVSHMEM headers here (they live in odc_kernels.cu, which is compiled with
// -rdc and device-linked separately; see ds_odc/ops/builder.py). Pointers and streams cross the boundary as Python
// ints, so this file also compiles against a CPU-only torch.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

extern "C" {
const char* odc_last_error();
int64_t odc_rma_chunk_elems();
int odc_init_status();
int odc_attach();
int odc_my_pe();
int odc_n_pes();
void* odc_malloc(size_t nbytes);
void odc_free(void* ptr);
void* odc_peer_ptr(void* sym, int pe);
int odc_copy_batch(int n, const int64_t* dst, const int64_t* src, const int64_t* nbytes, void* stream);
int odc_get_batch(int n, const int64_t* dst, const int64_t* src, const int64_t* nbytes, const int64_t* pes,
                  void* stream);
int odc_quiet_on_stream(void* stream);
int odc_scatter_add_p2p(const int64_t* host_tasks, int ntasks, int src_dtype, float scale, int mode, void* stream);
int odc_scatter_add_rma(const int64_t* host_tasks, int ntasks, int src_dtype, float scale, float* scratch, int ctas,
                        void* stream);
int odc_lockstep_barrier(const int64_t* peers, unsigned long long* counts, int world, int me, unsigned long long epoch,
                         unsigned long long timeout_ns, unsigned long long* stats, void* stream);
}

namespace py = pybind11;

namespace {

void* as_ptr(int64_t value) { return reinterpret_cast<void*>(static_cast<intptr_t>(value)); }
const int64_t* host_array(int64_t address) { return static_cast<const int64_t*>(as_ptr(address)); }

void check(int status) {
  if (status != 0) throw std::runtime_error(std::string("ds_odc nvshmem op: ") + odc_last_error());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_odc one-sided transport kernels over NVSHMEM 3.4";
  m.def("rma_chunk_elems", &odc_rma_chunk_elems);
  m.def("init_status", &odc_init_status);
  m.def("attach", [] { check(odc_attach()); });
  m.def("my_pe", &odc_my_pe);
  m.def("n_pes", &odc_n_pes);
  m.def("malloc", [](int64_t nbytes) {
    py::gil_scoped_release nogil;  // collective: peers may take a while to arrive
    return reinterpret_cast<int64_t>(odc_malloc(static_cast<size_t>(nbytes)));
  });
  m.def("free", [](int64_t ptr) {
    py::gil_scoped_release nogil;
    odc_free(as_ptr(ptr));
  });
  m.def("peer_ptr", [](int64_t sym, int pe) { return reinterpret_cast<int64_t>(odc_peer_ptr(as_ptr(sym), pe)); });
  // Batches arrive as addresses of host int64 arrays (numpy), `n` entries each: no per-element conversion.
  m.def("copy_batch", [](int64_t dst, int64_t src, int64_t nbytes, int n, int64_t stream) {
    check(odc_copy_batch(n, host_array(dst), host_array(src), host_array(nbytes), as_ptr(stream)));
  });
  m.def("get_batch", [](int64_t dst, int64_t src, int64_t nbytes, int64_t pes, int n, int64_t stream) {
    check(odc_get_batch(n, host_array(dst), host_array(src), host_array(nbytes), host_array(pes), as_ptr(stream)));
  });
  m.def("quiet_on_stream", [](int64_t stream) { check(odc_quiet_on_stream(as_ptr(stream))); });
  // tasks: address of a host int64 array of [ntasks, 6] rows (dst, src, n, -, pe, -), see odc_kernels.cu
  // mode: 0 scalar fp32 reductions, 1 vector fp32 reductions, 2 plain read-modify-write (single-writer slots)
  m.def("scatter_add_p2p", [](int64_t tasks, int ntasks, int src_dtype, float scale, int mode, int64_t stream) {
    check(odc_scatter_add_p2p(host_array(tasks), ntasks, src_dtype, scale, mode, as_ptr(stream)));
  });
  m.def("scatter_add_rma", [](int64_t tasks, int ntasks, int src_dtype, float scale, int64_t scratch, int ctas,
                              int64_t stream) {
    check(odc_scatter_add_rma(host_array(tasks), ntasks, src_dtype, scale, static_cast<float*>(as_ptr(scratch)), ctas,
                              as_ptr(stream)));
  });
  // zero_optimization.odc.lockstep: peers and stats are device addresses, counts a symmetric one (see odc_kernels.cu)
  m.def("lockstep_barrier", [](int64_t peers, int64_t counts, int world, int me, uint64_t epoch, uint64_t timeout_ns,
                               int64_t stats, int64_t stream) {
    check(odc_lockstep_barrier(static_cast<const int64_t*>(as_ptr(peers)),
                               static_cast<unsigned long long*>(as_ptr(counts)), world, me, epoch, timeout_ns,
                               static_cast<unsigned long long*>(as_ptr(stats)), as_ptr(stream)));
  });
}
