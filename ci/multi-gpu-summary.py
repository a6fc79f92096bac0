#!/usr/bin/env python3
"""Writes summary.json and summary.md of a ci/multi-gpu-check.sh run from its work folder
(records.tsv: step, test, status, seconds, limit, note; environment.txt; limits; the step logs
and JSON files). Standard library only; ci/multi-gpu-check.sh runs it after every test.

    multi-gpu-summary.py <work-dir> <results-dir>
"""
import json
import os
import re
import sys

STEPS = ["set-up", "GPU test suite", "nccl-tests, NCCL and flashcomm side by side",
         "flashcomm-perf against NCCL and the reference kernels", "PyTorch through the launcher"]


def read(path, default=""):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def log_name(test):
    return re.sub(r"[^A-Za-z0-9._-]", "_", test) + ".log"


def main(work, res):
    records = []
    for line in read(os.path.join(work, "records.tsv")).splitlines():
        f = line.split("\t")
        if len(f) >= 5:
            records.append({"step": int(f[0]), "test": f[1], "status": f[2],
                            "seconds": float(f[3] or 0), "limit": int(f[4] or 0),
                            "note": f[5] if len(f) > 5 else ""})
    limits = [int(x) for x in read(os.path.join(work, "limits")).split()]
    env = read(os.path.join(work, "environment.txt")).strip()
    count = {s: sum(r["status"] == s for r in records if r["step"] > 0)
             for s in ("pass", "fail", "not-run", "skipped")}
    steps = []
    for s, name in enumerate(STEPS):
        rs = [r for r in records if r["step"] == s]
        steps.append({"step": s, "name": name, "limit": limits[s] if s < len(limits) else None,
                      "seconds": round(sum(r["seconds"] for r in rs), 1),
                      **{k: sum(r["status"] == k for r in rs) for k in count}})
    doc = {"environment": env, "steps": steps, "tests": records, "counts": count}
    tp = os.path.join(work, "tp-forward.json")
    if os.path.exists(tp):
        try:
            doc["tp_forward"] = json.loads(read(tp))
        except ValueError:
            pass
    with open(os.path.join(res, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)

    md = ["# flashcomm on several GPUs: ci/multi-gpu-check.sh", "", "```", env, "```", "",
          f"{count['pass']} passed, {count['fail']} failed, {count['not-run']} not run (time "
          f"limit), {count['skipped']} not run (missing from the bundle or this machine).", "",
          "| step | what | limit (s) | used (s) | passed | failed | not run |",
          "|---:|---|---:|---:|---:|---:|---:|"]
    for st in steps:
        md.append(f"| {st['step']} | {st['name']} | {st['limit']} | {st['seconds']} | {st['pass']} | "
                  f"{st['fail']} | {st['not-run'] + st['skipped']} |")
    md += ["", "| step | test | result | seconds | limit | note |", "|---:|---|---|---:|---:|---|"]
    for r in records:
        md.append(f"| {r['step']} | {r['test']} | {r['status']} | {r['seconds']} | {r['limit']} | "
                  f"{r['note'].replace('|', '/')} |")
    nt = read(os.path.join(work, "nccl-tests.md"))
    if nt:
        md += ["", "## Step 2: nccl-tests", "", nt]
    perf = [r for r in records if r["step"] == 3 and r["status"] in ("pass", "fail")]
    if perf:
        md += ["", "## Step 3: flashcomm-perf", ""]
        for r in perf:
            text = read(os.path.join(work, "logs", log_name(r["test"])))
            lines = [ln for ln in text.splitlines() if ln.strip()][:400]
            md += [f"### {r['test']} ({r['status']})", "", "```"] + lines + ["```", ""]
    torch = [r for r in records if r["step"] == 4 and r["status"] in ("pass", "fail")]
    if torch:
        md += ["", "## Step 4: PyTorch", ""]
        for r in torch:
            text = read(os.path.join(work, "logs", log_name(r["test"])))
            keep = [ln for ln in text.splitlines()
                    if re.match(r"\s*(\[rank \d+\] )?(PASS|FAIL|perplexity|world size|note|FLASHCOMM INFO)", ln)]
            if r["status"] == "fail":
                keep = keep[:200] + ["...", "(the log's last lines)"] + text.splitlines()[-15:]
            md += [f"### {r['test']} ({r['status']})", "", "```"] + keep[:230] + ["```", ""]
    with open(os.path.join(res, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
