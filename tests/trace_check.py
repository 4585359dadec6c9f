#!/usr/bin/env python3
"""Checks the timeline of data-parallel training (pdo::trace) with Python's json.

Runs the digits demo on 2 places for one epoch with small gradient buckets and --trace,
then checks the Chrome trace-event JSON it wrote:
  - one row per place and lane (compute and communication on every place);
  - every step of every place has every bucket's collective, with the bytes the trainer's
    plan gives for that bucket;
  - each bucket's collective starts after backward completed every gradient it reads, and was
    queued by backward (a "queues" arrow from the place's compute lane) once the last of them
    was written;
  - dependencies (flow arrows) point from an earlier task's end to a later task's start.
Prints how much of the bucket collectives' time overlaps backward.

usage: trace_check.py DIGITS_PROGRAM [WORK_DIR]
"""
import json
import os
import re
import subprocess
import sys
import tempfile


def fail(message):
    print("trace_check: FAILED: " + message)
    sys.exit(1)


def main():
    program = sys.argv[1]
    work = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
    path = os.path.join(work, "digits_trace.json")
    run = subprocess.run([program, "--places", "2", "--epochs", "1", "--bucket-bytes", "4000", "--target", "0", "--trace", path],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        fail("the demo failed:\n" + run.stdout + run.stderr)
    plan_bytes = {int(b): int(n) for b, n in re.findall(r"bucket (\d+): (\d+) B", run.stdout)}
    if len(plan_bytes) < 2:
        fail("expected several buckets in the plan:\n" + run.stdout)

    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    places = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    rows = {(places[pid], lane) for (pid, _), lane in lanes.items()}
    if len(rows) != len(lanes):
        fail("two rows for one place and lane: %s" % sorted(lanes.values()))
    for place in ("cpu:0", "cpu:1"):
        for lane in ("compute", "communication"):
            if (place, lane) not in rows:
                fail("no row for the %s lane of %s; rows: %s" % (lane, place, sorted(rows)))

    spans = [e for e in events if e.get("ph") == "X"]
    for e in spans:
        if places[e["pid"]] != e["args"]["place"] or lanes[(e["pid"], e["tid"])] != e["args"]["lane"]:
            fail("event on the wrong row: %s" % e)
    steps = [e for e in spans if e["name"] == "data_parallel::step"]
    buckets = [e for e in spans if e["cat"] == "collective" and e["name"] == "bucket all_reduce"]
    gradients = [e for e in events if e.get("ph") == "i" and e["cat"] == "gradient"]
    backward = [e for e in spans if e["name"] == "backward"]
    flows = [e for e in events if e.get("cat") == "dependency" and e["name"] == "queues"]
    queue_flows = {e["id"] for e in flows if e["ph"] == "s"} & {e["id"] for e in flows if e["ph"] == "f"}
    if not steps or not buckets or not gradients:
        fail("steps %d, bucket collectives %d, gradients %d" % (len(steps), len(buckets), len(gradients)))

    overlapped = total = 0.0
    for step in steps:
        place = places[step["pid"]]
        begin, end = step["ts"], step["ts"] + step["dur"]
        inside = [b for b in buckets if places[b["pid"]] == place and begin <= b["ts"] <= end]
        seen = {}
        for b in inside:
            m = re.match(r"bucket (\d+): (\d+) bytes .*\((\d+) parameters\)", b["args"]["detail"])
            if not m:
                fail("a bucket collective without its bytes: %s" % b)
            k, nbytes, nparams = (int(x) for x in m.groups())
            if plan_bytes.get(k) != nbytes:
                fail("bucket %d moves %d bytes, the plan says %s" % (k, nbytes, plan_bytes.get(k)))
            seen[k] = seen.get(k, 0) + 1
            ready = [g for g in gradients if places[g["pid"]] == place and g["args"].get("detail") == "bucket %d" % k
                     and begin <= g["ts"] <= b["ts"]]
            if len(ready) != nparams:
                fail("on %s the collective of bucket %d (at %.1f us) starts before backward wrote its %d gradients "
                     "(%d written before it)" % (place, k, b["ts"], nparams, len(ready)))
            queued = b["args"].get("queued_at")
            if b["args"].get("queued_on") != "compute" or queued is None or ("q%d" % b["args"]["task"]) not in queue_flows:
                fail("on %s the collective of bucket %d has no arrow from the backward that queued it: %s" % (place, k, b))
            last = max(g["ts"] for g in ready)
            if not (last <= queued + 1.0 and queued <= b["ts"] + 1.0):
                fail("on %s bucket %d was queued at %.1f us: its last gradient was written at %.1f us, its collective "
                     "started at %.1f us" % (place, k, queued, last, b["ts"]))
            for bw in backward:
                if places[bw["pid"]] == place and begin <= bw["ts"] <= end:
                    lo, hi = max(b["ts"], bw["ts"]), min(b["ts"] + b["dur"], bw["ts"] + bw["dur"])
                    overlapped += max(0.0, hi - lo)
            total += b["dur"]
        if seen != {k: 1 for k in plan_bytes}:
            fail("on %s a step ran the bucket collectives %s; the plan has buckets %s" % (place, seen, sorted(plan_bytes)))

    tasks = {e["args"]["task"]: e for e in spans if "task" in e["args"]}
    for e in tasks.values():
        if len(set(e["args"]["after"])) != len(e["args"]["after"]):
            fail("task %d lists a task it waits for twice: %s" % (e["args"]["task"], e["args"]["after"]))
        for before in e["args"]["after"]:
            if before in tasks and tasks[before]["ts"] + tasks[before]["dur"] > e["ts"] + 1.0:
                fail("task %d started before task %d, which it waits for, ended" % (e["args"]["task"], before))

    print("trace_check: %d steps on %d places, %d bucket collectives, %d gradients; %.0f%% of the collectives' time "
          "overlaps backward" % (len(steps) // 2, len([p for p in places.values() if p != "host"]), len(buckets), len(gradients),
                                 100.0 * overlapped / total if total else 0.0))


if __name__ == "__main__":
    main()
