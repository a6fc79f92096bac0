#!/usr/bin/env python3
"""PyTorch on flashcomm: with flashcomm's library in LD_PRELOAD, runs torch.distributed's NCCL
backend on N GPUs and checks the results exactly, that the calls went through flashcomm, and
which route they took (flashcommGetStats):

* all_reduce (sum; bf16, f16, f32), all_gather_into_tensor and reduce_scatter_tensor take
  flashcomm's lossless kernels (up to 8 GPUs of one machine; the communicators of
  init_process_group and of new_group are both served), and so does all_to_all_single when
  PyTorch issues it as one ncclAlltoAll (a group of ncclSend/ncclRecv goes to NCCL); broadcast goes
  to NCCL;
* an all_reduce captured into a CUDA graph and replayed several times gives exact results.

    python3 torch_preload.py [--lib PATH/libnccl.so] --world-size N [--real PATH/libnccl.so.2]
        [--expect-route lossless|nccl]
    LD_PRELOAD=PATH/libnccl.so.2 python3 torch_preload.py --world-size N

GPU machine only. Without --lib, the library is the libnccl* entry of LD_PRELOAD. The script
re-executes itself with LD_PRELOAD set if needed, then spawns N processes (one per GPU). Without
--real, flashcomm finds the NCCL that torch ships with. With --expect-route nccl (for runs with
FLASHCOMM_DISABLE=1, or a build without kernels) every collective is expected on the NCCL route.
Each check prints a PASS/FAIL line; the exit status is 0 only if every rank passed.
"""
import argparse
import ctypes
import os
import socket
import sys

COLLS = ["allreduce", "reducescatter", "allgather", "alltoall", "broadcast", "reduce", "send", "recv"]
ROUTES = ["nccl", "lossless", "quantized"]


class flashcommStats_t(ctypes.Structure):
    _fields_ = [("calls", (ctypes.c_uint64 * 8) * 3), ("bytes", (ctypes.c_uint64 * 8) * 3)]


def stats(lib_path):
    """Process totals: {(route, collective): calls}."""
    # The library is already loaded (preloaded): CDLL returns the same object.
    lib = ctypes.CDLL(lib_path)
    lib.flashcommGetStats.restype = ctypes.c_int
    lib.flashcommGetStats.argtypes = [ctypes.c_void_p, ctypes.POINTER(flashcommStats_t)]
    s = flashcommStats_t()
    rc = lib.flashcommGetStats(None, ctypes.byref(s))
    if rc != 0:
        raise RuntimeError(f"flashcommGetStats failed: {rc}")
    return {(r, c): s.calls[i][j] for i, r in enumerate(ROUTES) for j, c in enumerate(COLLS)}


def graph_all_reduce(dist, torch, dev, rank, world, n, check):
    """An all_reduce captured into a CUDA graph, replayed with new inputs each time."""
    x = torch.zeros(n, device=dev)
    base = (torch.arange(n, device=dev) % 5).float()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        x.copy_(base)
        dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        ctx = torch.cuda.graph(g, capture_error_mode="thread_local")
    except TypeError:  # older torch
        ctx = torch.cuda.graph(g)
    with ctx:
        dist.all_reduce(x)
    ok = True
    for step in range(5):
        x.copy_(base * (step + 1) + rank)
        g.replay()
        torch.cuda.synchronize()
        want = base * (step + 1) * world + world * (world - 1) / 2
        ok = ok and torch.equal(x, want)
        if not ok:
            check(False, f"CUDA graph replay {step}", (x - want).abs().max().item())
            return
    check(ok, "all_reduce captured in a CUDA graph, replayed 5 times, exact")


