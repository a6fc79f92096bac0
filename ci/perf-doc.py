#!/usr/bin/env python3
"""The tables and plots of docs/perf.md (and the README's "Performance at a glance"), generated from
the flashcomm-perf JSON committed under docs/results.

    ci/perf-doc.py --write     # regenerate every table and plot
    ci/perf-doc.py --check     # exit 1 when a table or plot no longer matches its JSON (ci/test.sh)
    ci/perf-doc.py --print NAME  # print one generated section
    ci/perf-doc.py --table versus|host FILE.json ... [--launch L] [--dtype T] [--widths 8,4]
                               # a fresh results folder's table, in this page's format

Every entry of SOURCES (below) is one generated section or plot. A table lives in its document
between two lines of its own,

    <!-- BEGIN GENERATED: perf-doc NAME -->
    <!-- END GENERATED: perf-doc NAME -->

and is followed, inside the markers, by the command that produced its JSON, the commit, the GPU and
the check verdict (every row's #wrong), all read from the JSON. A plot is an SVG file under
docs/plots/, drawn from the same JSON.

Adding a table from a new results folder is one line in SOURCES (at the top of this file). For a folder of flashcomm-perf
runs of flashcomm against competitors (ci/perf-competitors.sh: comp-n2.json, comp-n4.json, ...;
rows nccl, reference, pull-1stage, pull-2stage, with vs_best on flashcomm's rows):

    "pull": dict(kind="versus", files="2026-12-06-h100-<commit>/comp-n*.json", launch="graph", dtype="bfloat16"),

then put the two marker lines for `pull` where the table belongs in docs/perf.md and run
`ci/perf-doc.py --write`. `versus` puts flashcomm beside every competitor found in the files (in
the order of COMPETITORS; pull-best, the faster pull kernel, when present), one row per rank count
and size, with vs best: flashcomm's time over the fastest competitor of the same run (the tool's
vs_best when the JSON has it, else computed from the rows). Options: `launch`, `dtype`, `min` and
`max` (the sizes shown, in bytes), `widths`
(quantized rows to add as columns, e.g. [8, 4]), `baselines` (non-competing rows shown for scale:
copy, link-both), `busbw=True` (flashcomm's bus bandwidth column). The other kinds: `host`
(host-transport runs: the link busy both ways, lossless, its share of the link's floor, every
quantized width with lossless time over it), `overhead` (the eager host-cost log of
tests/c/overhead.c), `bytes` (the bytes each design moves per call against its time, at one
size: `designs` lists (impl, label, bytes as an expression of the rank count n, in messages)),
`glance` (the README's summary) and the plots `latency_plot` and
`bandwidth_plot`. `files` are relative to docs/results. Python 3 standard library only.
"""
# name: source, one line each. A table's section is found in its document (docs/perf.md unless
# `doc` says otherwise) by its markers; a plot is written to docs/plots/<name>.svg. `files` is a
# glob under docs/results (one file per rank count, sorted by the numbers in their names).
SOURCES = {
    "procs": dict(kind="versus", files="2026-12-07-h100-57956c4/procs-n[248].json", launch="graph", dtype="bfloat16"),
    "decode": dict(kind="versus", files="2026-12-06-h100-323c796/comp-n*.json", launch="graph", dtype="bfloat16"),
    "bytes": dict(kind="bytes", files="2026-12-06-h100-323c796/comp-n8.json", launch="graph", dtype="bfloat16", size=16 << 20,
                  designs=[("flashcomm", "flashcomm's plan", "2*n"), ("pull-2stage", "pull design, 2-stage", "3*n+1"), ("pull-1stage", "pull design, 1-stage", "n*(n+1)")]),
    "bandwidth": dict(kind="versus", files="2026-12-04-h200-18177d6/p2p-quant8.json", launch="graph", baselines=["copy"], widths=[8, 4, 2], busbw=True),
    "pcie": dict(kind="host", files="2026-12-07-h100-821ab11/host-[24]r.json", launch="graph"),
    "pcie-small": dict(kind="host", files="2026-12-07-h100-b541c40/host/B-auto[24].json", launch="graph"),
    "quantized": dict(kind="host", files="2026-12-04-h200-18177d6/ar2.json", launch="graph"),
    "alltoall": dict(kind="versus", files="2026-12-06-h100-3ef811d/auto/alltoall-auto-n8.json", launch="graph", baselines=["copy"]),
    "host-cost": dict(kind="overhead", files="2026-12-04-h200-990b028/logs/c__overhead.log"),
    "glance": dict(kind="glance", doc="README.md", decode=[("procs", "one process per rank (as serving stacks run), under CUDA MPS"), ("decode", "threads of one process (virtual ranks)")],
                   pcie="quantized", cost="host-cost", alltoall="alltoall"),
    "decode-latency": dict(kind="latency_plot", files="2026-12-06-h100-323c796/comp-n*.json", dtype="bfloat16", title="AllReduce latency against the plain and the pull kernels (bf16, CUDA graphs)"),
    "pcie-bandwidth": dict(kind="bandwidth_plot", files="2026-12-04-h200-18177d6/ar2.json", title="AllReduce bandwidth across PCIe (2 ranks, bf16, CUDA graphs)", widths=[8, 4, 2]),
}

