"""flashcomm: an NCCL-compatible drop-in ``libnccl.so.2``.

The wheel ships flashcomm's library (CUDA kernels embedded) as ``flashcomm/lib/libnccl.so.2``.
flashcomm runs eligible AllReduce, ReduceScatter, AllGather and AllToAll calls on its own kernels
(lossless, or quantized to 2..8 bits when asked) and forwards every other call to the real NCCL,
which it finds through the NCCL package the wheel depends on (:data:`NCCL_PACKAGE`:
``nvidia-nccl-cu13``, or ``nvidia-nccl-cu12`` for the CUDA 12 build's ``flashcomm-cu12``; both
install ``nvidia.nccl``).

* :func:`library_path` -- the library's file;
* :func:`real_nccl_path` -- the real NCCL of that package;
* :func:`env` -- the environment variables that make a program use flashcomm (``LD_PRELOAD``,
  ``VLLM_NCCL_SO_PATH``, ``SGLANG_NCCL_SO_PATH``, ``FLASHCOMM_NCCL_LIB``) plus any settings;
* :func:`stats` -- calls and bytes per route and collective (``flashcommGetStats``);
* :func:`summary` -- the same as one line of text;
* :func:`check_settings` -- the settings of an environment the library cannot use, by the
  library's own rules (the launcher refuses them before it starts anything);
* :func:`machine` -- what the library would do on this machine (``flashcomm info``);
* ``python -m flashcomm run [--bits 4 ...] -- <command>`` (or the ``flashcomm`` script) runs a
  command with flashcomm preloaded and the settings given.
"""

import ctypes
import importlib.util
import json
import os
import subprocess
import sys

try:
    from ._build import BUILD as _BUILD
    from ._build import NCCL_PACKAGE
    from ._build import VERSION as __version__
except ImportError:  # a source checkout, not an installed wheel
    __version__ = "0+unknown"
    _BUILD = {}
    NCCL_PACKAGE = "nvidia-nccl-cu13"

__all__ = [
    "COLLECTIVES",
    "NCCL_PACKAGE",
    "ROUTES",
    "build_info",
    "check_settings",
    "env",
    "machine",
    "library_path",
    "real_nccl_path",
    "stats",
    "summary",
]

#: Collective kinds, in the order of ``flashcommStats_t`` (``include/flashcomm.h``).
COLLECTIVES = ("allreduce", "reducescatter", "allgather", "alltoall", "broadcast", "reduce",
               "send", "recv")
#: Routes, in the order of ``flashcommStats_t``: forwarded to NCCL, flashcomm's lossless
#: kernels, flashcomm's quantized kernels.
ROUTES = ("nccl", "lossless", "quantized")

_HERE = os.path.dirname(os.path.abspath(__file__))
_SONAME = "libnccl.so.2"

#: Short names of the common settings (keyword arguments of :func:`env`, options of the launcher).
ALIASES = {
    "bits": "FLASHCOMM_QUANT_BITS",
    "rs_bits": "FLASHCOMM_QUANT_RS_BITS",
    "ag_bits": "FLASHCOMM_QUANT_AG_BITS",
    "group": "FLASHCOMM_QUANT_GROUP",
    "spikes": "FLASHCOMM_QUANT_SPIKES",
}


def build_info():
    """How the packaged library was built (a dict written by ci/build-wheel.sh)."""
    return dict(_BUILD)


