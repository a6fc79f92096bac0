#!/usr/bin/env python3
"""The decode-latency tables of a results folder of ci/perf-decode.sh, from its JSON files.

    ci/perf-decode-table.py <results-dir>

For every rank count and size: the reference's time, the pull reference's (pull-best: the faster
of its 1-stage and 2-stage kernels in the same run, "-" in runs without it), the selector's plan
and time, the best forced plan and its time (one-shot/two-shot x LL/BLOCK, each measured in its
own run), the ratios to the reference, to the fastest competitor of the same run (vs best: the
tool's vs_best, over the reference and the pull reference's kernels) and to the best forced plan,
and #wrong summed over the measured rows; then the one-rank communicator against a device copy. Where the run with the reference was repeated
(ref-n<n>-r<i>.json), times are medians over the runs, "vs ref" is the median of each run's own
ratio ("vs best" likewise), and the plan column lists every plan the selector chose (one plan:
stable across runs).
"""
import statistics
import glob
import json
import os
import sys


def rows(path):
    with open(path) as f:
        return json.load(f)["rows"]


def graph(rs, impl):
    return {
        r["size_bytes"]: r
        for r in rs
        if r["impl"] == impl and r["launch"] == "graph" and r["out_of_place"] is not None
    }


def t(r):
    return r["out_of_place"].get("time_us") if r else None


def wrong(r):
    return (r["out_of_place"].get("wrong") or 0) if r else 0


def fmt(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"


def main():
    res = sys.argv[1]
    print("| ranks | size | reference (us) | pull-best (us) | selector's plan | selector (us) | vs ref | vs best | best forced plan | best forced (us) | selector / best | #wrong |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|")
    groups = {}
    for path in glob.glob(os.path.join(res, "ref-n*.json")):
        n = int(os.path.basename(path)[len("ref-n"):].split("-")[0].split(".")[0])
        groups.setdefault(n, []).append(path)
    for n in sorted(groups):
        runs = [rows(p) for p in sorted(groups[n])]
        refs = [graph(rs, "reference") for rs in runs]
        pulls = [graph(rs, "pull-best") for rs in runs]
        # The pull reference's measured rows (pull-best repeats one of them).
        kernels = [graph(rs, "pull-1stage") for rs in runs] + [graph(rs, "pull-2stage") for rs in runs]
        sels = [graph(rs, "flashcomm") for rs in runs]
        forced = [graph(rows(p), "flashcomm") for p in glob.glob(os.path.join(res, f"forced-n{n}-*.json"))]
        for size in sorted(set().union(*[set(s) for s in sels])):
            ss = [s[size] for s in sels if size in s and t(s[size]) is not None]
            rr = [r[size] for r in refs if size in r and t(r[size]) is not None]
            pp = [p[size] for p in pulls if size in p and t(p[size]) is not None]
            pk = [k[size] for k in kernels if size in k and t(k[size]) is not None]
            bests = [x["vs_best"] for x in ss if x.get("vs_best") is not None]
            ratios = [t(s[size]) / t(r[size]) for s, r in zip(sels, refs)
                      if size in s and size in r and t(s[size]) and t(r[size])]
            cands = [f[size] for f in forced if size in f and t(f[size]) is not None]
            best = min(cands, key=t) if cands else None
            w = sum(wrong(x) for x in ss + rr + pk + cands)
            ts = statistics.median([t(x) for x in ss]) if ss else None
            tr = statistics.median([t(x) for x in rr]) if rr else None
            tp = statistics.median([t(x) for x in pp]) if pp else None
            vb = statistics.median(bests) if bests else None
            ratio = statistics.median(ratios) if ratios else None
            vs_best = ts / t(best) if best and t(best) and ts else None
            plans = sorted({x["plan"] for x in ss})
            print(f"| {n} | {size // 1024} KiB | {fmt(tr)} | {fmt(tp)} | {', '.join(plans)} | {fmt(ts)} | {fmt(ratio, 3)} | {fmt(vb, 3)} | "
                  f"{best['plan'] if best else '-'} | {fmt(t(best))} | {fmt(vs_best, 3)} | {w} |")
    one = os.path.join(res, "one-rank.json")
    if os.path.exists(one):
        rs = rows(one)
        copy, fc = graph(rs, "copy"), graph(rs, "flashcomm")
        print()
        print("| size | device copy (us) | one rank, out of place (us) | ratio | one rank, in place (us) | #wrong |")
        print("|---:|---:|---:|---:|---:|---:|")
        for size in sorted(fc):
            c, f = copy.get(size), fc[size]
            ip = f.get("in_place") or {}
            print(f"| {size // 1024} KiB | {fmt(t(c))} | {fmt(t(f))} | {fmt(t(f) / t(c) if c and t(c) else None, 3)} | "
                  f"{fmt(ip.get('time_us'))} | {wrong(f) + (ip.get('wrong') or 0)} |")


if __name__ == "__main__":
    main()