import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RESULTS = os.path.join(ROOT, "docs", "results")
PERF_MD = os.path.join(ROOT, "docs", "perf.md")
PLOTS = os.path.join(ROOT, "docs", "plots")

# Rows that are competitors (counted in vs best), in column order.
COMPETITORS = ["nccl", "reference", "pull-1stage", "pull-2stage"]


# ---------------------------------------------------------------- reading runs

def paths_of(pattern):
    found = sorted(glob.glob(os.path.join(RESULTS, pattern)), key=natural)
    if not found:
        raise SystemExit(f"perf-doc: no file matches docs/results/{pattern}")
    return found


def natural(s):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def load(path):
    with open(path) as f:
        return json.load(f)


def time_of(r):
    return ((r or {}).get("out_of_place") or {}).get("time_us")


def wrong_of(r):
    out = (r or {}).get("out_of_place") or {}
    return (out.get("wrong") or 0) + (out.get("rank_mismatch_bytes") or 0)


def size_label(b):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def fmt(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"


def pick(doc, launch, dtype, src=None):
    """The rows of one launch mode and type; with a source, only its sizes (`min`, `max`: bytes)."""
    lo, hi = (src or {}).get("min", 0), (src or {}).get("max", 1 << 62)
    return [
        r for r in doc["rows"]
        if r["launch"] == launch and (dtype is None or r["type"] == dtype)
        and lo <= r["size_bytes"] <= hi
    ]


def quant_name(w):
    return f"flashcomm-q{w}"


def command_of(docs):
    """One command line for several runs: tokens that differ become a|b|c."""
    lines = []
    for d in docs:
        toks = list(d["settings"].get("command_line") or [])
        for i, t in enumerate(toks):
            if i > 0 and toks[i - 1] == "--json":
                toks[i] = os.path.basename(t)
        lines.append(toks)
    base = lines[0]
    if all(len(l) == len(base) for l in lines):
        merged = []
        for i in range(len(base)):
            vals = []
            for l in lines:
                if l[i] not in vals:
                    vals.append(l[i])
            merged.append("|".join(vals))
        return ["flashcomm-perf " + " ".join(merged)]
    return ["flashcomm-perf " + " ".join(l) for l in lines]


def link(folder, doc):
    """A markdown link to a folder of the repository, from the document that shows it."""
    return f"[{folder}/]({os.path.relpath(os.path.join(ROOT, folder), os.path.dirname(doc))}/)"


def footer(paths, docs, doc, skip=("pull-best",)):
    s = docs[0]["settings"]
    commits = sorted({str(d["settings"].get("commit"))[:7] for d in docs})
    gpus = sorted({str(d["settings"].get("gpu")) for d in docs})
    modes = sorted({str(d["settings"].get("mode")) for d in docs})
    bad = []
    for p, d in zip(paths, docs):
        for r in d["rows"]:
            if any(r["impl"].startswith(k) for k in skip):
                continue
            if wrong_of(r):
                bad.append(f"{os.path.basename(p)} {r['impl']} {r['launch']} {size_label(r['size_bytes'])}")
    rel = sorted({os.path.relpath(os.path.dirname(p), ROOT) for p in paths})
    names = ", ".join(sorted({os.path.relpath(p, os.path.join(ROOT, rel[0])) for p in paths}, key=natural))
    where = "virtual ranks on one GPU" if modes == ["virtual"] else "mode " + ", ".join(modes)
    out = ["", "Command:", ""]
    out += ["    " + c for c in command_of(docs)]
    out += [
        "",
        f"Commit {', '.join(commits)}; {', '.join(gpus)} ({where}, transport "
        f"{s.get('transport', 'auto')}); JSON: {link(rel[0], doc)} {names}; "
        + ("every row #wrong 0." if not bad else "#wrong not 0 in: " + "; ".join(bad) + "."),
    ]
    return out


# ---------------------------------------------------------------- table kinds

def table_versus(src):
    paths = paths_of(src["files"])
    docs = [load(p) for p in paths]
    launch, dtype = src.get("launch", "graph"), src.get("dtype")
    widths = src.get("widths", [])
    baselines = src.get("baselines", [])
    present = set()
    for d in docs:
        present |= {r["impl"] for r in pick(d, launch, dtype, src)}
    comps = [c for c in COMPETITORS if c in present]
    if "pull-best" in present:
        comps.append("pull-best")
    bases = [b for b in baselines if b in present]
    many = len(docs) > 1
    head = (["ranks"] if many else []) + ["size"]
    head += [f"{b} (us)" for b in bases] + [f"{c} (us)" for c in comps]
    head += ["flashcomm (us)"] + (["busbw (GB/s)"] if src.get("busbw") else []) + ["plan"]
    head += ["vs best"] if comps else []
    head += [f"{w}-bit (us)" for w in widths]
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" if h == "plan" else "---:" for h in head) + "|"]
    for d in docs:
        rows = pick(d, launch, dtype, src)
        by = {(r["impl"], r["size_bytes"]): r for r in rows}
        for b in sorted({r["size_bytes"] for r in rows}):
            fc = by.get(("flashcomm", b))
            cells = ([str(d["settings"]["ranks"])] if many else []) + [size_label(b)]
            cells += [fmt(time_of(by.get((x, b)))) for x in bases + comps]
            cells.append(fmt(time_of(fc)))
            if src.get("busbw"):
                cells.append(fmt(((fc or {}).get("out_of_place") or {}).get("busbw_gbs"), 1))
            plan = (fc or {}).get("plan") or "-"
            cells.append(plan)
            if comps:
                vb = (fc or {}).get("vs_best")
                if vb is None:
                    ts = [time_of(by.get((c, b))) for c in COMPETITORS]
                    ts = [t for t in ts if t]
                    vb = time_of(fc) / min(ts) if ts and time_of(fc) else None
                cells.append(fmt(vb, 3))
            for w in widths:
                r = by.get((quant_name(w), b))
                t = time_of(r)
                mark = " L" if ((r or {}).get("plan") or "").startswith("lossless:") else ""
                cells.append(fmt(t) + mark)
            out.append("| " + " | ".join(cells) + " |")
    return out + footer(paths, docs, doc_of(src))


def floor_factor(collective, nranks, plan):
    n = nranks
    if collective != "allreduce":
        return n - 1
    if plan and plan.split(":")[-1].startswith("oneshot"):
        return n * (n - 1)
    return 2 * (n - 1)


def table_host(src):
    paths = paths_of(src["files"])
    docs = [load(p) for p in paths]
    launch, dtype = src.get("launch", "graph"), src.get("dtype")
    many = len(docs) > 1
    widths = src.get("widths")
    if widths is None:
        found = set()
        for d in docs:
            found |= {r["impl"] for r in pick(d, launch, dtype) if r["impl"].startswith("flashcomm-q")}
        widths = sorted((int(i[len("flashcomm-q"):]) for i in found), reverse=True)
    # The link's round trip (the latency floor), where the run has it (flashcomm-perf's link-rtt row).
    rtt = any(r["impl"] == "link-rtt" for d in docs for r in pick(d, launch, dtype))
    head = (["ranks"] if many else []) + ["size"] + (["link-rtt (us)"] if rtt else [])
    head += ["link-both (us)", "lossless (us)", "of floor"]
    head += [f"{w}-bit (us, x)" for w in widths]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
    for d in docs:
        s = d["settings"]
        rows = pick(d, launch, dtype)
        by = {(r["impl"], r["size_bytes"]): r for r in rows}
        for b in sorted({r["size_bytes"] for r in rows}):
            loss, link = by.get(("flashcomm", b)), by.get(("link-both", b))
            tl, tb = time_of(loss), time_of(link)
            share = "-"
            if tl and tb:
                share = f"{100.0 * tb * floor_factor(s['collective'], s['ranks'], loss['plan']) / tl:.0f}%"
            cells = ([str(s["ranks"])] if many else []) + [size_label(b)]
            cells += [fmt(time_of(by.get(("link-rtt", b))), 1)] if rtt else []
            cells += [fmt(tb, 1), fmt(tl, 1), share]
            for w in widths:
                r = by.get((quant_name(w), b))
                t = time_of(r)
                if t is None:
                    cells.append("-")
                    continue
                mark = " L" if (r.get("plan") or "").startswith("lossless:") else ""
                cells.append(f"{t:.1f} ({tl / t:.2f}){mark}" if tl else f"{t:.1f}")
            out.append("| " + " | ".join(cells) + " |")
    return out + footer(paths, docs, doc_of(src))


OVERHEAD_LINE = re.compile(
    r"^(nccl\w+(?: \d+K)?(?: in)?)\s+real\s+([\d.]+) ns\s+flashcomm\s+([\d.]+) ns")


def parse_overhead(path):
    rows = []
    with open(path) as f:
        text = f.read()
    for line in text.splitlines():
        m = OVERHEAD_LINE.match(line)
        if m:
            rows.append((m.group(1), float(m.group(2)), float(m.group(3))))
    head = [l for l in text.splitlines() if l.startswith("NCCL ")]
    return rows, (head[0] if head else "")


def call_label(name):
    m = re.match(r"ncclAllReduce (\d+)K( in)?$", name)
    if not m:
        return f"`{name}` (forwarded)"
    kib = int(m.group(1))
    size = f"{kib // 1024} MiB" if kib % 1024 == 0 else f"{kib} KiB"
    return f"`ncclAllReduce` {size}, {'in place' if m.group(2) else 'out of place'}"


def table_overhead(src):
    paths = paths_of(src["files"])
    rows, head = parse_overhead(paths[0])
    out = ["| call | real NCCL (ns) | flashcomm (ns) | flashcomm / real |", "|---|---:|---:|---:|"]
    for name, real, fc in rows:
        out.append(f"| {call_label(name)} | {real:.1f} | {fc:.1f} | {fc / real:.2f} |")
    folder = os.path.relpath(os.path.dirname(os.path.dirname(paths[0])), ROOT)
    env = os.path.join(ROOT, folder, "environment.txt")
    gpu, commit = "", ""
    if os.path.exists(env):
        with open(env) as f:
            lines = f.read().splitlines()
        gpu = next((l.split(",")[0].strip() for l in lines if l.startswith("NVIDIA")), "")
        commit = next((l.split()[1][:7] for l in lines if l.startswith("commit:")), "")
    m = re.match(r"NCCL (\d+)(\d\d)(\d\d), (\d+) calls per round, best of (\d+) rounds", head)
    how = head
    if m:
        how = (f"the real NCCL {m.group(1)}.{int(m.group(2))}.{int(m.group(3))}; forwarded calls: best of "
               f"{m.group(5)} rounds of {int(m.group(4)):,} calls; `ncclAllReduce`: median of 7 "
               "interleaved rounds of 500 eager calls")
    out += [
        "",
        "Command: `tests/c/overhead.c`, from the GPU bundle `run.sh <results-dir> c::overhead`; "
        f"one rank; {how}; commit {commit or 'in the folder'}; {gpu or 'GPU in the folder'}; log: {link(folder, doc_of(src))} "
        f"{os.path.relpath(paths[0], os.path.join(ROOT, folder))}.",
    ]
    return out


def decode_line(name, shape):
    dec = SOURCES[name]
    ratios, by_ranks, gpus = [], {}, set()
    for p in paths_of(dec["files"]):
        d = load(p)
        gpus.add(str(d["settings"].get("gpu")))
        rows = pick(d, dec.get("launch", "graph"), dec.get("dtype"), dec)
        by = {(r["impl"], r["size_bytes"]): r for r in rows}
        n = d["settings"]["ranks"]
        for b in sorted({r["size_bytes"] for r in rows}):
            fc = by.get(("flashcomm", b))
            tf = time_of(fc)
            ts = [time_of(by.get((c, b))) for c in COMPETITORS]
            ts = [t for t in ts if t]
            if tf and ts:
                vb = (fc or {}).get("vs_best") or tf / min(ts)
                ratios.append(vb)
                by_ranks.setdefault(n, []).append((b, tf, min(ts)))
    n_max = max(by_ranks)
    small = [x for x in by_ranks[n_max] if x[0] <= 64 << 10]
    lo = size_label(min(x[0] for xs in by_ranks.values() for x in xs))
    hi = size_label(max(x[0] for xs in by_ranks.values() for x in xs))
    ranks = "-".join(str(n) for n in (min(by_ranks), max(by_ranks)))
    return (f"| AllReduce, {lo}-{hi}, {ranks} ranks on one {', '.join(sorted(gpus))}, {shape} | "
            f"{min(ratios):.2f}-{max(ratios):.2f}x the time of the fastest of a plain one-shot kernel "
            f"and a clean-room kernel of the pull design of vLLM's and SGLang's custom all-reduce (not their code), measured in the same shape; "
            f"at {n_max} ranks and 8-64 KiB {min(x[1] for x in small):.2f}-{max(x[1] for x in small):.2f} us "
            f"against {min(x[2] for x in small):.2f}-{max(x[2] for x in small):.2f} us |")


def table_glance(src):
    q = load(paths_of(SOURCES[src["pcie"]]["files"])[0])
    qgpu = str(q["settings"].get("gpu"))
    qrows = {(r["impl"], r["size_bytes"]): r for r in pick(q, "graph", None)}
    big = max(b for (i, b) in qrows if i == "flashcomm")
    q4 = time_of(qrows[("flashcomm", big)]) / time_of(qrows[(quant_name(4), big)])
    cost, _ = parse_overhead(paths_of(SOURCES[src["cost"]]["files"])[0])
    ar = [fc / real for name, real, fc in cost if name.startswith("ncclAllReduce")]
    lines = [
        "| question | answer (details in [docs/perf.md](docs/perf.md)) |",
        "|---|---|",
        *(decode_line(name, shape) for name, shape in src["decode"]),
        # 2-bit is not a headline: docs/accuracy.md finds two-step 2-bit unusable on a real model.
        f"| Quantized AllReduce across PCIe, {q['settings']['ranks']} ranks, {size_label(big)} ({qgpu}) | "
        f"4-bit {q4:.2f}x faster than lossless (accuracy per width: docs/accuracy.md) |",
        f"| Host cost of an eager `ncclAllReduce` on a communicator of one rank (flashcomm launches no kernel there: one device copy, or nothing in place) | "
        f"{min(ar):.2f}-{max(ar):.2f}x the real NCCL's |",
    ]
    if "alltoall" in src:
        # AllToAll against the plain pattern (every rank pushes block q to rank q as LL lines).
        a2a = SOURCES[src["alltoall"]]
        d = load(paths_of(a2a["files"])[0])
        by = {(r["impl"], r["size_bytes"]): r for r in pick(d, a2a.get("launch", "graph"), a2a.get("dtype"), a2a)}
        pairs = sorted((b, time_of(by[("flashcomm", b)]) / time_of(by[("reference", b)]))
                       for (i, b) in by if i == "flashcomm" and ("reference", b) in by)
        large = [v for b, v in pairs if b >= 512 << 10]
        lines.insert(2 + len(src["decode"]), f"| AllToAll, {size_label(pairs[0][0])}-{size_label(pairs[-1][0])} (whole buffer), "
                        f"{d['settings']['ranks']} ranks on one {d['settings'].get('gpu')} | "
                        f"{min(v for _, v in pairs):.2f}-{max(v for _, v in pairs):.2f}x the time of flashcomm's own "
                        f"untuned reference kernel (each peer's block pushed as LL lines; no other AllToAll measured yet); from 512 KiB "
                        f"{min(large):.2f}-{max(large):.2f}x |")
    return lines


# ---------------------------------------------------------------- plots (SVG)

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22"]


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def short_size(b):
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{suffix}"
    return str(int(b))


def num_label(v):
    return f"{v:.0f}" if v >= 1 else f"{v:.6f}".rstrip("0")


class Axis:
    def __init__(self, lo, hi, base):
        a = math.floor(math.log(lo) / math.log(base))
        b = math.ceil(math.log(hi) / math.log(base))
        if b <= a:
            b = a + 1
        self.lo, self.hi = base ** a, base ** b

    def frac(self, v):
        return (math.log(v) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))