def library_path():
    """Absolute path of flashcomm's ``libnccl.so.2`` inside this package."""
    path = os.path.join(_HERE, "lib", _SONAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: this flashcomm package holds no library (install the wheel "
            "built by ci/build-wheel.sh)")
    return path


def real_nccl_path():
    """The real ``libnccl.so.2`` of the :data:`NCCL_PACKAGE` package (``nvidia.nccl``), or None
    when that package is not importable. Never flashcomm's own library."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):  # no `nvidia` namespace at all
        return None
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or []:
        path = os.path.join(folder, "lib", _SONAME)
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def _setting_name(key):
    if key in ALIASES:
        return ALIASES[key]
    name = key.upper()
    return name if name.startswith(("FLASHCOMM_", "NCCL_")) else "FLASHCOMM_" + name


def _setting_value(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def env(base=None, nccl_lib=None, **settings):
    """The environment variables that make a program use flashcomm, as a dict to merge into its
    environment (``base``, default ``os.environ``, is read, never changed):

    * ``LD_PRELOAD``: flashcomm's library first, then ``base``'s entries (other ``libnccl*``
      entries are dropped: two preloaded NCCLs would fight over the same symbols);
    * ``VLLM_NCCL_SO_PATH`` and ``SGLANG_NCCL_SO_PATH``: the library, for stacks that load NCCL
      by path;
    * ``FLASHCOMM_NCCL_LIB``: the real NCCL: ``nccl_lib`` if given, else ``base``'s value if it
      has one, else the :data:`NCCL_PACKAGE` package's (omitted when none is found: the library
      then looks for it itself);
    * each keyword setting: ``bits=4`` -> ``FLASHCOMM_QUANT_BITS=4`` (also ``rs_bits``,
      ``ag_bits``, ``group``, ``spikes``); any other ``name=value`` -> ``FLASHCOMM_NAME=value``
      (``max_bytes="16M"`` -> ``FLASHCOMM_MAX_BYTES=16M``; names already starting with
      ``FLASHCOMM_`` or ``NCCL_`` are kept). ``True``/``False`` become ``1``/``0``, lists are
      joined with commas, ``None`` leaves the variable out. See docs/env.md.
    """
    base = os.environ if base is None else base
    lib = library_path()
    kept = [p for p in base.get("LD_PRELOAD", "").replace(" ", ":").split(":")
            if p and not os.path.basename(p).startswith("libnccl")]
    out = {
        "LD_PRELOAD": ":".join([lib] + kept),
        "VLLM_NCCL_SO_PATH": lib,
        "SGLANG_NCCL_SO_PATH": lib,
    }
    real = nccl_lib or base.get("FLASHCOMM_NCCL_LIB") or real_nccl_path()
    if real:
        out["FLASHCOMM_NCCL_LIB"] = os.path.abspath(real)
    for key, value in settings.items():
        if value is not None:
            out[_setting_name(key)] = _setting_value(value)
    return out


class _Stats(ctypes.Structure):
    _fields_ = [("calls", (ctypes.c_uint64 * len(COLLECTIVES)) * len(ROUTES)),
                ("bytes", (ctypes.c_uint64 * len(COLLECTIVES)) * len(ROUTES))]


def _loaded_library():
    """flashcomm's library as this process uses it: the ``libnccl.so.2`` already loaded (by
    ``LD_PRELOAD`` or by path) if it is flashcomm's, else this package's."""
    try:
        lib = ctypes.CDLL(_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        if hasattr(lib, "flashcommGetStats"):
            return lib
    except OSError:
        pass
    return ctypes.CDLL(library_path())


def stats(comm=None):
    """Calls and bytes per route and collective, through ``flashcommGetStats``: process totals
    (every communicator, destroyed ones included), or one communicator's (``comm``: an
    ``ncclComm_t`` as an integer address). Meaningful in the process that runs the collectives
    (the library must be the one it uses: preloaded, or loaded by path).

    Returns ``{"calls": {route: {collective: n}}, "bytes": {route: {collective: n}}}`` with the
    names of :data:`ROUTES` and :data:`COLLECTIVES`.
    """
    lib = _loaded_library()
    fn = lib.flashcommGetStats
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Stats)]
    s = _Stats()
    rc = fn(comm, ctypes.byref(s))
    if rc != 0:
        last = lib.ncclGetLastError
        last.restype = ctypes.c_char_p
        last.argtypes = [ctypes.c_void_p]
        msg = (last(None) or b"").decode(errors="replace")
        raise RuntimeError(f"flashcommGetStats failed with code {rc}: {msg}")
    return {
        field: {r: {c: int(getattr(s, field)[i][j]) for j, c in enumerate(COLLECTIVES)}
                for i, r in enumerate(ROUTES)}
        for field in ("calls", "bytes")
    }


def summary(comm=None):
    """One line of calls per route, each with its collectives, from :func:`stats`, in the words
    of the library's own exit summary: ``flashcomm summary: calls per route: nccl 3 (broadcast
    3), lossless 120 (allreduce 100, allgather 20), quantized 0``."""
    calls = stats(comm)["calls"]
    parts = []
    for route in ROUTES:
        row = calls[route]
        text = f"{route} {sum(row.values())}"
        used = [f"{c} {row[c]}" for c in COLLECTIVES if row[c]]
        if used:
            text += " (" + ", ".join(used) + ")"
        parts.append(text)
    return "flashcomm summary: calls per route: " + ", ".join(parts)


# Run in a separate process with the environment under test: loads flashcomm's library by path
# (never preloaded), which reads its configuration from that environment, and reports it.
_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(1 << 16)
rc = lib.flashcommGetConfigString(buf, ctypes.c_size_t(len(buf)))
out = {"config_rc": rc, "config": buf.value.decode("utf-8", "replace")}
if "nccl" in sys.argv[2:]:
    v = ctypes.c_int(0)
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclGetLastError.argtypes = [ctypes.c_void_p]
    out["nccl_rc"] = lib.ncclGetVersion(ctypes.byref(v))
    out["nccl_version"] = v.value
    out["nccl_error"] = (lib.ncclGetLastError(None) or b"").decode("utf-8", "replace")
print(json.dumps(out))
"""


def _probe(environ, real_nccl=False):
    """What flashcomm's library says of the environment ``environ``: its configuration string
    (``flashcommGetConfigString``) and, with ``real_nccl``, what finding the real NCCL gives
    (``ncclGetVersion`` through the library, and ``ncclGetLastError`` when it fails)."""
    child = {k: v for k, v in environ.items() if k != "LD_PRELOAD"}
    cmd = [sys.executable, "-c", _PROBE, library_path()] + (["nccl"] if real_nccl else [])
    res = subprocess.run(cmd, env=child, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=300)
    lines = res.stdout.decode("utf-8", "replace").strip().splitlines()
    if res.returncode != 0 or not lines:
        raise RuntimeError("flashcomm's library could not be asked about the settings: "
                           + res.stderr.decode("utf-8", "replace")[-2000:])
    return json.loads(lines[-1])


