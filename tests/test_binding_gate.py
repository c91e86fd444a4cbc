"""The binding gate: every ctypes declaration ncclpy makes of NCCL, proven against the real
nccl.h of the installed NCCL wheel by the C++ compiler (CPU only, in CI).

For every entry of :data:`ncclpy._nccl.functions.FUNCTIONS`: the prototype's parameter count,
and for each parameter and the return type, its size and ABI class (integer / pointer /
floating / struct by value), read from the header's own declaration by template deduction.  For
every struct of :data:`ncclpy._nccl.abi.STRUCTS`: sizeof, each field's offset and size, and the
bytes of NCCL's initializer macro against ncclpy's default instance.  For every constant of
:data:`ncclpy._nccl.abi.CONSTANTS`: its value.  A Structure ncclpy declares in ``ncclpy._nccl``
without a gate entry fails.
"""
from __future__ import annotations

import ctypes
import importlib
import inspect
import os
import pkgutil
import shutil
import subprocess
from typing import Dict, List, Tuple

import pytest

import ncclpy._nccl as pkg
from ncclpy._nccl.abi import CONSTANTS, STRUCTS
from ncclpy._nccl.functions import FUNCTIONS

from gate_util import header_dirs, older_header_reason

_CLASSES = r"""
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <nccl.h>
template <class T> struct Size { static const size_t v = sizeof(T); };
template <> struct Size<void> { static const size_t v = 0; };
template <class T> char cls() {
  return std::is_void<T>::value ? 'v' : std::is_pointer<T>::value ? 'p'
       : std::is_floating_point<T>::value ? 'f'
       : (std::is_integral<T>::value || std::is_enum<T>::value) ? 'i'
       : (std::is_class<T>::value || std::is_union<T>::value) ? 's' : '?';
}
template <class F> struct Sig;
template <class R, class... A> struct Sig<R (*)(A...)> { static void print(const char* name) {
  std::printf("F %s %c%zu", name, cls<R>(), Size<R>::v);
  int each[] = {0, (std::printf(" %c%zu", cls<A>(), Size<A>::v), 0)...};
  (void)each;
  std::printf("\n");
} };
template <class T> void bytes(const char* name, const T& x) {
  const unsigned char* p = (const unsigned char*)&x;
  std::printf("I %s ", name);
  for (size_t i = 0; i < sizeof(T); i++) std::printf("%02x", p[i]);
  std::printf("\n");
}
"""


def _ctype_class(t) -> Tuple[str, int]:
    """(ABI class, size) of a ctypes type as the C ABI passes it."""
    if t is None:
        return "v", 0
    if isinstance(t, type) and issubclass(t, (ctypes.Structure, ctypes.Union)):
        return "s", ctypes.sizeof(t)
    if t in (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p) or \
            (isinstance(t, type) and issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr))):
        return "p", ctypes.sizeof(t)
    if t in (ctypes.c_float, ctypes.c_double, ctypes.c_longdouble):
        return "f", ctypes.sizeof(t)
    return "i", ctypes.sizeof(t)


