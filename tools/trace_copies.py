"""Which operators launch the copy and dtype-cast kernels of a Chrome trace that
`qtrain bench --profile STEPS --trace FILE` wrote: each such kernel grouped by its launching
operator, the operators around it and their input shapes and dtypes, largest GPU time first.

    python3 tools/trace_copies.py FILE [STEPS]

Standard library only. STEPS (default 1) divides the times into per-step figures.
"""
import collections, json, sys

trace = json.load(open(sys.argv[1]))
events = trace["traceEvents"]
ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
parent = {}
by_thread = collections.defaultdict(list)
for e in ops:
    by_thread[e["tid"]].append(e)
for thread_ops in by_thread.values():
    thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []
    for e in thread_ops:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"] + e["dur"]:
            stack.pop()
        parent[id(e)] = stack[-1] if stack else None
        stack.append(e)
by_external = {}
for e in ops:
    ext = e.get("args", {}).get("External id")
    if ext is not None:
        by_external.setdefault(ext, e)
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
kernels = [e for e in events if e.get("cat") == "kernel"]
total = sum(k["dur"] for k in kernels)
groups = collections.defaultdict(lambda: [0.0, 0])
for k in kernels:
    name = k["name"]
    if "copy" not in name.lower() and "cast" not in name.lower():
        continue
    op = by_external.get(k.get("args", {}).get("External id"))
    chain, dims = [], ""
    if op is not None:
        dims = f'{op["args"].get("Input Dims", "")} {op["args"].get("Input type", "")}'
        walker = op
        while walker is not None and len(chain) < 5:
            chain.append(walker["name"])
            walker = parent.get(id(walker))
    key = (" < ".join(chain), dims[:160])
    groups[key][0] += k["dur"]
    groups[key][1] += 1
copy_total = sum(v[0] for v in groups.values())
print(f"kernels {total/1000/steps:.1f} ms/step, copy/cast kernels {copy_total/1000/steps:.1f} ms/step")
for (chain, dims), (dur, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:18]:
    print(f"{dur/1000/steps:7.2f} ms {count//steps:5d}x  {chain}\n                   {dims}")
