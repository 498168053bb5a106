#include <torch/extension.h>

#include "intranode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using ep_comm::Intranode;
  pybind11::class_<Intranode>(m, "Intranode")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("ipc_handle", &Intranode::ipc_handle)
      .def("connect", &Intranode::connect)
      .def("close_peers", &Intranode::close_peers)
      .def("free_buffer", &Intranode::free_buffer)
      .def("status", &Intranode::status)
      .def("poison", &Intranode::poison)
      .def_static("control_bytes", &Intranode::control_bytes)
      .def_static("dispatch_slot_bytes", &Intranode::dispatch_slot_bytes)
      .def_static("combine_slot_bytes", &Intranode::combine_slot_bytes)
      .def("barrier", &Intranode::barrier)
      .def("notify", &Intranode::notify)
      .def("dispatch", &Intranode::dispatch)
      .def("combine", &Intranode::combine);
}