def worker(rank, world, port, lib_path, expect):
    import torch
    import torch.distributed as dist

    failures = []

    def check(ok, what, detail=""):
        print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {what}{'' if ok else ': ' + str(detail)}", flush=True)
        if not ok:
            failures.append(what)

    torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    check(True, f"init_process_group (torch {torch.__version__}, NCCL {torch.cuda.nccl.version()})")
    before = stats(lib_path)

    n = 4096
    expected_sum = world * (world + 1) / 2
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # Small integers: exact in every type, and so is their sum.
        base = (torch.arange(n, device=dev) % 7).to(dtype)
        t = base + (rank + 1)
        dist.all_reduce(t)
        want = base * world + expected_sum
        check(torch.equal(t, want), f"all_reduce sum {dtype}", (t - want).abs().max().item())

    x = torch.full((n,), float(rank), device=dev)
    out = torch.empty(world * n, device=dev)
    dist.all_gather_into_tensor(out, x)
    want = torch.arange(world, device=dev, dtype=torch.float32).repeat_interleave(n)
    check(torch.equal(out, want), "all_gather_into_tensor")

    k = 16
    inp = torch.cat([torch.full((k,), float(rank * 100 + j), device=dev) for j in range(world)])
    got = torch.empty_like(inp)
    dist.all_to_all_single(got, inp)
    want = torch.cat([torch.full((k,), float(j * 100 + rank), device=dev) for j in range(world)])
    check(torch.equal(got, want), "all_to_all_single")

    # The all-to-all variants PyTorch issues differently (the trace of NCCL calls each one made is
    # printed; docs/abi.md records it). With FLASHCOMM_GROUPED_ALLTOALL=1 the Send/Recv groups
    # (split sizes, lists of tensors) run as flashcomm's AllToAll: no send reaches NCCL.
    grouped = os.environ.get("FLASHCOMM_GROUPED_ALLTOALL") == "1"

    def traced(what, fn):
        torch.cuda.synchronize()
        s0 = stats(lib_path)
        fn()
        torch.cuda.synchronize()
        s1 = stats(lib_path)
        moved = {k: s1[k] - s0[k] for k in s1 if s1[k] != s0[k]}
        print(f"[rank {rank}] trace: {what}: {moved}", flush=True)
        return moved

    traced("all_to_all_single (equal split)", lambda: dist.all_to_all_single(got, inp))
    check(torch.equal(got, want), "all_to_all_single, traced")
    got.zero_()
    moved = traced("all_to_all_single (split sizes given)",
                   lambda: dist.all_to_all_single(got, inp, [k] * world, [k] * world))
    check(torch.equal(got, want), "all_to_all_single with split sizes")
    outs = [torch.empty(k, device=dev) for _ in range(world)]
    ins = [inp[j * k:(j + 1) * k].clone() for j in range(world)]
    moved_list = traced("all_to_all (lists of tensors)", lambda: dist.all_to_all(outs, ins))
    check(torch.equal(torch.cat(outs), want), "all_to_all of lists")
    for what, m in (("split sizes", moved), ("lists", moved_list)):
        sent = m.get(("nccl", "send"), 0)
        if grouped:
            check(sent == 0 and m.get(("lossless", "alltoall"), 0) == 1,
                  f"all-to-all ({what}) ran as flashcomm's AllToAll", m)
        else:
            check(sent + sum(v for (r, c), v in m.items() if c == "alltoall") >= 1,
                  f"all-to-all ({what}) reached NCCL or flashcomm", m)

    b = torch.full((n,), float(rank + 42), device=dev)
    dist.broadcast(b, src=0)
    check(torch.equal(b, torch.full_like(b, 42.0)), "broadcast from rank 0")

    full = torch.arange(world * n, device=dev, dtype=torch.float32) + rank
    part = torch.empty(n, device=dev)
    dist.reduce_scatter_tensor(part, full)
    idx = torch.arange(rank * n, (rank + 1) * n, device=dev, dtype=torch.float32)
    check(torch.equal(part, idx * world + world * (world - 1) / 2), "reduce_scatter_tensor")

    for dtype in (torch.bfloat16, torch.float32):
        # Larger messages (1 MiB per rank) take the kernels' other protocols and algorithms.
        big = (torch.arange(1 << 19, device=dev) % 11).to(dtype) + rank
        dist.all_reduce(big)
        want = (torch.arange(1 << 19, device=dev) % 11).to(dtype) * world + world * (world - 1) / 2
        check(torch.equal(big, want), f"all_reduce sum {dtype} of 1 MiB")

    members = list(range(0, world, 2))
    sub = dist.new_group(ranks=members)
    if rank in members:
        s = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(s, group=sub)
        check(torch.equal(s, torch.full_like(s, float(sum(m + 1 for m in members)))), "new_group all_reduce")

    graph_all_reduce(dist, torch, dev, rank, world, n, check)

    torch.cuda.synchronize()
    after = stats(lib_path)
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    print(f"[rank {rank}] calls per (route, collective) during the test: {moved}", flush=True)

    def calls(coll, route=None):
        routes = ROUTES if route is None else [route]
        return sum(after[(r, coll)] - before[(r, coll)] for r in routes)

    check(calls("allreduce") >= 7, "all-reduces went through flashcomm", moved)
    check(calls("allgather") >= 1, "all-gathers went through flashcomm", moved)
    # At world size 1 PyTorch answers reduce_scatter_tensor itself, without calling NCCL (seen on
    # the GPU machine with torch 2.11), so there is nothing to route then.
    rs_least = 1 if world > 1 else 0
    check(calls("reducescatter") >= rs_least, "reduce-scatters went through flashcomm", moved)
    check(calls("broadcast", "nccl") >= 1, "broadcasts went to NCCL", moved)
    check(calls("alltoall") + calls("send", "nccl") >= 1,
          "all-to-all went through flashcomm (ncclAlltoAll, or a Send/Recv group to NCCL)", moved)
    if calls("alltoall"):
        check(calls("alltoall", expect) == calls("alltoall") and calls("alltoall", "quantized") == 0,
              f"alltoall: {calls('alltoall', expect)} call(s) on the {expect} route", moved)
    # The eligible collectives: on flashcomm's lossless kernels, or all on NCCL when expected.
    # (The warm-up and the capture of the graph are calls; its replays are not.)
    for coll, least in (("allreduce", 7), ("allgather", 1), ("reducescatter", rs_least)):
        got = calls(coll, expect)
        check(got >= least and calls(coll, "quantized") == 0,
              f"{coll}: {got} call(s) on the {expect} route", moved)

    dist.destroy_process_group()
    if failures:
        sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", help="flashcomm's library (default: the libnccl* entry of LD_PRELOAD)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--real", help="the real libnccl.so.2 (default: found by flashcomm)")
    p.add_argument("--expect-route", default="lossless", choices=["lossless", "nccl"],
                   help="route of all_reduce, all_gather and reduce_scatter (default: lossless)")
    args = p.parse_args()
    preloaded = [x for x in os.environ.get("LD_PRELOAD", "").split(":") if "libnccl" in os.path.basename(x)]
    if not args.lib and not preloaded:
        p.error("--lib is required when LD_PRELOAD holds no libnccl library")
    lib = os.path.abspath(args.lib or preloaded[0])

    if lib not in [os.path.abspath(x) for x in os.environ.get("LD_PRELOAD", "").split(":") if x]:
        env = dict(os.environ)
        env["LD_PRELOAD"] = ":".join(x for x in [lib, env.get("LD_PRELOAD", "")] if x)
        if args.real:
            env["FLASHCOMM_NCCL_LIB"] = os.path.abspath(args.real)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.world_size:
        print(f"FAIL need {args.world_size} GPUs, found {torch.cuda.device_count()}")
        return 1
    try:
        mp.spawn(worker, args=(args.world_size, free_port(), lib, args.expect_route),
                 nprocs=args.world_size, join=True)
    except Exception as e:  # a rank failed or crashed
        print(f"FAIL {e}")
        return 1
    print(f"PASS torch on flashcomm, world size {args.world_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
