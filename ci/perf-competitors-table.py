#!/usr/bin/env python3
"""flashcomm beside its competitors (docs/perf-tool.md, "Competitors in flashcomm-perf"), from
flashcomm-perf JSON files.

    ci/perf-competitors-table.py <results-dir or FILE.json> ...

Reads every comp-n*.json of a results folder of ci/perf-competitors.sh (or the files named). For
each file, type and launch mode, one markdown table; per size: flashcomm's time and plan, each
competitor measured per rank (nccl when present, reference, pull-1stage, pull-2stage), pull-best
with the kernel that won, the fastest competitor and flashcomm's time over it (vs_best, as the
tool computes it), then the one-grid rows (every rank in one grid launched by one thread) and
what launching per rank costs the pull reference (pull-best over pull-best-1grid). Ends with the
rows whose #wrong is not 0, or says that every row's is 0. Python 3 standard library only.
"""
import glob
import json
import os
import sys

COMPETITORS = ["nccl", "reference", "pull-1stage", "pull-2stage"]


def size_label(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def time_of(r):
    out = (r or {}).get("out_of_place") or {}
    return out.get("time_us")


def wrong_of(r):
    out = (r or {}).get("out_of_place") or {}
    return out.get("wrong") or 0


def fmt(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def tables(name, doc):
    s = doc["settings"]
    rows = doc["rows"]
    out = []
    keys = []
    for r in rows:
        k = (r["type"], r["launch"])
        if k not in keys:
            keys.append(k)
    for dtype, launch in keys:
        mine = [r for r in rows if r["type"] == dtype and r["launch"] == launch]
        by = {(r["impl"], r["size_bytes"]): r for r in mine}
        impls = {r["impl"] for r in mine}
        comps = [c for c in COMPETITORS if c in impls]
        grid = [c for c in ("reference-1grid", "pull-best-1grid") if c in impls]
        head = ["size", "flashcomm (us)", "plan"] + [f"{c} (us)" for c in comps]
        if "pull-best" in impls:
            head.append("pull-best (us, kernel)")
        head += ["fastest competitor", "vs_best"]
        head += [f"{c} (us)" for c in grid]
        if "pull-best" in impls and "pull-best-1grid" in impls:
            head.append("pull-best / 1grid")
        out.append(
            f"{name}: {s['collective']}, {s['ranks']} ranks ({s['mode']}), {dtype}, {launch} "
            f"(commit {str(s.get('commit'))[:7]}, {s.get('gpu')}):"
        )
        out.append("")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---" if h in ("plan", "fastest competitor") else "---:" for h in head) + "|")
        for b in sorted({r["size_bytes"] for r in mine}):
            fc = by.get(("flashcomm", b))
            cells = [size_label(b), fmt(time_of(fc)), (fc or {}).get("plan") or "-"]
            cells += [fmt(time_of(by.get((c, b)))) for c in comps]
            best = by.get(("pull-best", b))
            if "pull-best" in impls:
                kernel = ((best or {}).get("plan") or "-").split("/")[0]
                cells.append(f"{fmt(time_of(best))} ({kernel})")
            timed = [(time_of(by.get((c, b))), c) for c in comps]
            timed = [(t, c) for t, c in timed if t is not None]
            fastest = min(timed) if timed else None
            cells.append(f"{fastest[1]} ({fastest[0]:.2f})" if fastest else "-")
            cells.append(fmt((fc or {}).get("vs_best"), 3))
            cells += [fmt(time_of(by.get((c, b)))) for c in grid]
            if "pull-best" in impls and "pull-best-1grid" in impls:
                cells.append(fmt(ratio(time_of(best), time_of(by.get(("pull-best-1grid", b)))), 3))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def main(args):
    if not args:
        print(__doc__.strip().split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    files = []
    for a in args:
        files += sorted(glob.glob(os.path.join(a, "comp-n*.json"))) if os.path.isdir(a) else [a]
    lines, bad = [], []
    for f in files:
        with open(f) as fh:
            doc = json.load(fh)
        name = os.path.basename(f)
        lines += tables(name, doc)
        for r in doc["rows"]:
            # pull-best repeats a measured row: its #wrong is counted there.
            if wrong_of(r) and not r["impl"].startswith("pull-best"):
                bad.append(f"{name}: {r['impl']} {r['type']} {r['launch']} {size_label(r['size_bytes'])}: #wrong {wrong_of(r)}")
    print("\n".join(lines + (bad or ["every row #wrong 0"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
