#!/usr/bin/env python3
"""The compiler of the CUDA 12 build (docs/cuda12.md): nvcc's command line, for the options
build.rs passes, on NVRTC and nvFatbin of the CUDA 12 wheels that `ci/setup.sh --cuda 12` installs
into .toolchain/cu12 (PyPI has no CUDA 12 nvcc). `.toolchain/env-cu12.sh` sets NVCC to this file,
and build.rs runs it as it runs nvcc:

    nvcc-nvrtc.py --version | --list-gpu-code
    nvcc-nvrtc.py --fatbin [-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -fmad=false
                  -Xptxas=<opts> -ccbin <cc> -I <dir> ...] -gencode=arch=compute_<a>,code=sm_<a> ...
                  [-gencode=arch=compute_<a>,code=compute_<a>] -o <out.fatbin> <src.cu>

NVRTC compiles the source once per architecture (the machine code, and the PTX it was made from
for a `code=compute_<a>` of the same architecture); nvFatbin puts them into one fatbin. Any other
option is refused. NVRTC compiles device code only and brings no C library headers: the three the
kernels include (<stdint.h>, <stddef.h>, <type_traits>) are given below, with the types nvcc's
device pass has on 64-bit Linux; the CUDA headers come from the runtime and CCCL wheels.
"""
import ctypes
import hashlib
import os
import sys

HOME = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".toolchain",
                    "cu12")
NV = os.path.join(HOME, "nvidia")
NVRTC, NVFATBIN = "cuda_nvrtc/lib/libnvrtc.so.12", "nvfatbin/lib/libnvfatbin.so.12"
PACKAGES = ("nvidia_cuda_nvrtc_cu12", "nvidia_nvfatbin_cu12", "nvidia_cuda_runtime_cu12",
            "nvidia_cuda_cccl_cu12")
HEADERS = {
    # glibc's LP64 types, as nvcc sees them on Linux (uint64_t is unsigned long).
    "stdint.h": """#pragma once
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long uint64_t; typedef long intptr_t; typedef unsigned long uintptr_t;
typedef long intmax_t; typedef unsigned long uintmax_t;
""",
    # NVRTC's front end has no __builtin_offsetof; __INTADDR__ is its constant address.
    "stddef.h": """#pragma once
typedef unsigned long size_t; typedef long ptrdiff_t;
#define NULL 0
#define offsetof(T, m) ((size_t)__INTADDR__(&(((T*)0)->m)))
""",
    "type_traits": """#pragma once
namespace std {
template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };
template <bool C, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
}
""",
}


def fail(msg):
    sys.exit(f"nvcc-nvrtc: {msg}")


def lib(path):
    try:
        return ctypes.CDLL(os.path.join(NV, path))
    except OSError as e:
        fail(f"{e} (run ci/setup.sh --cuda 12)")


def version():
    """The compiler's identity; build.rs keys its fatbin cache on it."""
    nvrtc, fatbin = lib(NVRTC), lib(NVFATBIN)
    a, b = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    c, d = ctypes.c_uint(), ctypes.c_uint()
    fatbin.nvFatbinVersion(ctypes.byref(c), ctypes.byref(d))
    found = sorted(n[:-len(".dist-info")] for n in os.listdir(HOME)
                   if n.endswith(".dist-info") and n.startswith(PACKAGES))
    with open(__file__, "rb") as f:
        me = hashlib.sha256(f.read()).hexdigest()[:16]
    print(f"nvcc-nvrtc ({me}): CUDA C++ to fatbin through NVRTC and nvFatbin")
    print(f"NVRTC {a.value}.{b.value}, nvFatbin {c.value}.{d.value}: {', '.join(found)}")


