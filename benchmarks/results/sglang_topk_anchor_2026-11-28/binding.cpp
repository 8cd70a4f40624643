// pybind11 binding for the transcribed SGLang top-k (timing run only).
#include <torch/extension.h>

#include <optional>

void fast_topk_interface(
    const at::Tensor& score, at::Tensor& indices, const at::Tensor& lengths, std::optional<at::Tensor> row_starts_opt);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fast_topk", &fast_topk_interface, "SGLang fast_topk (2048 of each row)", py::arg("score"), py::arg("indices"),
        py::arg("lengths"), py::arg("row_starts") = py::none());
}
