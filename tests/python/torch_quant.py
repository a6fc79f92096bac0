#!/usr/bin/env python3
"""Quantized AllReduce through flashcomm under PyTorch: runs torch.distributed's NCCL backend
with flashcomm's library in LD_PRELOAD, in two phases (each a fresh set of processes, since
flashcomm reads its configuration once per process):

1. lossless (no FLASHCOMM_QUANT_* variable): bf16 all_reduce of small integers at every size is
   exact, and flashcommGetStats counts every all_reduce on the lossless route;
2. quantized (FLASHCOMM_QUANT_BITS=--bits, FLASHCOMM_QUANT_AG_BITS=--ag-bits, GROUP, SPIKES):
   bf16 all_reduce of random data with outliers at every size. Checks, per size:
   * every element lies within the error bound of docs/codec.md ("Error bound" and "Reference
     algorithms") against the exact sum of the inputs, computed here in numpy from each group's
     range after spike removal (the values each rank's encoder keeps as lo and hi):
       decode bound  step * (0.5 + 2^-10) + 4 ulp_f32(max(|lo|, |hi|)) + 2^(b - 126),
                     step = (hi - lo) / (2^b - 1) in f32 (spikes decode exactly; the bound is
                     applied to every element of the group, which only loosens it for spikes);
       one-shot      the sum over ranks of the decode bounds, plus half an f32 ulp of every
                     partial sum, plus half a bf16 ulp at the result;
       two-step      that (with half a bf16 ulp for the rounding before requantization), plus
                     the decode bound of the all-gather encoding (its group range bounded by
                     the range of the exact sums widened by the first step's error), plus half
                     a bf16 ulp at the result.
     At world size 1 (and with --algo oneshot) the one-shot bound applies; otherwise the
     two-step bound, which covers both algorithms. At world size 1 nothing is sent, so nothing
     is quantized: the result must equal the input exactly and the calls count on the lossless
     route;
   * for one-shot plans of several ranks, the result is bit for bit the numpy emulation of docs/codec.md's
     one-shot reference (quantize -> dequantize per rank, f32 sum in rank order, bf16 rounding);
     `cargo test -p flashcomm-shim --test programs` checks that emulation against flashcomm's
     CPU reference (crates/codec) whenever numpy is installed;
   * the result is deterministic (a second call gives the same bits) and, with several ranks,
     the same on every rank;
   * f32 all_reduce (not in FLASHCOMM_QUANT_DTYPES) stays lossless and exact;
   * flashcommGetStats counts the bf16 all_reduces on the quantized route.

With --ops (FLASHCOMM_QUANT_OPS=allreduce,allgather,reducescatter,alltoall in the quantized
phase) the same for all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single (equal
split), each one quantization step (docs/codec.md, "Reference algorithms"): exact and on the
lossless route in the lossless phase; in the quantized phase every block within the bound of one
round trip (AllGather, AllToAll: the decode bound plus half a bf16 ulp; ReduceScatter: the
one-shot bound of its shards) and, with several ranks, bit for bit the numpy emulation, on the
quantized route; at world size 1 exact and on the lossless route.

    python3 torch_quant.py --lib PATH/libnccl.so.2 --world-size N [--bits 4] [--ag-bits B]
        [--group 128] [--spikes 2] [--algo auto|oneshot|twoshot] [--max-bytes 64M]
        [--real PATH/libnccl.so.2] [--ops]
    python3 torch_quant.py --emulate IN OUT --ranks N --bits B [--group G] [--spikes K]

GPU machine only (the --emulate mode needs only numpy: it reads N ranks' little-endian bf16
inputs from IN and writes the emulated one-shot result (bf16) to OUT, its error bound (float64)
to OUT.bound, and the two-step bound with --ag-bits (default --bits) to OUT.bound2). The script re-executes itself with LD_PRELOAD and the variables of each
phase set, then spawns N processes (one per GPU). Each check prints a PASS/FAIL line; the exit
status is 0 only if every rank of both phases passed.
"""
import argparse
import ctypes
import os
import socket
import subprocess
import sys

COLLS = ["allreduce", "reducescatter", "allgather", "alltoall", "broadcast", "reduce", "send", "recv"]
ROUTES = ["nccl", "lossless", "quantized"]
SIZES = [1 << 10, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]  # bytes per rank
BLOCK_VALUES = 1024


