"""flashcomm: an NCCL-compatible drop-in ``libnccl.so.2``.

The wheel ships flashcomm's library (CUDA kernels embedded) as ``flashcomm/lib/libnccl.so.2``.
flashcomm runs eligible AllReduce, ReduceScatter and AllGather calls on its own kernels (lossless,
or quantized to 2..8 bits when asked) and forwards every other call to the real NCCL, which it
finds through the ``nvidia-nccl-cu13`` package.

* :func:`library_path` -- the library's file;
* :func:`real_nccl_path` -- the real NCCL of the ``nvidia-nccl-cu13`` package;
* :func:`env` -- the environment variables that make a program use flashcomm (``LD_PRELOAD``,
  ``VLLM_NCCL_SO_PATH``, ``SGLANG_NCCL_SO_PATH``, ``FLASHCOMM_NCCL_LIB``) plus any settings;
* :func:`stats` -- calls and bytes per route and collective (``flashcommGetStats``);
* :func:`summary` -- the same as one line of text;
* ``python -m flashcomm run [--bits 4 ...] -- <command>`` (or the ``flashcomm`` script) runs a
  command with flashcomm preloaded and the settings given.
"""

import ctypes
import importlib.util
import os

try:
    from ._build import BUILD as _BUILD
    from ._build import VERSION as __version__
except ImportError:  # a source checkout, not an installed wheel
    __version__ = "0+unknown"
    _BUILD = {}

__all__ = [
    "COLLECTIVES",
    "ROUTES",
    "build_info",
    "env",
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
    """The real ``libnccl.so.2`` of the ``nvidia-nccl-cu13`` package (``nvidia.nccl``), or None
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
      has one, else the ``nvidia-nccl-cu13`` package's (omitted when none is found: the library
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