def panel(svg, x0, y0, w, h, title, ylabel, series, colors):
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    xa, ya = Axis(min(xs), max(xs), 2), Axis(min(ys), max(ys), 10)
    px = lambda v: x0 + xa.frac(v) * w
    py = lambda v: y0 + h - ya.frac(v) * h
    svg.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" fill="#ffffff" stroke="#444444"/>')
    svg.append(f'<text x="{x0 + w / 2:.1f}" y="{y0 - 10:.1f}" text-anchor="middle" font-size="14" font-weight="bold">{esc(title)}</text>')
    xl, xh = round(math.log2(xa.lo)), round(math.log2(xa.hi))
    step = max(1, math.ceil((xh - xl) / 8))
    for e in range(xl, xh + 1, step):
        x = px(2.0 ** e)
        svg.append(f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y0 + h:.1f}" stroke="#dddddd"/>')
        svg.append(f'<text x="{x:.1f}" y="{y0 + h + 16:.1f}" text-anchor="middle" font-size="11">{short_size(2 ** e)}</text>')
    for d in range(round(math.log10(ya.lo)), round(math.log10(ya.hi)) + 1):
        y = py(10.0 ** d)
        svg.append(f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x0 + w:.1f}" y2="{y:.1f}" stroke="#dddddd"/>')
        svg.append(f'<text x="{x0 - 6:.1f}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{num_label(10.0 ** d)}</text>')
    svg.append(f'<text x="{x0 + w / 2:.1f}" y="{y0 + h + 36:.1f}" text-anchor="middle" font-size="12">message size (bytes)</text>')
    lx, ly = x0 - 44, y0 + h / 2
    svg.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="middle" font-size="12" transform="rotate(-90 {lx:.1f} {ly:.1f})">{esc(ylabel)}</text>')
    for label, pts in series:
        c = colors[label]
        pts = sorted(pts)
        svg.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                   + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts) + '"/>')
        for x, y in pts:
            svg.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{c}"/>')


