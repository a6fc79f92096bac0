#!/usr/bin/env python3
"""The host-transport tables of flashcomm-perf's JSON files (docs/perf.md's come from ci/perf-doc.py).

    ci/perf-host-table.py [--launch graph|eager] [--plans] FILE.json ...
    ci/perf-host-table.py --ab [--launch graph|eager] A.json B.json [--labels A,B]

The first form prints, for each file and launch mode, one markdown table: per size the time of
the link busy both ways (the `link-both` row, present with `--transport host`), the lossless
time, its share of the link's floor, and every quantized row's time with lossless time over it
in brackets (with `--plans`, then the plan of every row); in runs with the reference kernels
(`--impl reference,pull-reference`), also the plain reference's time, pull-best's (the faster of
the pull reference's two kernels) and the lossless row's vs_best (its time over the fastest
competitor of the run). The floor is the time the link needs for the bytes the
lossless plan moves each way at the link-both rate measured in the same run: N virtual ranks
share the GPU's one link, so a two-shot AllReduce of S bytes moves 2(N - 1) S each way, a
one-shot one N(N - 1) S, an AllGather or ReduceScatter (S = the whole buffer) (N - 1) S. A
quantized row that ran the lossless kernels (`--quant-choice auto`, plan `lossless:<plan>`) is
marked `L`.

The second form joins two runs row by row (the same implementation or width, launch and size):
the time of each, B over A, and both plans where they differ; for A/B experiments run with one
bundle (an environment switch flipped between the two runs).

Both forms end with the rows whose #wrong (values outside their bound, or bytes differing from
rank 0) is not 0, or say that every row's is 0. Python 3 standard library only.
"""
import argparse
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def size_label(b):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def time_of(row):
    out = row.get("out_of_place")
    return out["time_us"] if out else None


def wrong_of(row):
    out = row.get("out_of_place") or {}
    return (out.get("wrong") or 0) + (out.get("rank_mismatch_bytes") or 0)


def floor_factor(collective, nranks, plan):
    n = nranks
    if collective != "allreduce":
        return n - 1
    if plan and plan.split(":")[-1].startswith("oneshot"):
        return n * (n - 1)
    return 2 * (n - 1)


def fmt_us(t):
    return "-" if t is None else f"{t:.1f}"


def host_tables(doc, launches, plans):
    rows = doc["rows"]
    s = doc["settings"]
    out = []
    for launch in launches:
        mine = [r for r in rows if r["launch"] == launch]
        if not mine:
            continue
        sizes = sorted({r["size_bytes"] for r in mine})
        quant = []
        for r in mine:
            if r["impl"].startswith("flashcomm-q") and r["impl"] not in quant:
                quant.append(r["impl"])
        by = {(r["impl"], r["size_bytes"]): r for r in mine}
        nranks = s["ranks"]
        coll = s["collective"]
        impls = {r["impl"] for r in mine}
        refs = [c for c in ("reference", "pull-best") if c in impls]
        head = ["size", "link-both (us)", "lossless (us)", "of floor"]
        head += [f"{c} (us)" for c in refs] + (["vs best"] if refs else [])
        head += [f"{q[len('flashcomm-q'):]}-bit (us, x)" for q in quant]
        if plans:
            head += ["plans (lossless" + "".join(f", {q[len('flashcomm-q'):]}-bit" for q in quant) + ")"]
        out.append(
            f"{coll}, {nranks} ranks, {launch} (commit {str(s.get('commit'))[:7]}, "
            f"transport {s.get('transport')}):"
        )
        out.append("")
        out.append("| " + " | ".join(head) + " |")
        width = 4 + len(refs) + (1 if refs else 0) + len(quant)
        out.append("|" + "|".join(["---:"] * width + ["---"] * plans) + "|")
        for b in sizes:
            link = by.get(("link-both", b))
            loss = by.get(("flashcomm", b))
            tl = time_of(loss) if loss else None
            tb = time_of(link) if link else None
            share = "-"
            if tl and tb:
                share = f"{100.0 * tb * floor_factor(coll, nranks, loss['plan']) / tl:.0f}%"
            cells = [size_label(b), fmt_us(tb), fmt_us(tl), share]
            for c in refs:
                cells.append(fmt_us(time_of(by[(c, b)]) if (c, b) in by else None))
            if refs:
                vb = (loss or {}).get("vs_best")
                cells.append("-" if vb is None else f"{vb:.2f}")
            for q in quant:
                r = by.get((q, b))
                t = time_of(r) if r else None
                if t is None:
                    cells.append("-")
                    continue
                ratio = f" ({tl / t:.2f})" if tl else ""
                mark = " L" if (r.get("plan") or "").startswith("lossless:") else ""
                cells.append(f"{t:.1f}{ratio}{mark}")
            if plans:
                names = [(loss or {}).get("plan")] + [(by.get((q, b)) or {}).get("plan") for q in quant]
                cells.append(", ".join(n or "-" for n in names))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def ab_table(a, b, labels, launches):
    key = lambda r: (r["impl"], r["launch"], r["size_bytes"])
    rb = {key(r): r for r in b["rows"]}
    out = [
        f"A = {labels[0]} (commit {str(a['settings'].get('commit'))[:7]}), "
        f"B = {labels[1]} (commit {str(b['settings'].get('commit'))[:7]})",
        "",
        "| impl | launch | size | A (us) | B (us) | B / A | plans |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in a["rows"]:
        if r["launch"] not in launches:
            continue
        o = rb.get(key(r))
        ta, tb = time_of(r), time_of(o) if o else None
        if ta is None or tb is None:
            continue
        pa, pb = r.get("plan"), (o or {}).get("plan")
        plans = (pa or "-") if pa == pb else f"{pa} / {pb}"
        out.append(
            f"| {r['impl']} | {r['launch']} | {size_label(r['size_bytes'])} | {ta:.1f} | "
            f"{tb:.1f} | {tb / ta:.2f} | {plans} |"
        )
    return out


def wrong_lines(docs):
    bad = []
    for name, doc in docs:
        for r in doc["rows"]:
            # pull-best repeats a measured row: its #wrong is counted there.
            if r["impl"].startswith("pull-best"):
                continue
            w = wrong_of(r)
            if w:
                bad.append(f"{name}: {r['impl']} {r['launch']} {size_label(r['size_bytes'])}: #wrong {w}")
    return bad or ["every row #wrong 0"]


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--launch", choices=["graph", "eager"], help="one launch mode (default: both)")
    p.add_argument("--ab", action="store_true", help="join two runs row by row")
    p.add_argument("--plans", action="store_true", help="a column with every row's plan")
    p.add_argument("--labels", default="A,B", help="names of the two runs of --ab")
    args = p.parse_args(argv)
    launches = [args.launch] if args.launch else ["graph", "eager"]
    docs = [(f, load(f)) for f in args.files]
    if args.ab:
        if len(docs) != 2:
            p.error("--ab takes two files")
        labels = args.labels.split(",")
        if len(labels) != 2:
            p.error("--labels takes two names")
        lines = ab_table(docs[0][1], docs[1][1], labels, launches)
    else:
        lines = []
        for _, doc in docs:
            lines += host_tables(doc, launches, args.plans)
    print("\n".join(lines + [""] + wrong_lines(docs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