def get(nvrtc, prog, what):
    """NVRTC's output `what` (ProgramLog, PTX, CUBIN) of `prog`."""
    n = ctypes.c_size_t()
    getattr(nvrtc, f"nvrtcGet{what}Size")(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    getattr(nvrtc, f"nvrtcGet{what}")(prog, buf)
    return buf.raw


def compile_one(nvrtc, src, name, options, arch, sass):
    """(machine code for sm_<arch> or None without `sass`, PTX for compute_<arch>); NVRTC's
    messages (ptxas's spill warnings among them) go to stderr."""
    prog = ctypes.c_void_p()
    names = list(HEADERS)
    texts = (ctypes.c_char_p * len(names))(*[HEADERS[n].encode() for n in names])
    includes = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
    r = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), len(names), texts,
                                 includes)
    if r != 0:
        fail(f"{name}: nvrtcCreateProgram returned {r}")
    target = f"{'sm' if sass else 'compute'}_{arch}"
    opts = [f"-arch={target}"] + options
    r = nvrtc.nvrtcCompileProgram(prog, len(opts),
                                  (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
    log = get(nvrtc, prog, "ProgramLog").rstrip(b"\0").decode(errors="replace")
    if r != 0:
        fail(f"{name} for {target} did not compile:\n{log}")
    if log.strip():
        sys.stderr.write(log)
    images = (get(nvrtc, prog, "CUBIN") if sass else None, get(nvrtc, prog, "PTX"))
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return images


def fatbin(sass, ptx, images, name):
    """The fatbin of the machine code of `sass` and the PTX of `ptx` (architectures)."""
    fb = lib(NVFATBIN)
    fb.nvFatbinGetErrorString.restype = ctypes.c_char_p

    def check(r, what):
        if r != 0:
            fail(f"nvFatbin {what}: {fb.nvFatbinGetErrorString(r).decode()}")
    handle = ctypes.c_void_p()
    options = (ctypes.c_char_p * 1)(b"-64")
    check(fb.nvFatbinCreate(ctypes.byref(handle), options, ctypes.c_size_t(1)), "create")
    for a in sass:
        code = images[a][0]
        check(fb.nvFatbinAddCubin(handle, code, ctypes.c_size_t(len(code)), a.encode(), name),
              f"sm_{a}")
    for a in ptx:
        code = images[a][1]  # with its terminating NUL, as nvFatbin wants it
        check(fb.nvFatbinAddPTX(handle, code, ctypes.c_size_t(len(code)), a.encode(), name, b""),
              f"compute_{a}")
    size = ctypes.c_size_t()
    check(fb.nvFatbinSize(handle, ctypes.byref(size)), "size")
    buf = ctypes.create_string_buffer(size.value)
    check(fb.nvFatbinGet(handle, buf), "get")
    fb.nvFatbinDestroy(ctypes.byref(handle))
    return buf.raw


def main(argv):
    if argv == ["--version"]:
        return version()
    if argv == ["--list-gpu-code"]:
        nvrtc = lib(NVRTC)
        n = ctypes.c_int()
        nvrtc.nvrtcGetNumSupportedArchs(ctypes.byref(n))
        archs = (ctypes.c_int * n.value)()
        nvrtc.nvrtcGetSupportedArchs(archs)
        print("\n".join(f"sm_{a}" for a in archs))
        return None
    # NVRTC takes a function without an execution space for host code, which it cannot compile;
    # nvcc makes a lambda in device code a device function, and lets device code call constexpr
    # functions (--expt-relaxed-constexpr). -default-device makes them device functions (the
    # product's PTX is byte for byte the same with and without it; the test-only codec kernels
    # need it).
    options = ["-default-device", f"--include-path={NV}/cuda_runtime/include",
               f"--include-path={NV}/cuda_cccl/include"]
    sass, ptx, out, src, fatbin_wanted = [], [], None, None, False
    args = iter(argv)
    for a in args:
        if a == "--fatbin":
            fatbin_wanted = True
        elif a == "-O3":
            pass  # nvcc's -O applies to host code; NVRTC optimizes device code fully by default
        elif a == "--expt-relaxed-constexpr":
            pass  # NVRTC has no such flag; -default-device below allows what it allows
        elif a in ("-std=c++17", "-lineinfo", "-fmad=false", "-fmad=true"):
            options.append(a)
        elif a.startswith("-Xptxas="):
            options.append("--ptxas-options=" + a[len("-Xptxas="):])
        elif a == "-ccbin":
            next(args, None)  # no host code: no host compiler
        elif a == "-I":
            options.append("--include-path=" + next(args, ""))
        elif a.startswith("-gencode=arch=compute_"):
            virt, _, code = a[len("-gencode=arch=compute_"):].partition(",code=")
            if code not in (f"sm_{virt}", f"compute_{virt}"):
                fail(f"{a}: only code=sm_<a> or code=compute_<a> of the same <a>")
            (sass if code.startswith("sm_") else ptx).append(virt)
        elif a == "-o":
            out = next(args, None)
        elif not a.startswith("-") and src is None:
            src = a
        else:
            fail(f"option {a!r} is not supported (see {__file__})")
    if not (fatbin_wanted and out and src and (sass or ptx)):
        fail("usage: --fatbin [options] -gencode=... -o <out> <src.cu>")
    nvrtc = lib(NVRTC)
    with open(src, "rb") as f:
        code = f.read()
    # One compile per architecture: the PTX of a machine-code compile serves code=compute_<a> too.
    images = {a: compile_one(nvrtc, code, src, options, a, a in sass)
              for a in dict.fromkeys(sass + ptx)}
    image = fatbin(sass, ptx, images, os.path.basename(src).encode())
    with open(out, "wb") as f:
        f.write(image)
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