def _program() -> str:
    lines = [_CLASSES]
    for name, entry in STRUCTS.items():
        if entry.initializer:
            lines.append(f"static const {name} init_{name} = {entry.initializer};")
    lines.append("int main() {")
    for name in FUNCTIONS:
        lines.append(f'  Sig<decltype(&{name})>::print("{name}");')
    for name, entry in STRUCTS.items():
        lines.append(f'  std::printf("S {name} %zu\\n", sizeof({name}));')
        for fname, _t in entry.ctype._fields_:
            lines.append(f'  std::printf("O {name} {fname} %zu %zu\\n", offsetof({name}, '
                         f'{fname}), sizeof((({name}*)0)->{fname}));')
        if entry.initializer:
            lines.append(f'  bytes("{name}", init_{name});')
    for expr in CONSTANTS:
        lines.append(f'  std::printf("C {expr} %lld\\n", (long long)({expr}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines)


def _require_a_new_enough_header(include_dir: str) -> None:
    """Skip (CI: fail) where the installed nccl.h predates the newest API ncclpy binds."""
    why = older_header_reason(include_dir)
    if why:
        if os.environ.get("NCCLPY_REQUIRE_GATE") == "1":
            pytest.fail(f"the binding gate could not run: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Dict[str, List[str]]:
    cxx = shutil.which("c++") or shutil.which("g++")
    inc = header_dirs()
    if not cxx or len(inc) < 2:
        why = ("needs a C++ compiler, NCCL's nccl.h and CUDA's cuda_runtime.h "
               f"(compiler: {cxx}, include dirs found: {inc})")
        if os.environ.get("NCCLPY_REQUIRE_GATE") == "1":     # CI: the gate must run
            pytest.fail(f"the binding gate could not run: {why}")
        pytest.skip(why)
    _require_a_new_enough_header(inc[0])
    d = tmp_path_factory.mktemp("gate")
    (d / "gate.cc").write_text(_program())
    exe = d / "gate"
    r = subprocess.run([cxx, "-std=c++11", *[f"-I{x}" for x in inc], str(d / "gate.cc"),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    table: Dict[str, List[str]] = {}
    for line in out.splitlines():
        kind, rest = line.split(" ", 1)
        table.setdefault(kind, []).append(rest)
    return table


def _prototypes(gate) -> Dict[str, List[Tuple[str, int]]]:
    seen = {}
    for line in gate["F"]:
        name, *parts = line.split()
        seen[name] = [(p[0], int(p[1:])) for p in parts]
    return seen


def _function_mismatches(seen, table) -> List[str]:
    bad = []
    for name, (restype, argtypes, _need) in table.items():
        ours = [_ctype_class(restype)] + [_ctype_class(a) for a in argtypes]
        if ours != seen[name]:
            bad.append(f"{name}: nccl.h (ret, params) {seen[name]}, ctypes {ours}")
    return bad


def test_every_function_matches_its_prototype(gate):
    seen = _prototypes(gate)
    assert set(seen) == set(FUNCTIONS)
    bad = _function_mismatches(seen, FUNCTIONS)
    assert not bad, "\n".join(bad)


def test_every_struct_matches_its_layout_and_initializer(gate):
    sizes = dict(line.split() for line in gate["S"])
    offsets = {}
    for line in gate["O"]:
        s, f, off, size = line.split()
        offsets[(s, f)] = (int(off), int(size))
    inits = dict(line.split() for line in gate["I"])
    for name, entry in STRUCTS.items():
        t = entry.ctype
        assert int(sizes[name]) == ctypes.sizeof(t), name
        for fname, _ in t._fields_:
            f = getattr(t, fname)
            assert offsets[(name, fname)] == (f.offset, f.size), (name, fname)
        if entry.initializer is None:
            continue
        theirs = bytearray(bytes.fromhex(inits[name]))
        ours = bytearray(bytes(entry.ours()))
        assert len(theirs) == len(ours), name
        for fname in entry.differs:          # written on purpose: versioned size / version
            f = getattr(t, fname)
            theirs[f.offset:f.offset + f.size] = ours[f.offset:f.offset + f.size]
        assert theirs == ours, (name, theirs.hex(), ours.hex())


def test_every_constant_equals_the_header(gate):
    theirs = {}
    for line in gate["C"]:
        expr, value = line.rsplit(" ", 1)
        theirs[expr] = int(value)
    bad = {e: (theirs[e], v) for e, v in CONSTANTS.items() if theirs[e] != v}
    assert not bad, f"nccl.h vs ncclpy: {bad}"


def test_the_loaded_libnccl_exports_every_function_its_version_has():
    from ncclpy import errors
    from ncclpy._nccl import lib as L
    try:
        lib = L.get_lib()
    except errors.MissingDependencyError as e:
        pytest.skip(f"no libnccl here: {e}")
    missing = [n for n, (_r, _a, need) in FUNCTIONS.items()
               if need <= lib.version and not hasattr(lib.cdll, n)]
    assert not missing, f"{lib.path} (NCCL {lib.version}) lacks {missing}"


def test_every_struct_ncclpy_declares_has_a_gate_entry():
    declared = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for obj in vars(mod).values():
            if inspect.isclass(obj) and issubclass(obj, ctypes.Structure) and \
                    obj.__module__ == mod.__name__ and not obj.__name__.startswith("_"):
                declared.add(obj)
    gated = {e.ctype for e in STRUCTS.values()}
    assert declared - gated == set(), f"structs without a gate entry: {declared - gated}"


def test_the_gate_is_not_empty_and_sees_a_mismatch(gate):
    """The gate can fail: a wrong size, class or count in a declaration is told apart."""
    assert len(gate["F"]) == len(FUNCTIONS) >= 50 and len(gate["C"]) == len(CONSTANTS)
    seen = _prototypes(gate)
    restype, argtypes, need = FUNCTIONS["ncclAllReduce"]
    for wrong in ((restype, argtypes[:2] + (ctypes.c_int,) + argtypes[3:], need),   # size
                  (restype, argtypes[:3] + (ctypes.c_void_p,) + argtypes[4:], need),  # class
                  (restype, argtypes[:-1], need),                                      # count
                  (ctypes.c_double, argtypes, need)):                                  # return
        assert _function_mismatches(seen, {"ncclAllReduce": wrong}), wrong
    bad = _function_mismatches(seen, {"ncclParamGetI8": (ctypes.c_int, (
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int8)), 0)})
    assert not bad     # a pointer to a 1-byte int is still a pointer: classes, not types


def test_the_versions_ncclpy_writes_cover_the_headers_versioned_structs():
    """nccl.h names each versioned struct after the version of its layout
    (``ncclSimInfo_v22200``): the ``version`` ncclpy writes is never below it, or NCCL would
    reset the newer fields ncclpy set."""
    import re
    from ncclpy._nccl import collconfig, config, encryption, group
    inc = header_dirs()
    if not inc:
        pytest.skip("no nccl.h here")
    _require_a_new_enough_header(inc[0])
    text = open(os.path.join(inc[0], "nccl.h")).read()
    found = {alias: int(v) for v, alias in re.findall(
        r"typedef struct \w+_v(\d+) \{.*?\} (\w+);", text, flags=re.S)}
    ours = {"ncclConfig_t": config.CONFIG_VERSION, "ncclCollConfig_t":
            collconfig.COLL_CONFIG_VERSION, "ncclSimInfo_t": group.SIM_INFO_VERSION,
            "ncclEncryptionConfig_t": encryption.ENCRYPTION_CONFIG_VERSION}
    assert set(ours) <= set(found), found
    low = {k: (v, found[k]) for k, v in ours.items() if v < found[k]}
    assert not low, f"ncclpy writes an older version than nccl.h's layout: {low}"
