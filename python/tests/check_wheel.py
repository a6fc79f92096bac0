"""CPU checks of an installed flashcomm wheel, run by ci/wheel-test.sh with the Python of a fresh
virtual environment into which the wheel was just installed (FLASHCOMM_NCCL_LIB and LD_PRELOAD
unset: the real NCCL must be found through the NCCL package the wheel depends on, nvidia-nccl-cu13,
or nvidia-nccl-cu12 for flashcomm-cu12). Prints one PASS/FAIL line per check and ends with
"N passed, N failed"; the exit status is 0 only if every check passed.

    <venv>/bin/python check_wheel.py
"""
import ctypes
import importlib.metadata
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
passed = failed = 0


def check(ok, what, detail=""):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
    print(f"{'PASS' if ok else 'FAIL'} wheel: {what}{'' if ok else ': ' + str(detail)}", flush=True)
    return ok


def probe(cmd, status=0):
    """Runs the launcher `cmd` on launcher_probe.py; its report."""
    full = cmd + [sys.executable, os.path.join(HERE, "launcher_probe.py"), str(status)]
    res = subprocess.run(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shown = " ".join([os.path.basename(cmd[0])] + cmd[1:])
    check(res.returncode == status, f"{shown} <probe> exits with the command's status {status}",
          f"{res.returncode}; stderr: {res.stderr[-2000:]}")
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        check(False, "the probe reported", f"stdout: {res.stdout[-2000:]} stderr: {res.stderr[-2000:]}")
        return None


def main():
    check(not os.environ.get("FLASHCOMM_NCCL_LIB") and not os.environ.get("LD_PRELOAD"),
          "runs without FLASHCOMM_NCCL_LIB and LD_PRELOAD")
    import flashcomm

    pkg = os.path.dirname(os.path.abspath(flashcomm.__file__))
    check(pkg.startswith(os.path.realpath(sys.prefix)) or pkg.startswith(sys.prefix),
          "imported from the virtual environment", pkg)
    check(flashcomm.__version__ != "0+unknown", f"version {flashcomm.__version__}")
    lib_path = flashcomm.library_path()
    check(lib_path == os.path.join(pkg, "lib", "libnccl.so.2") and os.path.isfile(lib_path),
          "library_path() is <package>/lib/libnccl.so.2", lib_path)
    real = flashcomm.real_nccl_path()
    cuda = flashcomm.build_info().get("cuda")
    requires = importlib.metadata.requires(f"flashcomm-cu{cuda}") or []
    check(flashcomm.NCCL_PACKAGE == f"nvidia-nccl-cu{cuda}"
          and any(r.startswith(flashcomm.NCCL_PACKAGE) for r in requires),
          f"flashcomm-cu{cuda} depends on {flashcomm.NCCL_PACKAGE}", requires)
    check(real is not None and real.endswith(os.path.join("nvidia", "nccl", "lib", "libnccl.so.2")),
          f"real_nccl_path() finds the {flashcomm.NCCL_PACKAGE} package", real)
    check(real is None or os.path.realpath(real) != os.path.realpath(lib_path),
          "the real NCCL is not flashcomm's library")

    # The library loads and exports the NCCL API: every function of the real library's nccl.h
    # that the real library exports, in both forms, plus flashcomm's own API.
    ours = ctypes.CDLL(lib_path)
    header = os.path.join(os.path.dirname(os.path.dirname(real or "/")), "include", "nccl.h")
    names = []
    if check(os.path.isfile(header), "the real NCCL's nccl.h is there", header):
        real_lib = ctypes.CDLL(real)
        declared = sorted(set(re.findall(r"\b(p?nccl[A-Za-z0-9_]+)\s*\(", open(header).read())))
        names = [n for n in declared if hasattr(real_lib, n)]
    missing = [n for n in names if not hasattr(ours, n)]
    check(len(names) > 100 and not missing,
          f"library_path() loads and exports the {len(names)} NCCL functions of nccl.h",
          f"missing: {missing}")
    own = ["flashcommGetVersion", "flashcommGetStats", "flashcommGetConfigString",
           "flashcommCommSetQuant", "flashcommCommGetQuant", "flashcommCommGetInfo"]
    check(all(hasattr(ours, n) for n in own), "exports flashcomm's own API")
    v = ctypes.c_int(0)
    check(ours.flashcommGetVersion(ctypes.byref(v)) == 0 and v.value > 0,
          f"flashcommGetVersion answers {v.value}")
    s = flashcomm.stats()
    check(sorted(s) == ["bytes", "calls"]
          and list(s["calls"]) == list(flashcomm.ROUTES)
          and all(list(r) == list(flashcomm.COLLECTIVES) for r in s["calls"].values())
          and sum(n for r in s["calls"].values() for n in r.values()) == 0,
          "stats() reads the route counters (all zero: no collective ran)", s)
    check(flashcomm.summary().startswith("flashcomm summary: calls per route: nccl 0, lossless 0, "
                                         "quantized 0"), "summary()", flashcomm.summary())

    # env(): the variables, and the settings.
    e = flashcomm.env(base={"LD_PRELOAD": "/x/libfoo.so:/old/libnccl.so.2"}, bits=4,
                      ag_bits=8, max_bytes="16M", disable=False)
    want = {
        "LD_PRELOAD": f"{lib_path}:/x/libfoo.so",
        "VLLM_NCCL_SO_PATH": lib_path,
        "SGLANG_NCCL_SO_PATH": lib_path,
        "FLASHCOMM_NCCL_LIB": real,
        "FLASHCOMM_QUANT_BITS": "4",
        "FLASHCOMM_QUANT_AG_BITS": "8",
        "FLASHCOMM_MAX_BYTES": "16M",
        "FLASHCOMM_DISABLE": "0",
    }
    check(e == want, "env() gives the variables and the settings", e)
    e = flashcomm.env(base={"FLASHCOMM_NCCL_LIB": "/opt/nccl/libnccl.so.2"})
    check(e["FLASHCOMM_NCCL_LIB"] == "/opt/nccl/libnccl.so.2" and e["LD_PRELOAD"] == lib_path,
          "env() keeps a FLASHCOMM_NCCL_LIB that is already set", e)

    # The launcher, as a module and as the installed script, on a program that reads its own
    # environment and looks at what is loaded.
    script = os.path.join(os.path.dirname(sys.executable), "flashcomm")
    check(os.access(script, os.X_OK), "the flashcomm script is installed", script)
    for cmd in ([sys.executable, "-m", "flashcomm", "run", "--bits", "4", "--set",
                 "FLASHCOMM_QUANT_GROUP=64", "--"],
                [script, "run", "--bits", "3", "--ag-bits", "8", "--"]):
        r = probe(cmd)
        if r is None:
            continue
        bits = cmd[cmd.index("--bits") + 1]
        env = r["env"]
        check(env["LD_PRELOAD"] == lib_path and env["VLLM_NCCL_SO_PATH"] == lib_path
              and env["SGLANG_NCCL_SO_PATH"] == lib_path and env["FLASHCOMM_NCCL_LIB"] == real
              and env["FLASHCOMM_QUANT_BITS"] == bits,
              f"{os.path.basename(cmd[0])} run sets the variables", env)
        check([os.path.realpath(m) for m in r["mapped"]] == [os.path.realpath(lib_path)],
              "the command runs with flashcomm's library preloaded", r["mapped"])
        check(r["is_flashcomm"], "libnccl.so.2 in the command's process is flashcomm's")
        check(r["nccl_get_version_rc"] == 0 and r["nccl_version"] >= 22707,
              f"ncclGetVersion is forwarded to the real NCCL found through the package "
              f"({r['nccl_version']})", r)
        check(r["config_rc"] == 0 and f"FLASHCOMM_QUANT_BITS={bits}\n" in r["config"]
              and f"FLASHCOMM_NCCL_LIB={real}\n" in r["config"]
              and "passthrough=no" in r["config"],
              "the library read the launcher's settings", r["config"])
        check(sum(n for x in r["stats"]["calls"].values() for n in x.values()) == 0
              and r["summary"].startswith("flashcomm summary: calls per route: nccl 0"),
              "stats() and summary() in the command's process", r["summary"])
    probe([script, "run", "--disable", "--"], status=3)
    res = subprocess.run([script, "run", "--", "no-such-command-flashcomm"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    check(res.returncode == 127 and "command not found" in res.stderr,
          "an unknown command exits with 127", (res.returncode, res.stderr))
    res = subprocess.run([script, "env", "--bits", "4"], stdout=subprocess.PIPE, text=True)
    check(res.returncode == 0 and f"export LD_PRELOAD={lib_path}" in res.stdout
          and "export FLASHCOMM_QUANT_BITS=4" in res.stdout, "flashcomm env", res.stdout)
    res = subprocess.run([script, "info"], stdout=subprocess.PIPE, text=True)
    check(res.returncode == 0 and lib_path in res.stdout and "library: " in res.stdout,
          "flashcomm info", res.stdout)
    check(re.search(r"^CUDA driver: .+", res.stdout, re.M) is not None
          and "settings: valid" in res.stdout
          and re.search(r"^real NCCL: 2\.\d+\.\d+, as the library finds it", res.stdout, re.M)
          and re.search(r"^on this machine: .+", res.stdout, re.M) is not None,
          "flashcomm info says whether a GPU and driver are visible and what the library "
          "would do", res.stdout)

    # Bad settings are refused before anything starts, with the library's own rules: the
    # variable, the value and what is allowed, exit status 2.
    marker = os.path.join(os.getcwd(), "started")
    starter = [sys.executable, "-c", f"open({marker!r}, 'w').close()"]
    bad = [
        (["run", "--bits", "9", "--"], {}, 'FLASHCOMM_QUANT_BITS="9" is not valid; allowed: '),
        (["run", "--bits", "abc", "--"], {}, 'FLASHCOMM_QUANT_BITS="abc" is not valid'),
        (["run", "--set", "FLASHCOMM_PROTO=fast", "--"], {},
         'FLASHCOMM_PROTO="fast" is not valid; allowed: `auto`, `ll`, `block`'),
        (["run", "--group", "100", "--"], {}, 'FLASHCOMM_QUANT_GROUP="100" is not valid'),
        (["run", "--set", "max_bytes=lots", "--"], {}, 'FLASHCOMM_MAX_BYTES="lots" is not valid'),
        (["run", "--set", "FLASHCOMM_PROTOCOL=ll", "--"], {},
         "FLASHCOMM_PROTOCOL='ll': not a flashcomm variable"),
        (["run", "--set", "FLASHCOMM_LOG=flashcomm=[[", "--"], {}, 'FLASHCOMM_LOG="flashcomm=[["'),
        (["run", "--debug", "LOUD", "--"], {}, 'NCCL_DEBUG="LOUD" is not valid'),
        (["run", "--nccl-lib", "/nonexistent/libnccl.so.2", "--"], {},
         "/nonexistent/libnccl.so.2 [FLASHCOMM_NCCL_LIB]: not found"),
        (["run", "--"], {"FLASHCOMM_ALGO": "sideways"}, 'FLASHCOMM_ALGO="sideways" is not valid'),
        (["env", "--bits", "9"], {}, 'FLASHCOMM_QUANT_BITS="9" is not valid'),
    ]
    for argv, extra, words in bad:
        if os.path.exists(marker):
            os.remove(marker)
        cmd = [script] + argv + (starter if argv[0] == "run" else [])
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **extra))
        shown = " ".join(["flashcomm"] + argv) + (f" with {extra}" if extra else "")
        check(res.returncode == 2 and words in res.stderr and "nothing was started" in res.stderr
              and not os.path.exists(marker) and "export " not in res.stdout,
              f"{shown}: refused before anything starts", (res.returncode, res.stderr[-1500:]))
    res = subprocess.run([script, "run", "--bits", "4", "--"] + starter, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    check(res.returncode == 0 and os.path.exists(marker), "valid settings start the command",
          res.stderr[-1500:])

    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