def _config_lines(config):
    """``{name: (value, note)}`` of the library's configuration string, and its pass-through
    line."""
    table, passthrough = {}, ""
    for line in config.splitlines():
        name, sep, rest = line.partition("=")
        if not sep:
            continue
        if name == "passthrough":
            passthrough = rest
            continue
        value, _, note = rest.partition("  # ")
        table[name] = (value, note)
    return table, passthrough


def check_settings(environ=None, names=()):
    """The settings of ``environ`` (default ``os.environ``) that flashcomm's library cannot use,
    each as one line that names the variable, the value and what is allowed; an empty list when
    every setting is valid. The library itself judges them (it is loaded in a separate process
    with that environment), so the rules are its own: a bad value makes it pass every call
    through to NCCL, which a job would only see in a log line.

    ``names``: the variables the caller set explicitly; a ``FLASHCOMM_`` name among them that
    the library does not know (a misspelling) is refused too. When ``FLASHCOMM_NCCL_LIB`` is set,
    the library must also be able to load the real NCCL it names."""
    environ = dict(os.environ if environ is None else environ)
    real = bool(environ.get("FLASHCOMM_NCCL_LIB", "").strip())
    out = _probe(environ, real_nccl=real)
    table, passthrough = _config_lines(out["config"])
    problems = []
    for name, (_, note) in table.items():
        if note.startswith("not valid: "):
            problems.append(note[len("not valid: "):])
    if not problems and passthrough.startswith("forced: "):
        problems.append(passthrough[len("forced: "):])
    for name in names:
        if name.startswith("FLASHCOMM_") and name not in table:
            problems.append(f"{name}={environ.get(name, '')!r}: not a flashcomm variable (the "
                            "library would ignore it; see docs/env.md for the variables)")
    if real and not problems and out.get("nccl_rc", 0) != 0:
        problems.append(f"FLASHCOMM_NCCL_LIB={environ['FLASHCOMM_NCCL_LIB']!r} cannot be used: "
                        f"{out.get('nccl_error', '')}")
    return problems


def _cuda():
    """Whether a CUDA driver and GPUs are visible to this process: ``(driver, gpus, why)``,
    driver as ``"13.0"`` or None, gpus a count, why a sentence when there is no GPU."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, 0, "no CUDA driver (libcuda.so.1 cannot be loaded)"
    rc = cu.cuInit(0)
    v = ctypes.c_int(0)
    cu.cuDriverGetVersion(ctypes.byref(v))
    driver = f"{v.value // 1000}.{v.value % 1000 // 10}" if v.value else "unknown"
    if rc != 0:
        return driver, 0, f"the CUDA driver {driver} sees no usable GPU (cuInit returned {rc})"
    n = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
        return driver, 0, f"the CUDA driver {driver} sees no GPU"
    return driver, n.value, ""


def machine(environ=None):
    """What flashcomm's library would do on this machine with ``environ`` (default: the
    variables ``flashcomm run`` gives a job, :func:`env`): a list of ``(what, answer)`` lines
    about the GPU and driver, the settings, the real NCCL and the route calls would take."""
    environ = dict(os.environ) if environ is None else dict(environ)
    driver, gpus, why = _cuda()
    lines = [("CUDA driver", f"{driver}, {gpus} GPU(s) visible" if gpus else why)]
    problems = check_settings(environ)
    lines.append(("settings", "valid" if not problems else "; ".join(problems)))
    out = _probe(environ, real_nccl=True)
    table, passthrough = _config_lines(out["config"])
    if out.get("nccl_rc", 1) == 0:
        v = out["nccl_version"]
        version = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
        lines.append(("real NCCL", f"{version}, as the library finds it"))
    else:
        version = None
        lines.append(("real NCCL", f"none: {out.get('nccl_error', '')}"))
    value = lambda name: table.get(name, ("", ""))[0]  # noqa: E731
    if version is None:
        would = "every NCCL call would fail with ncclSystemError (no usable real NCCL)"
    elif passthrough.startswith("forced"):
        would = f"every call would go to the real NCCL {version} unchanged (bad settings)"
    elif passthrough == "FLASHCOMM_DISABLE":
        would = f"every call would go to the real NCCL {version} (FLASHCOMM_DISABLE)"
    elif not gpus:
        would = (f"every call would go to the real NCCL {version}: flashcomm's kernels need an "
                 "NVIDIA GPU and its driver")
    else:
        would = (f"communicators of up to {value('FLASHCOMM_MAX_RANKS')} ranks on these "
                 f"{gpus} GPU(s) would be set up for flashcomm's kernels, which take "
                 f"{value('FLASHCOMM_OPS')} of {value('FLASHCOMM_MIN_BYTES')} to "
                 f"{value('FLASHCOMM_MAX_BYTES')} bytes per rank (quantized AllReduce: "
                 f"{value('FLASHCOMM_QUANT_BITS')} bits); every other call goes to the real "
                 f"NCCL {version}")
    lines.append(("on this machine", would))
    return lines