class flashcommStats_t(ctypes.Structure):
    _fields_ = [("calls", (ctypes.c_uint64 * 8) * 3), ("bytes", (ctypes.c_uint64 * 8) * 3)]


def stats(lib_path):
    """Process totals, {(route, collective): calls}. The library is preloaded: CDLL returns it."""
    lib = ctypes.CDLL(lib_path)
    lib.flashcommGetStats.restype = ctypes.c_int
    lib.flashcommGetStats.argtypes = [ctypes.c_void_p, ctypes.POINTER(flashcommStats_t)]
    s = flashcommStats_t()
    rc = lib.flashcommGetStats(None, ctypes.byref(s))
    if rc != 0:
        raise RuntimeError(f"flashcommGetStats failed: {rc}")
    return {(r, c): s.calls[i][j] for i, r in enumerate(ROUTES) for j, c in enumerate(COLLS)}


# ---------------------------------------------------------------------------------------------
# numpy emulation of docs/codec.md (finite inputs only) and the error bounds.

def bf16_round(x):
    """float32 array -> float32 array of the nearest bf16 values (round to nearest even)."""
    import numpy as np
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def ulp_f32(y):
    """Spacing of f32 values at |y| (the larger one at powers of two)."""
    import numpy as np
    return np.spacing(np.abs(np.asarray(y, dtype=np.float64)).astype(np.float32)).astype(np.float64)


def ulp_bf16(y):
    return ulp_f32(y) * 65536.0