def figure(title, subtitle, panels, ylabel):
    labels = []
    for _, series in panels:
        for label, _ in series:
            if label not in labels:
                labels.append(label)
    colors = {l: PALETTE[i % len(PALETTE)] for i, l in enumerate(labels)}
    pw, ph, left, top, gap = (300.0, 260.0, 70.0, 84.0, 70.0) if len(panels) > 1 else (560.0, 330.0, 80.0, 84.0, 0.0)
    width = left + len(panels) * pw + (len(panels) - 1) * gap + 30
    legend_y = top + ph + 60
    cols = 4 if len(panels) > 1 else 2
    height = legend_y + 22 * math.ceil(len(labels) / cols) + 10
    svg = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">',
           f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#fafafa"/>',
           f'<text x="{width / 2:.1f}" y="26" text-anchor="middle" font-size="17" font-weight="bold">{esc(title)}</text>',
           f'<text x="{width / 2:.1f}" y="46" text-anchor="middle" font-size="12" fill="#555555">{esc(subtitle)}</text>']
    for i, (ptitle, series) in enumerate(panels):
        panel(svg, left + i * (pw + gap), top, pw, ph, ptitle, ylabel, series, colors)
    for i, label in enumerate(labels):
        x = left + (i % cols) * (190 if cols == 4 else 290)
        y = legend_y + (i // cols) * 22
        svg.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 26:.1f}" y2="{y:.1f}" stroke="{colors[label]}" stroke-width="3"/>')
        svg.append(f'<text x="{x + 32:.1f}" y="{y + 4:.1f}" font-size="12">{esc(label)}</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


def subtitle_of(docs):
    s = docs[0]["settings"]
    commits = ", ".join(sorted({str(d["settings"].get("commit"))[:7] for d in docs}))
    return f"{s.get('gpu')}, virtual ranks on one GPU, commit {commits} (docs/perf.md)"


def plot_latency(src):
    paths = paths_of(src["files"])
    docs = [load(p) for p in paths]
    launch = src.get("launch", "graph")
    panels = []
    for d in docs:
        rows = pick(d, launch, src.get("dtype"), src)
        series = []
        impls = [c for c in COMPETITORS + ["pull-best"] if any(r["impl"] == c for r in rows)] + ["flashcomm"]
        for impl in impls:
            pts = [(r["size_bytes"], time_of(r)) for r in rows if r["impl"] == impl and time_of(r)]
            series.append((impl, pts))
        panels.append((f"{d['settings']['ranks']} ranks", series))
    return figure(src["title"], subtitle_of(docs), panels, "time per call (us)")


def plot_bandwidth(src):
    paths = paths_of(src["files"])
    docs = [load(p) for p in paths]
    launch = src.get("launch", "graph")
    rows = pick(docs[0], launch, src.get("dtype"))
    n = docs[0]["settings"]["ranks"]
    # The link's floor for a two-step AllReduce: 2(N - 1) times the message each way through the
    # one link, at the rate of the copy engines moving both ways at once (the link-both row).
    names = [("link-both", "PCIe floor of lossless (copy engines, both ways)", 2 * (n - 1)),
             ("flashcomm", "flashcomm lossless", 1)]
    names += [(quant_name(w), f"flashcomm {w}-bit", 1) for w in src.get("widths", [])]
    series = []
    for impl, label, factor in names:
        pts = [(r["size_bytes"], r["size_bytes"] / (factor * time_of(r)) / 1e3)
               for r in rows if r["impl"] == impl and time_of(r)]
        if pts:
            series.append((label, pts))
    return figure(src["title"], subtitle_of(docs), [("bytes of the message per second", series)],
                  "algbw (GB/s)")


def bytes_expr(factor):
    e = factor.replace("*", "")
    return f"({e}) S" if "+" in e or "-" in e else f"{e} S"


def table_bytes(src):
    """Bytes each design moves through memory per call (a multiple of the message S on N ranks)
    against its time: the question "where does the time go"."""
    paths = paths_of(src["files"])
    docs = [load(p) for p in paths]
    d = docs[0]
    n = d["settings"]["ranks"]
    size = src["size"]
    by = {r["impl"]: r for r in pick(d, src.get("launch", "graph"), src.get("dtype")) if r["size_bytes"] == size}
    out = [f"| design ({n} ranks, {size_label(size)}) | plan | bytes moved (S = message) | time (us) | bytes / time (TB/s) |",
           "|---|---|---|---:|---:|"]
    for impl, label, factor in src["designs"]:
        r = by.get(impl)
        t = time_of(r)
        k = eval(factor, {"__builtins__": {}}, {"n": n})  # arithmetic of the rank count only
        moved = k * size
        rate = moved / (t * 1e-6) / 1e12 if t else None
        out.append(f"| {label} | {(r or {}).get('plan') or '-'} | {bytes_expr(factor)} = {k} S | {fmt(t)} | {fmt(rate, 2)} |")
    return out + footer(paths, docs, doc_of(src))


def doc_of(src):
    return os.path.join(ROOT, src["doc"]) if "doc" in src else PERF_MD

KINDS = {"versus": table_versus, "host": table_host, "overhead": table_overhead, "bytes": table_bytes,
         "glance": table_glance, "latency_plot": plot_latency, "bandwidth_plot": plot_bandwidth}


# ---------------------------------------------------------------- documents

def render(name, src):
    return KINDS[src["kind"]](src)


def markers(name):
    return f"<!-- BEGIN GENERATED: perf-doc {name} -->", f"<!-- END GENERATED: perf-doc {name} -->"


def splice(text, name, body, path):
    begin, end = markers(name)
    b, e = text.find(begin), text.find(end)
    if b < 0 or e < b:
        raise SystemExit(f"perf-doc: {os.path.relpath(path, ROOT)} has no markers for `{name}`:\n  {begin}\n  {end}")
    return text[: b + len(begin)] + "\n" + "\n".join(body) + "\n" + text[e:]


def wanted():
    """{path: wanted text} for every document and plot."""
    out = {}
    for name, src in SOURCES.items():
        if src["kind"].endswith("_plot"):
            out[os.path.join(PLOTS, f"{name}.svg")] = render(name, src)
            continue
        path = doc_of(src)
        if path not in out:
            with open(path) as f:
                out[path] = f.read()
        out[path] = splice(out[path], name, render(name, src), path)
    return out


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    g.add_argument("--print", metavar="NAME")
    g.add_argument("--table", choices=["versus", "host"], help="print FILE... as this kind")
    p.add_argument("files", nargs="*", help="with --table: flashcomm-perf JSON files")
    p.add_argument("--launch", default="graph")
    p.add_argument("--dtype")
    p.add_argument("--widths", help="quantized widths as columns, e.g. 8,4")
    a = p.parse_args(argv)
    if a.table:
        if not a.files:
            p.error("--table needs JSON files")
        opts = dict(launch=a.launch, dtype=a.dtype)
        if a.widths:
            opts["widths"] = [int(w) for w in a.widths.split(",")]
        # One glob pattern per file, absolute, so that paths_of finds them outside docs/results.
        lines = []
        for f in a.files:
            src = dict(kind=a.table, files=os.path.abspath(f), **opts)
            lines += render(a.table, src) + [""]
        print("\n".join(lines))
        return 0
    if a.print:
        body = render(a.print, SOURCES[a.print])
        print(body if isinstance(body, str) else "\n".join(body))
        return 0
    stale = []
    for path, text in wanted().items():
        try:
            with open(path) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        if a.write:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            print(f"perf-doc: wrote {os.path.relpath(path, ROOT)}")
        else:
            stale.append(os.path.relpath(path, ROOT))
    if stale:
        print("perf-doc: stale (run ci/perf-doc.py --write): " + ", ".join(stale), file=sys.stderr)
        return 1
    if a.check:
        print("perf-doc: every table and plot matches its JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
