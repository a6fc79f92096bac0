"""The flashcomm launcher: ``python -m flashcomm <command>`` (or the ``flashcomm`` script).

    flashcomm run [--bits 4] [--ag-bits 8] [--set NAME=VALUE ...] -- <command> [args ...]
        runs <command> with flashcomm preloaded: the variables of flashcomm.env() and the
        settings given; the command replaces the launcher (same process id, signals and exit
        status), so it composes with torchrun, vllm serve, python -m sglang.launch_server, ...
    flashcomm env [settings ...]     prints the variables as shell `export` lines
    flashcomm path                   prints the library's path
    flashcomm info                   version, library, real NCCL, how the library was built, whether
                                     a GPU and driver are visible, the settings, and what the
                                     library would do on this machine

`run` and `env` check every setting (the command line's and the environment's) with the library's
own rules first, and refuse a bad one with exit status 2, naming the variable, the value and what
is allowed: nothing is started.
"""

import argparse
import os
import shlex
import shutil
import sys

import flashcomm


def _settings_parser(prog, description):
    p = argparse.ArgumentParser(prog=prog, description=description)
    q = p.add_argument_group("quantized AllReduce (see docs/env.md)")
    q.add_argument("--bits", help="FLASHCOMM_QUANT_BITS: 2..8, 16 or off (default: off)")
    q.add_argument("--rs-bits", help="FLASHCOMM_QUANT_RS_BITS: width of the reduce-scatter step")
    q.add_argument("--ag-bits", help="FLASHCOMM_QUANT_AG_BITS: width of the all-gather step")
    q.add_argument("--group", help="FLASHCOMM_QUANT_GROUP: 32, 64, 128 or 256 values per group")
    q.add_argument("--spikes", help="FLASHCOMM_QUANT_SPIKES: 0, 2 or 4 extremes kept per group")
    g = p.add_argument_group("general")
    g.add_argument("--ops", help="FLASHCOMM_OPS: collectives flashcomm's kernels may take")
    g.add_argument("--disable", action="store_true",
                   help="FLASHCOMM_DISABLE=1: preload, but forward every call to NCCL")
    g.add_argument("--nccl-lib", help="FLASHCOMM_NCCL_LIB: the real libnccl.so.2 (default: the "
                   f"{flashcomm.NCCL_PACKAGE} package's)")
    g.add_argument("--debug", metavar="LEVEL",
                   help="NCCL_DEBUG (VERSION shows flashcomm's one-line engagement message)")
    g.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any other variable, e.g. --set FLASHCOMM_MAX_BYTES=16M (repeatable)")
    return p


def _variables(args):
    """The variables of the job, and the names the command line set explicitly."""
    settings = {
        "bits": args.bits, "rs_bits": args.rs_bits, "ag_bits": args.ag_bits,
        "group": args.group, "spikes": args.spikes, "ops": args.ops,
        "disable": True if args.disable else None, "NCCL_DEBUG": args.debug,
    }
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"flashcomm: --set wants NAME=VALUE, got {item!r}")
        settings[name] = value
    names = [flashcomm._setting_name(k) for k, v in settings.items() if v is not None]
    if args.nccl_lib:
        names.append("FLASHCOMM_NCCL_LIB")
    return flashcomm.env(nccl_lib=args.nccl_lib, **settings), names


def _refused(environ, names):
    """Checks the job's settings with the library's own rules; prints each bad one and returns
    2 when there is any (nothing is started), else None."""
    try:
        problems = flashcomm.check_settings(environ, names)
    except RuntimeError as e:
        print(f"flashcomm: {e}", file=sys.stderr)
        return 2
    if not problems:
        return None
    for p in problems:
        print(f"flashcomm: {p}", file=sys.stderr)
    print("flashcomm: nothing was started: with these settings the library would pass every "
          "call through to NCCL (see docs/env.md)", file=sys.stderr)
    return 2


def _run(argv):
    if "--" in argv:
        i = argv.index("--")
        opts, command = argv[:i], argv[i + 1:]
    else:
        opts, command = argv, []
    p = _settings_parser("flashcomm run", "Run a command with flashcomm preloaded.")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command (after `--`), e.g. torchrun --nproc-per-node 8 train.py")
    args = p.parse_args(opts)
    command = command or args.command
    if not command:
        p.error("no command given: flashcomm run [options] -- <command> [args ...]")
    variables, names = _variables(args)
    child = dict(os.environ)
    child.update(variables)
    refused = _refused(child, names)
    if refused is not None:
        return refused
    exe = shutil.which(command[0], path=child.get("PATH"))
    if exe is None:
        print(f"flashcomm: {command[0]}: command not found", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, command, child)
    return 0  # not reached


def _env(argv):
    p = _settings_parser("flashcomm env", "Print the variables that make a program use "
                         "flashcomm, as shell export lines: eval \"$(flashcomm env --bits 4)\".")
    args = p.parse_args(argv)
    variables, names = _variables(args)
    child = dict(os.environ)
    child.update(variables)
    refused = _refused(child, names)
    if refused is not None:
        return refused
    for name, value in variables.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def _info(argv):
    argparse.ArgumentParser(prog="flashcomm info").parse_args(argv)
    print(f"flashcomm {flashcomm.__version__}")
    print(f"library: {flashcomm.library_path()}")
    print(f"real NCCL ({flashcomm.NCCL_PACKAGE}): {flashcomm.real_nccl_path() or 'not found'}")
    for key, value in sorted(flashcomm.build_info().items()):
        print(f"{key}: {value}")
    # With the variables `flashcomm run` gives a job.
    job = dict(os.environ)
    job.update(flashcomm.env())
    for what, answer in flashcomm.machine(job):
        print(f"{what}: {answer}")
    return 0


COMMANDS = {"run": _run, "env": _env, "info": _info,
            "path": lambda argv: print(flashcomm.library_path()) or 0}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"flashcomm: unknown command {argv[0]!r}\n\n{__doc__.strip()}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except FileNotFoundError as e:
        print(f"flashcomm: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
