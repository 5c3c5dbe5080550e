// Python binding of the ds_odc NVSHMEM extension.
//
// Plain C++ over pybind11: no CUDA or NVSHMEM headers here (they live in odc_kernels.cu, which is compiled with
// -rdc and device-linked separately; see ds_odc/ops/builder.py). Pointers and streams cross the boundary as Python
// ints, so this file also compiles against a CPU-only torch.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
const char* odc_last_error();
int64_t odc_p2p_elems_per_block();
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
int odc_scatter_add_p2p(const void* tasks, int ntasks, int64_t nblocks, int src_dtype, float scale, int mode,
                        void* stream);
int odc_scatter_add_rma(const void* tasks, int ntasks, int64_t nchunks, int src_dtype, float scale, float* scratch,
                        int ctas, void* stream);
}

namespace py = pybind11;

namespace {

void* as_ptr(int64_t value) { return reinterpret_cast<void*>(static_cast<intptr_t>(value)); }

void check(int status) {
  if (status != 0) throw std::runtime_error(std::string("ds_odc nvshmem op: ") + odc_last_error());
}

void check_lengths(const std::vector<int64_t>& a, const std::vector<int64_t>& b, const std::vector<int64_t>& c) {
  if (a.size() != b.size() || a.size() != c.size()) throw std::invalid_argument("ds_odc: batch lists differ in length");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_odc one-sided transport kernels over NVSHMEM 3.4";
  m.def("p2p_elems_per_block", &odc_p2p_elems_per_block);
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
  m.def("copy_batch", [](const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
                         const std::vector<int64_t>& nbytes, int64_t stream) {
    check_lengths(dst, src, nbytes);
    check(odc_copy_batch(static_cast<int>(dst.size()), dst.data(), src.data(), nbytes.data(), as_ptr(stream)));
  });
  m.def("get_batch", [](const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
                        const std::vector<int64_t>& nbytes, const std::vector<int64_t>& pes, int64_t stream) {
    check_lengths(dst, src, nbytes);
    if (pes.size() != dst.size()) throw std::invalid_argument("ds_odc: batch lists differ in length");
    check(odc_get_batch(static_cast<int>(dst.size()), dst.data(), src.data(), nbytes.data(), pes.data(),
                        as_ptr(stream)));
  });
  m.def("quiet_on_stream", [](int64_t stream) { check(odc_quiet_on_stream(as_ptr(stream))); });
  // mode: 0 scalar fp32 reductions, 1 vector fp32 reductions, 2 plain read-modify-write (single-writer slots)
  m.def("scatter_add_p2p", [](int64_t tasks, int ntasks, int64_t nblocks, int src_dtype, float scale, int mode,
                              int64_t stream) {
    check(odc_scatter_add_p2p(as_ptr(tasks), ntasks, nblocks, src_dtype, scale, mode, as_ptr(stream)));
  });
  m.def("scatter_add_rma", [](int64_t tasks, int ntasks, int64_t nchunks, int src_dtype, float scale, int64_t scratch,
                              int ctas, int64_t stream) {
    check(odc_scatter_add_rma(as_ptr(tasks), ntasks, nchunks, src_dtype, scale, static_cast<float*>(as_ptr(scratch)),
                              ctas, as_ptr(stream)));
  });
}
