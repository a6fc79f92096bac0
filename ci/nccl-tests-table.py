#!/usr/bin/env python3
"""Reads the output of NVIDIA's nccl-tests (the `*_perf` programs) run once with the real NCCL and
once with flashcomm preloaded, and writes one JSON file and one markdown file that put them side
by side. Standard library only.

    nccl-tests-table.py <log-dir> --json OUT.json --md OUT.md [--types bfloat16,float|all]

<log-dir> holds one log per run, named <collective>.<launch>.<impl>.log (for example
all_reduce.graph.flashcomm.log; launch is eager or graph, impl nccl or flashcomm), and optionally
<same stem>.rc holding "<exit status> <seconds>". Every row of every type goes to the JSON file;
the markdown file has the status of each run, every row with a wrong element, and time per size
of both side by side for the types of --types (default bfloat16 and float).

A run passes when it exited 0, its footer says "Out of bounds values : 0 OK" and no row has a
wrong element; the last line printed is "nccl-tests: N runs, N passed, N failed".
"""
import argparse
import glob
import json
import os
import re
import sys


def number(tok):
    try:
        return float(tok)
    except ValueError:
        return None


def parse_log(path):
    """One run's rows, footer and first error line."""
    rows, oob, busbw, error, header = [], None, None, None, None
    with open(path, errors="replace") as f:
        for line in f:
            s = line.strip()
            if not s:
                continue
            if s.startswith("#"):
                m = re.match(r"#\s*Out of bounds values\s*:\s*(\d+)\s*(\w+)?", s)
                if m:
                    oob = int(m.group(1))
                m = re.match(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)", s)
                if m:
                    busbw = number(m.group(1))
                if s.startswith("# nccl-tests version") or s.startswith("# nThread"):
                    header = (header + " | " if header else "") + s[2:]
                continue
            tok = s.split()
            if len(tok) >= 9 and tok[0].isdigit() and tok[1].isdigit():
                row = {"size": int(tok[0]), "count": int(tok[1]), "type": tok[2], "redop": tok[3],
                       "root": tok[4]}
                groups = [tok[i:i + 4] for i in range(5, len(tok) - 3, 4)]
                for name, g in zip(["out_of_place", "in_place"], groups):
                    row[name] = {"time_us": number(g[0]), "algbw": number(g[1]),
                                 "busbw": number(g[2]),
                                 "wrong": None if g[3] == "N/A" else int(float(g[3]))}
                rows.append(row)
            elif error is None and re.search(r"failure|error|Error|WARN|Segmentation|Aborted|timeout", s):
                error = s[:300]
    return {"rows": rows, "out_of_bounds": oob, "avg_busbw": busbw, "error": error,
            "header": header}


def wrong_of(row):
    return sum((row.get(k) or {}).get("wrong") or 0 for k in ("out_of_place", "in_place"))


def load(log_dir):
    runs = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log"))):
        parts = os.path.basename(path)[:-4].split(".")
        if len(parts) != 3:
            continue
        coll, launch, impl = parts
        run = {"collective": coll, "launch": launch, "impl": impl, "log": os.path.basename(path)}
        run.update(parse_log(path))
        rc_file = path[:-4] + ".rc"
        rc, secs = None, None
        if os.path.exists(rc_file):
            with open(rc_file) as f:
                t = f.read().split()
            rc = int(t[0]) if t else None
            secs = number(t[1]) if len(t) > 1 else None
        run["rc"], run["seconds"] = rc, secs
        run["wrong"] = sum(wrong_of(r) for r in run["rows"])
        run["passed"] = (rc == 0 and run["out_of_bounds"] == 0 and run["wrong"] == 0
                         and len(run["rows"]) > 0)
        runs.append(run)
    return runs


def fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def size_text(b):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def markdown(runs, types):
    out = []
    by = {(r["collective"], r["launch"], r["impl"]): r for r in runs}
    keys = sorted({(r["collective"], r["launch"]) for r in runs},
                  key=lambda k: (k[0], k[1] != "eager"))
    out.append("| collective | launch | impl | exit | seconds | rows | #wrong | out of bounds | "
               "avg busbw (GB/s) | result |")
    out.append("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for coll, launch in keys:
        for impl in ("nccl", "flashcomm"):
            r = by.get((coll, launch, impl))
            if r is None:
                out.append(f"| {coll} | {launch} | {impl} | | | | | | | not run |")
                continue
            res = "PASS" if r["passed"] else "FAIL" + (f": {r['error']}" if r["error"] else "")
            out.append(f"| {coll} | {launch} | {impl} | {fmt(r['rc'])} | {fmt(r['seconds'], 1)} | "
                       f"{len(r['rows'])} | {r['wrong']} | {fmt(r['out_of_bounds'])} | "
                       f"{fmt(r['avg_busbw'])} | {res.replace('|', '/')} |")
    bad = [(r, row) for r in runs for row in r["rows"] if wrong_of(row)]
    out.append("")
    out.append(f"Rows with a wrong element: {len(bad)}.")
    if bad:
        out.append("")
        out.append("| collective | launch | impl | size | type | redop | #wrong out-of-place | #wrong in-place |")
        out.append("|---|---|---|---:|---|---|---:|---:|")
        for r, row in bad[:200]:
            out.append(f"| {r['collective']} | {r['launch']} | {r['impl']} | {row['size']} | "
                       f"{row['type']} | {row['redop']} | {fmt((row.get('out_of_place') or {}).get('wrong'))} | "
                       f"{fmt((row.get('in_place') or {}).get('wrong'))} |")
    out.append("")
    out.append("Time per call (out-of-place, microseconds) with the real NCCL and with flashcomm "
               "preloaded; ratio = flashcomm / NCCL (below 1: flashcomm faster); #wrong as "
               "out-of-place/in-place.")
    for coll, launch in keys:
        n, f = by.get((coll, launch, "nccl")), by.get((coll, launch, "flashcomm"))
        rows = {}
        for impl, r in (("nccl", n), ("flashcomm", f)):
            for row in (r or {}).get("rows", []):
                if types != ["all"] and row["type"] not in types:
                    continue
                rows.setdefault((row["type"], row["redop"], row["size"]), {})[impl] = row
        if not rows:
            continue
        out.append("")
        out.append(f"### {coll}, {launch}")
        out.append("")
        out.append("| size | type | redop | NCCL us | flashcomm us | ratio | NCCL busbw | "
                   "flashcomm busbw | #wrong NCCL | #wrong flashcomm |")
        out.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for (ty, op, size), d in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            def col(impl, key):
                return ((d.get(impl) or {}).get("out_of_place") or {}).get(key)

            def wr(impl):
                row = d.get(impl)
                if row is None:
                    return "-"
                return "/".join(fmt((row.get(k) or {}).get("wrong")) for k in ("out_of_place", "in_place"))
            tn, tf = col("nccl", "time_us"), col("flashcomm", "time_us")
            ratio = f"{tf / tn:.2f}" if tn and tf else "-"
            out.append(f"| {size_text(size)} | {ty} | {op} | {fmt(tn)} | {fmt(tf)} | {ratio} | "
                       f"{fmt(col('nccl', 'busbw'))} | {fmt(col('flashcomm', 'busbw'))} | "
                       f"{wr('nccl')} | {wr('flashcomm')} |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log_dir")
    p.add_argument("--json", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("--types", default="bfloat16,float",
                   help="types of the side-by-side tables (comma list, or all)")
    a = p.parse_args()
    runs = load(a.log_dir)
    with open(a.json, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    with open(a.md, "w") as f:
        f.write(markdown(runs, [t.strip() for t in a.types.split(",")]))
    passed = sum(r["passed"] for r in runs)
    print(f"nccl-tests: {len(runs)} runs, {passed} passed, {len(runs) - passed} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
