#!/usr/bin/env python3
"""Loads flashcomm's libnccl.so.2 by path with ctypes, the way vLLM's pynccl wrapper does with
VLLM_NCCL_SO_PATH, binds the same functions vLLM binds, and exercises them.

    python3 ctypes_load.py --lib PATH [--expect-version N] [--gpu]

Without --gpu it checks what works on any machine (versions, error strings, argument checks, the
last error). With --gpu it also creates a world-size-1 communicator on cuda:0 with a torch tensor
and all-reduces it. Prints PASS/FAIL lines; the exit status is the number of failures.
"""
import argparse
import ctypes
import sys

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
ncclWindow_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class flashcommStats_t(ctypes.Structure):
    _fields_ = [("calls", (ctypes.c_uint64 * 8) * 3), ("bytes", (ctypes.c_uint64 * 8) * 3)]


class flashcommCommInfo_t(ctypes.Structure):
    _fields_ = [("served", ctypes.c_int), ("rank", ctypes.c_int), ("nranks", ctypes.c_int),
                ("device", ctypes.c_int), ("arena_bytes", ctypes.c_uint64),
                ("reason", ctypes.c_char * 256)]


# name -> (restype, argtypes): the functions vLLM's NCCLLibrary binds.
FUNCTIONS = {
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
    "ncclGetLastError": (ctypes.c_char_p, [ncclComm_t]),
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    "ncclCommInitRank": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    "ncclAllReduce": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t,
                                     ncclRedOp_t, ncclComm_t, cudaStream_t]),
    "ncclReduce": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t,
                                  ncclRedOp_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    "ncclAllGather": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t,
                                     ncclComm_t, cudaStream_t]),
    "ncclReduceScatter": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t,
                                         ncclRedOp_t, ncclComm_t, cudaStream_t]),
    "ncclSend": (ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int,
                                ncclComm_t, cudaStream_t]),
    "ncclRecv": (ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int,
                                ncclComm_t, cudaStream_t]),
    "ncclBroadcast": (ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t,
                                     ctypes.c_int, ncclComm_t, cudaStream_t]),
    "ncclCommDestroy": (ncclResult_t, [ncclComm_t]),
    "ncclCommAbort": (ncclResult_t, [ncclComm_t]),
    "ncclCommSuspend": (ncclResult_t, [ncclComm_t, ctypes.c_int]),
    "ncclCommResume": (ncclResult_t, [ncclComm_t]),
    "ncclGroupStart": (ncclResult_t, []),
    "ncclGroupEnd": (ncclResult_t, []),
    "ncclCommWindowRegister": (ncclResult_t, [ncclComm_t, buffer_type, ctypes.c_size_t,
                                              ctypes.POINTER(ncclWindow_t), ctypes.c_int]),
    "ncclCommWindowDeregister": (ncclResult_t, [ncclComm_t, ncclWindow_t]),
    "ncclCommQueryProperties": (ncclResult_t, [ncclComm_t, ctypes.c_void_p]),
}

FLOAT32 = 7
SUM = 0
failures = 0


def check(ok, what, detail=""):
    global failures
    if ok:
        print(f"PASS {what}")
    else:
        failures += 1
        print(f"FAIL {what}: {detail}")


def bind(path):
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in FUNCTIONS.items():
        f = getattr(lib, name)  # AttributeError, as in vLLM, if the symbol is missing
        f.restype = restype
        f.argtypes = argtypes
    lib.flashcommGetStats.restype = ncclResult_t
    lib.flashcommGetStats.argtypes = [ncclComm_t, ctypes.POINTER(flashcommStats_t)]
    lib.flashcommCommGetInfo.restype = ncclResult_t
    lib.flashcommCommGetInfo.argtypes = [ncclComm_t, ctypes.POINTER(flashcommCommInfo_t)]
    return lib


def cpu_checks(lib, expect_version):
    v = ctypes.c_int()
    rc = lib.ncclGetVersion(ctypes.byref(v))
    check(rc == 0, "ncclGetVersion", lib.ncclGetLastError(None))
    if expect_version:
        check(v.value == expect_version, "version is the real library's", f"{v.value} != {expect_version}")
    check(lib.ncclGetErrorString(0) == b"no error", "error string 0")
    check(lib.ncclGetErrorString(4) == b"invalid argument (run with NCCL_DEBUG=WARN for details)",
          "error string 4")
    # Bad calls are answered by the real NCCL, as without flashcomm; a handle that is not a
    # communicator (zeroed memory NCCL can read) is "corrupted", whatever else the call says.
    rc = lib.ncclAllReduce(0x1000, 0x2000, 8, FLOAT32, SUM, None, None)
    check(rc == 4, "null comm is an invalid argument", rc)
    msg = lib.ncclGetLastError(None)
    check(b"comm argument is NULL" in msg, "last error names the problem", msg)
    foreign_mem = ctypes.create_string_buffer(64 << 20)
    foreign = ctypes.addressof(foreign_mem)
    rc = lib.ncclAllReduce(None, None, 0, FLOAT32, SUM, foreign, None)
    check(rc == 4 and b"corrupted comm object" in lib.ncclGetLastError(None),
          "count 0 on a handle that is not a communicator", rc)
    rc = lib.ncclSend(0x1000, 8, 77, 0, foreign, None)
    check(rc == 4, "unknown datatype", rc)
    stats = flashcommStats_t()
    check(lib.flashcommGetStats(None, ctypes.byref(stats)) == 0, "flashcommGetStats(NULL)")


def gpu_checks(lib):
    import torch

    torch.cuda.set_device(0)
    uid = ncclUniqueId()
    check(lib.ncclGetUniqueId(ctypes.byref(uid)) == 0, "ncclGetUniqueId", lib.ncclGetLastError(None))
    comm = ncclComm_t()
    rc = lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0)
    check(rc == 0 and comm.value, "ncclCommInitRank world size 1", lib.ncclGetLastError(None))
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.arange(4096, dtype=torch.float32, device="cuda") * 0.25
    y = torch.empty_like(x)
    rc = lib.ncclAllReduce(x.data_ptr(), y.data_ptr(), x.numel(), FLOAT32, SUM, comm, stream)
    torch.cuda.synchronize()
    check(rc == 0 and torch.equal(x, y), "all-reduce result", lib.ncclGetLastError(comm))
    info = flashcommCommInfo_t()
    check(lib.flashcommCommGetInfo(comm, ctypes.byref(info)) == 0, "flashcommCommGetInfo")
    check(info.served == 1, "flashcomm's kernels serve the world-size-1 communicator",
          info.reason.decode(errors="replace"))
    route = 1 if info.served else 0
    stats = flashcommStats_t()
    check(lib.flashcommGetStats(comm, ctypes.byref(stats)) == 0 and stats.calls[route][0] == 1,
          f"the call went through flashcomm on route {route}", [list(r) for r in stats.calls])
    check(lib.ncclCommDestroy(comm) == 0, "ncclCommDestroy")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True, help="flashcomm's libnccl.so (any file name)")
    p.add_argument("--expect-version", type=int, default=0)
    p.add_argument("--gpu", action="store_true")
    args = p.parse_args()
    lib = bind(args.lib)
    check(True, f"bound {len(FUNCTIONS)} functions as vLLM does")
    cpu_checks(lib, args.expect_version)
    if args.gpu:
        gpu_checks(lib)
    print(f"{'FAIL' if failures else 'PASS'}: {failures} failure(s)")
    return min(failures, 100)


if __name__ == "__main__":
    sys.exit(main())
