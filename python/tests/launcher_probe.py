"""Run by check_wheel.py under the launcher (`flashcomm run ... -- python launcher_probe.py`): reports
on standard output, as one JSON object, the environment it was given and what that environment did
(whether flashcomm's library is preloaded in this process, what the already loaded libnccl.so.2
answers). Exits with the status given as its first argument (default 0)."""
import ctypes
import json
import os
import sys

NAMES = ["LD_PRELOAD", "VLLM_NCCL_SO_PATH", "SGLANG_NCCL_SO_PATH", "FLASHCOMM_NCCL_LIB",
         "FLASHCOMM_QUANT_BITS", "FLASHCOMM_QUANT_AG_BITS", "FLASHCOMM_QUANT_GROUP",
         "FLASHCOMM_MAX_BYTES", "FLASHCOMM_DISABLE", "NCCL_DEBUG"]

report = {"env": {n: os.environ.get(n) for n in NAMES}, "pid": os.getpid()}
with open("/proc/self/maps") as f:
    report["mapped"] = sorted({line.split()[-1] for line in f if "libnccl" in line})

# The libnccl.so.2 this process has (by its SONAME): with the library preloaded, flashcomm's.
lib = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
report["is_flashcomm"] = hasattr(lib, "flashcommGetVersion")
v = ctypes.c_int(0)
report["nccl_get_version_rc"] = lib.ncclGetVersion(ctypes.byref(v))
report["nccl_version"] = v.value
buf = ctypes.create_string_buffer(8192)
report["config_rc"] = lib.flashcommGetConfigString(buf, ctypes.c_size_t(len(buf)))
report["config"] = buf.value.decode()

import flashcomm  # noqa: E402  (after the checks above, which must not depend on it)

report["stats"] = flashcomm.stats()
report["summary"] = flashcomm.summary()
print(json.dumps(report))
sys.stdout.flush()
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
