// The Python module of the CPU decode kernels (kernels/cpu_decode.py builds and loads it).
// Every entry releases the GIL while it computes.

#include "cpu_decode.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "a decode step's attention over per-sequence KV buffers (writes the new rows first)",
        py::call_guard<py::gil_scoped_release>());
  py::class_<Fp16Linear, std::shared_ptr<Fp16Linear>>(m, "Fp16Linear")
      .def(py::init<const torch::Tensor&>(), "pack a float32 [N, K] weight as float16")
      .def("__call__", &Fp16Linear::forward, "x [T, K] float32 -> x @ W^T [T, N] float32",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("in_features", &Fp16Linear::in_features)
      .def_property_readonly("out_features", &Fp16Linear::out_features);
  py::class_<DecodeLayer, std::shared_ptr<DecodeLayer>>(m, "DecodeLayer")
      .def(py::init([](torch::Tensor ln1, torch::Tensor ln2, std::shared_ptr<Fp16Linear> qkv,
                       std::shared_ptr<Fp16Linear> o, std::shared_ptr<Fp16Linear> gate_up,
                       std::shared_ptr<Fp16Linear> down) {
             auto layer = std::make_shared<DecodeLayer>();
             layer->ln1 = ln1.contiguous();
             layer->ln2 = ln2.contiguous();
             layer->qkv = std::move(qkv);
             layer->o = std::move(o);
             layer->gate_up = std::move(gate_up);
             layer->down = std::move(down);
             return layer;
           }),
           py::arg("ln1"), py::arg("ln2"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"));
  m.def("decode_layers", &decode_layers,
        "every decoder layer of a decode step, x [B, H] updated in place",
        py::call_guard<py::gil_scoped_release>());
}
