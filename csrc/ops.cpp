// The schema, declared once, and the Python module. Importing custom_ops._C runs the static
// registrations of every backend file linked into it.
#include <Python.h>
#include <torch/library.h>

#include "cpu/kernel.h"
#include "fused_gdn_decode.h"

TORCH_LIBRARY(custom, m) {
  m.def(custom_ops::kFusedGdnDecodeSchema);
}

// Helpers for the Python backends (fallback.py), kept out of the `custom` namespace: the slot
// check with the CPU path's exact rules and messages. Takes CPU int32 indices.
TORCH_LIBRARY(custom_ops_internal, m) {
  m.def("check_slot_indices(Tensor indices, int block_num) -> ()",
        [](const at::Tensor& indices, int64_t block_num) {
          custom_ops::check_slot_indices(indices, block_num);
        });
}

namespace {

// _C._cpu_isa() -> str: the CPU kernel variant in use ("avx512", "avx2" or "portable").
PyObject* py_cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(custom_ops::cpu::isa_name(custom_ops::cpu::current_isa()));
}

// _C._set_cpu_isa(name) -> str: switch variant (see kernel.h: set_isa); returns the
// previous one. Raises ValueError for an unknown name or one this CPU/build cannot run.
PyObject* py_set_cpu_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) {
    return nullptr;
  }
  const char* previous = custom_ops::cpu::isa_name(custom_ops::cpu::current_isa());
  std::string error;
  if (!custom_ops::cpu::set_isa(name, &error)) {
    PyErr_SetString(PyExc_ValueError, error.c_str());
    return nullptr;
  }
  return PyUnicode_FromString(previous);
}

// _C._cpu_isas() -> list[str]: the variants this build and this CPU can run.
PyObject* py_cpu_isas(PyObject*, PyObject*) {
  PyObject* list = PyList_New(0);
  for (auto isa : custom_ops::cpu::available_isas()) {
    PyObject* s = PyUnicode_FromString(custom_ops::cpu::isa_name(isa));
    PyList_Append(list, s);
    Py_DECREF(s);
  }
  return list;
}

PyMethodDef kMethods[] = {
    {"_cpu_isa", py_cpu_isa, METH_NOARGS, "CPU kernel variant in use."},
    {"_set_cpu_isa", py_set_cpu_isa, METH_O, "Select the CPU kernel variant; returns the old one."},
    {"_cpu_isas", py_cpu_isas, METH_NOARGS, "CPU kernel variants available here."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};

} // namespace

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&kModule);
}