def encode_decode(x, bits, group, spikes):
    """One rank's quantize -> dequantize (f32 values), and the per-element decode bound (f64,
    0 at spikes). `x`: float32 values (finite)."""
    import numpy as np
    n = x.size
    ngroups = -(-n // group)
    pad = ngroups * group - n
    g = np.concatenate([x.astype(np.float32), np.zeros(pad, np.float32)]).reshape(ngroups, group)
    valid = (np.arange(ngroups * group) < n).reshape(ngroups, group)
    length = valid.sum(axis=1)
    picked = np.zeros_like(valid)
    rows = np.arange(ngroups)
    for i in range(spikes):
        # Picks 0 and 2 take the smallest remaining value, 1 and 3 the largest; ties go to the
        # lowest index (argmin/argmax return the first occurrence).
        live = valid & ~picked
        if i % 2 == 0:
            j = np.argmin(np.where(live, g, np.inf), axis=1)
        else:
            j = np.argmax(np.where(live, g, -np.inf), axis=1)
        take = length > i
        picked[rows[take], j[take]] = True
    rest = valid & ~picked
    has_rest = rest.any(axis=1)
    lo = np.where(has_rest, g[rows, np.argmin(np.where(rest, g, np.inf), axis=1)], np.float32(0))
    hi = np.where(has_rest, g[rows, np.argmax(np.where(rest, g, -np.inf), axis=1)], np.float32(0))
    lo, hi = lo.astype(np.float32), hi.astype(np.float32)
    top = np.float32(2 ** bits - 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        step = (hi - lo) / top
        r = np.float32(1) / step
        t = (g - lo[:, None]) * r[:, None]
        q = np.where(np.isnan(t) | (t < 0), np.float32(0), np.where(t >= top, top, np.rint(t)))
        v = lo[:, None] + q.astype(np.float32) * step[:, None]
    if not (np.isfinite(step).all() and np.isfinite(v[rest]).all()):
        raise ValueError("the emulation handles finite, non-poisoned groups only")
    out = np.where(picked, g, v).astype(np.float32)
    mag = np.maximum(np.abs(lo), np.abs(hi))
    b = step.astype(np.float64) * (0.5 + 2.0 ** -10) + 4.0 * ulp_f32(mag) + 2.0 ** (bits - 126)
    bound = np.where(picked, 0.0, b[:, None])
    return out.reshape(-1)[:n], bound.reshape(-1)[:n]


def oneshot(inputs, bits, group, spikes):
    """docs/codec.md's one-shot reference: (bf16-rounded result as f32, error bound (f64), exact
    sum (f64), first-step error bound E1 before the final rounding (f64))."""
    import numpy as np
    acc = None
    exact = np.zeros(inputs[0].size, np.float64)
    dec = np.zeros(inputs[0].size, np.float64)
    partial = np.zeros(inputs[0].size, np.float64)
    for r, x in enumerate(inputs):
        v, b = encode_decode(x, bits, group, spikes)
        exact += x
        dec += b
        if acc is None:
            acc = v
        else:
            acc = (acc + v).astype(np.float32)
            partial += 0.5 * ulp_f32(np.abs(exact) + dec + partial)
    e1 = dec + partial
    result = bf16_round(acc)
    bound = e1 + 0.5 * ulp_bf16(np.abs(exact) + e1)
    return result, bound, exact, e1


def twostep_bound(exact, e1, ag_bits, group):
    """Bound of the two-step algorithm given the exact sums and the first step's error E1."""
    import numpy as np
    n = exact.size
    ngroups = -(-n // group)
    pad = ngroups * group - n
    e_req = e1 + 0.5 * ulp_bf16(np.abs(exact) + e1)  # rounding to bf16 before requantization
    s = np.concatenate([exact, np.full(pad, np.nan)]).reshape(ngroups, group)
    e = np.concatenate([e_req, np.zeros(pad)]).reshape(ngroups, group)
    widest = np.nanmax(s, axis=1) - np.nanmin(s, axis=1) + 2.0 * e.max(axis=1)
    step = widest / (2 ** ag_bits - 1) * (1.0 + 2.0 ** -22)
    mag = np.nanmax(np.abs(s), axis=1) + e.max(axis=1)
    b_ag = step * (0.5 + 2.0 ** -10) + 4.0 * ulp_f32(mag) + 2.0 ** (ag_bits - 126)
    b_ag = np.repeat(b_ag, group)[:n]
    e2 = e_req + b_ag
    return e2 + 0.5 * ulp_bf16(np.abs(exact) + e2)


def emulate_file(args):
    import numpy as np
    raw = np.fromfile(args.emulate[0], dtype=np.uint16)
    if raw.size % args.ranks:
        sys.exit("input size is not a multiple of --ranks")
    per = raw.reshape(args.ranks, -1)
    inputs = [(p.astype(np.uint32) << 16).view(np.float32) for p in per]
    result, bound, exact, e1 = oneshot(inputs, args.bits, args.group, args.spikes)
    (result.view(np.uint32) >> 16).astype(np.uint16).tofile(args.emulate[1])
    bound.astype(np.float64).tofile(args.emulate[1] + ".bound")
    bound2 = twostep_bound(exact, e1, args.ag_bits or args.bits, args.group)
    bound2.astype(np.float64).tofile(args.emulate[1] + ".bound2")
    return 0


# ---------------------------------------------------------------------------------------------
# The GPU phases.

def make_input(n, rank, seed):
    """Rank `rank`'s input of `n` values: normal, scaled per rank, with outliers."""
    import numpy as np
    rng = np.random.default_rng(seed * 1009 + rank)
    a = rng.standard_normal(n, dtype=np.float32) * np.float32(0.5 + rank)
    a[rng.integers(0, n, size=max(1, n // 500))] *= np.float32(40)
    return bf16_round(a)


def round_trip(x, bits, group, spikes):
    """One block through the wire: bf16 of the decoded values, and its bound (f64)."""
    v, b = encode_decode(x, bits, group, spikes)
    r = bf16_round(v)
    return r, b + 0.5 * ulp_bf16(r)


def check_ops(rank, world, dev, opts, check, counted):
    """all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single (bf16) in this phase."""
    import numpy as np
    import torch
    import torch.distributed as dist

    phase = opts["phase"]
    bits, group, spikes = opts["bits"], opts["group"], opts["spikes"]
    sizes = [b for b in SIZES if b * world <= opts["max_bytes"]]
    for seed, nbytes in enumerate(sizes):
        n = nbytes // 2  # values per block: AllGather's input, a shard, a per-peer block
        if phase == "lossless":
            base = (torch.arange(world * n, device=dev) % 7).to(torch.bfloat16)
            x = base + (rank + 1)
            out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
            dist.all_gather_into_tensor(out, x[:n].contiguous())
            want = torch.cat([base[:n] + (r + 1) for r in range(world)])
            check(torch.equal(out, want), f"bf16 all_gather of {nbytes} bytes is exact")
            shard = torch.empty(n, dtype=torch.bfloat16, device=dev)
            dist.reduce_scatter_tensor(shard, x)
            want = base[rank * n:(rank + 1) * n] * world + world * (world + 1) / 2
            check(torch.equal(shard, want), f"bf16 reduce_scatter of {nbytes} bytes per rank is exact")
            out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
            dist.all_to_all_single(out, x)
            want = torch.cat([base[rank * n:(rank + 1) * n] + (r + 1) for r in range(world)])
            check(torch.equal(out, want), f"bf16 all_to_all_single of {nbytes} bytes per peer is exact")
            for c in ("allgather", "reducescatter", "alltoall"):
                counted[c] += 1
            continue
        inputs = [make_input(world * n, r, 100 + seed) for r in range(world)]
        x = torch.from_numpy(inputs[rank]).to(torch.bfloat16).to(dev)
        results = {}
        out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
        dist.all_gather_into_tensor(out, x[:n].contiguous())
        trips = [round_trip(inputs[r][:n], bits, group, spikes) for r in range(world)]
        results["all_gather"] = (out, np.concatenate([t[0] for t in trips]),
                                 np.concatenate([t[1] for t in trips]),
                                 np.concatenate([inputs[r][:n] for r in range(world)]))
        shard = torch.empty(n, dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(shard, x)
        emu, bound, exact, _ = oneshot([inputs[r][rank * n:(rank + 1) * n] for r in range(world)],
                                       bits, group, spikes)
        results["reduce_scatter"] = (shard, emu, bound, exact)
        out2 = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
        dist.all_to_all_single(out2, x)
        blocks = [inputs[r][rank * n:(rank + 1) * n] for r in range(world)]
        trips = [round_trip(b, bits, group, spikes) for b in blocks]
        results["all_to_all_single"] = (out2, np.concatenate([t[0] for t in trips]),
                                        np.concatenate([t[1] for t in trips]), np.concatenate(blocks))
        for c in ("allgather", "reducescatter", "alltoall"):
            counted[c] += 1
        for what, (t, emu, bound, exact) in results.items():
            y = t.float().cpu().numpy().astype(np.float64)
            exact = np.asarray(exact, dtype=np.float64)
            if world == 1:
                changed = int(np.count_nonzero(y != exact))
                check(changed == 0, f"{what} of {nbytes} bytes: one rank is exact ({changed} changed)")
                continue
            err = np.abs(y - exact)
            bad = np.nonzero(~(err <= bound))[0]
            ratio = float(np.max(err / np.maximum(bound, 1e-300)))
            check(bad.size == 0, f"{what} of {nbytes} bytes: within the one-step bound (max error/bound "
                  f"{ratio:.3f})", f"{bad.size} outside, first at {bad[:1]}")
            differ = np.nonzero(y.astype(np.float32).view(np.uint32) != emu.astype(np.float32).view(np.uint32))[0]
            check(differ.size == 0, f"{what} of {nbytes} bytes: bit for bit the emulation",
                  f"{differ.size} elements differ, first at {differ[:1]}")


def worker(rank, world, port, lib_path, opts):
    import numpy as np
    import torch
    import torch.distributed as dist

    failures = []
    phase = opts["phase"]

    def check(ok, what, detail=""):
        print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {phase}: {what}{'' if ok else ': ' + str(detail)}",
              flush=True)
        if not ok:
            failures.append(what)

    torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    before = stats(lib_path)
    sizes = [b for b in SIZES if b <= opts["max_bytes"]]
    bf16_calls = 0
    f32_calls = 0

    if phase == "lossless":
        for nbytes in sizes:
            n = nbytes // 2
            base = (torch.arange(n, device=dev) % 7).to(torch.bfloat16)
            t = base + (rank + 1)
            dist.all_reduce(t)
            bf16_calls += 1
            want = base * world + world * (world + 1) / 2
            check(torch.equal(t, want), f"bf16 all_reduce of {nbytes} bytes is exact",
                  (t.float() - want.float()).abs().max().item())
    else:
        bits, ag_bits, group, spikes = opts["bits"], opts["ag_bits"], opts["group"], opts["spikes"]
        one_shot = opts["algo"] == "oneshot" or (opts["algo"] == "auto" and world == 1)
        for seed, nbytes in enumerate(sizes):
            n = nbytes // 2
            inputs = [make_input(n, r, seed) for r in range(world)]
            emu, bound1, exact, e1 = oneshot(inputs, bits, group, spikes)
            bound = bound1 if one_shot else twostep_bound(exact, e1, ag_bits, group)
            x = torch.from_numpy(inputs[rank]).to(torch.bfloat16).to(dev)
            t = x.clone()
            dist.all_reduce(t)
            t2 = x.clone()
            dist.all_reduce(t2)
            bf16_calls += 2
            check(torch.equal(t, t2), f"{nbytes} bytes: a second call gives the same bits")
            if world > 1:
                r0 = t.clone()
                dist.broadcast(r0, src=0)
                check(torch.equal(t, r0), f"{nbytes} bytes: every rank holds the same result")
            y = t.float().cpu().numpy().astype(np.float64)
            err = np.abs(y - exact)
            bad = np.nonzero(~(err <= bound))[0]
            ratio = float(np.max(err / np.maximum(bound, 1e-300)))
            ratio1 = float(np.max(err / np.maximum(bound1, 1e-300)))
            detail = "" if bad.size == 0 else (
                f"{bad.size} elements outside, first at {bad[0]}: got {y[bad[0]]!r}, exact "
                f"{exact[bad[0]]!r}, bound {bound[bad[0]]!r}")
            check(bad.size == 0,
                  f"{nbytes} bytes: every element within the {'one-shot' if one_shot else 'two-step'} "
                  f"bound (max error/bound {ratio:.3f}; against the one-shot bound {ratio1:.3f}; "
                  f"max error {err.max():.4g})", detail)
            if one_shot and world > 1:
                differ = np.nonzero(y.astype(np.float32).view(np.uint32) != emu.view(np.uint32))[0]
                check(differ.size == 0, f"{nbytes} bytes: bit for bit the one-shot reference",
                      f"{differ.size} elements differ, first at {differ[:1]}")
            if world == 1:
                # A one-rank communicator sends nothing, so nothing is quantized: the result is
                # the input, exactly.
                changed = int(np.count_nonzero(y != exact))
                check(changed == 0, f"{nbytes} bytes: one rank is exact ({changed} of {n} values changed)")
        for nbytes in sizes[:3]:
            n = nbytes // 4
            base = (torch.arange(n, device=dev) % 7).float()
            t = base + (rank + 1)
            dist.all_reduce(t)
            f32_calls += 1
            want = base * world + world * (world + 1) / 2
            check(torch.equal(t, want), f"f32 all_reduce of {nbytes} bytes stays lossless and exact")

    counted = {"allgather": 0, "reducescatter": 0, "alltoall": 0}
    if opts["ops"]:
        check_ops(rank, world, dev, opts, check, counted)

    torch.cuda.synchronize()
    after = stats(lib_path)
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    print(f"[rank {rank}] calls per (route, collective) during the {phase} phase: {moved}", flush=True)
    got = {r: after[(r, "allreduce")] - before[(r, "allreduce")] for r in ROUTES}
    if phase == "lossless":
        check(got["lossless"] >= bf16_calls and got["quantized"] == 0,
              f"the {bf16_calls} all_reduces took the lossless route", got)
    else:
        if world == 1:
            check(got["quantized"] == 0 and got["lossless"] >= bf16_calls,
                  f"the {bf16_calls} bf16 all_reduces of one rank took the lossless route", got)
        else:
            check(got["quantized"] == bf16_calls,
                  f"the {bf16_calls} bf16 all_reduces took the quantized route", got)
        check(got["lossless"] >= f32_calls, f"the {f32_calls} f32 all_reduces took the lossless route",
              got)
    for c, calls in counted.items():
        if calls == 0:
            continue
        got = {r: after[(r, c)] - before[(r, c)] for r in ROUTES}
        if world == 1 and c == "reducescatter":
            # PyTorch 2.11 runs reduce_scatter_tensor of one rank as a copy, without calling
            # NCCL (measured: no ncclReduceScatter reached the library); it must not have been
            # quantized either way.
            check(got["quantized"] == 0 and got["nccl"] == 0,
                  f"the {calls} bf16 reducescatter calls of one rank were not quantized", got)
            continue
        route = "quantized" if phase == "quant" and world > 1 else "lossless"
        check(got[route] >= calls and (route == "quantized" or got["quantized"] == 0),
              f"the {calls} bf16 {c} calls took the {route} route", got)
    dist.destroy_process_group()
    if failures:
        sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(args, lib):
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.world_size:
        print(f"FAIL need {args.world_size} GPUs, found {torch.cuda.device_count()}")
        return 1
    opts = {"phase": args.phase, "bits": args.bits, "ag_bits": args.ag_bits or args.bits,
            "group": args.group, "spikes": args.spikes, "algo": args.algo,
            "max_bytes": args.max_bytes, "ops": args.ops}
    try:
        mp.spawn(worker, args=(args.world_size, free_port(), lib, opts), nprocs=args.world_size,
                 join=True)
    except Exception as e:  # a rank failed or crashed
        print(f"FAIL {args.phase} phase: {e}")
        return 1
    print(f"PASS {args.phase} phase, world size {args.world_size}")
    return 0


def parse_bytes(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(t[:-1]) * units[t[-1]] if t and t[-1] in units and t[-1].isalpha() else int(t)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", help="flashcomm's library (default: the libnccl* entry of LD_PRELOAD)")
    p.add_argument("--world-size", type=int)
    p.add_argument("--bits", type=int, default=4, choices=range(2, 9), help="FLASHCOMM_QUANT_BITS")
    p.add_argument("--ag-bits", type=int, choices=range(2, 9), help="FLASHCOMM_QUANT_AG_BITS")
    p.add_argument("--group", type=int, default=128, choices=[32, 64, 128, 256])
    p.add_argument("--spikes", type=int, default=2, choices=[0, 2, 4])
    p.add_argument("--algo", default="auto", choices=["auto", "oneshot", "twoshot"],
                   help="FLASHCOMM_ALGO (auto: the communicator chooses)")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20,
                   help="largest message per rank (sizes: 1K, 4K, 64K, 1M, 16M, 64M)")
    p.add_argument("--real", help="the real libnccl.so.2 (default: found by flashcomm)")
    p.add_argument("--ops", action="store_true",
                   help="also all_gather, reduce_scatter and all_to_all_single, quantized in the "
                        "quantized phase (FLASHCOMM_QUANT_OPS lists all four)")
    p.add_argument("--phase", choices=["lossless", "quant"], help=argparse.SUPPRESS)
    p.add_argument("--emulate", nargs=2, metavar=("IN", "OUT"),
                   help="CPU only: write the one-shot emulation of IN's bf16 inputs to OUT")
    p.add_argument("--ranks", type=int, default=1, help="ranks in the --emulate input")
    args = p.parse_args()
    if args.emulate:
        return emulate_file(args)
    if not args.world_size:
        p.error("--world-size is required")
    preloaded = [x for x in os.environ.get("LD_PRELOAD", "").split(":") if "libnccl" in os.path.basename(x)]
    if not args.lib and not preloaded:
        p.error("--lib is required when LD_PRELOAD holds no libnccl library")
    lib = os.path.abspath(args.lib or preloaded[0])

    if args.phase:
        return run_phase(args, lib)

    # Each phase in a fresh process with its own environment (flashcomm reads it once).
    failed = 0
    for phase in ("lossless", "quant"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHCOMM_QUANT_")}
        env["LD_PRELOAD"] = ":".join(x for x in [lib, env.get("LD_PRELOAD", "")] if x)
        if args.real:
            env["FLASHCOMM_NCCL_LIB"] = os.path.abspath(args.real)
        if args.algo != "auto":
            env["FLASHCOMM_ALGO"] = args.algo
        if phase == "quant":
            env["FLASHCOMM_QUANT_BITS"] = str(args.bits)
            env["FLASHCOMM_QUANT_GROUP"] = str(args.group)
            env["FLASHCOMM_QUANT_SPIKES"] = str(args.spikes)
            # Every call quantized, whatever the calibrated cost model says of its size: this
            # phase checks the quantized kernels' results.
            env["FLASHCOMM_QUANT_CHOICE"] = "always"
            if args.ag_bits:
                env["FLASHCOMM_QUANT_AG_BITS"] = str(args.ag_bits)
            if args.ops:
                env["FLASHCOMM_QUANT_OPS"] = "allreduce,allgather,reducescatter,alltoall"
        shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith("FLASHCOMM_"))
        print(f"== {phase} phase: {shown}", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase] + sys.argv[1:]
        failed += subprocess.call(cmd, env=env) != 0
    print("PASS torch quantized collectives on flashcomm" if not failed else f"FAIL {failed} phase(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
