"""Per process of a profiled `rlhf run`: CPU seconds sampled, the share spent importing modules, and the top
imported packages. Input: py-spy's raw (collapsed) output of the whole run, subprocesses included:

    py-spy record -s -r 50 -f raw -o run.raw -- python -c "import sys; sys.argv=['rlhf','run']; \
        from flows.cli import main; main()"
    python docs/measurements/pyspy_import_share.py run.raw > rows.jsonl

py-spy samples only threads running Python; a process's figure is its CPU time at 50 Hz, not its wall time.
"""

import collections
import json
import re
import sys
from pathlib import Path

RATE = 50
per_proc, imports, top = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
for m in re.finditer(r"(.*?) (\d+)\n", Path(sys.argv[1]).read_text(), re.S):
    stack, n = m.group(1), int(m.group(2))
    frames = stack.split(";")
    procs = [f for f in frames if f.startswith("process ")]
    proc = re.sub(r"\s+", " ", procs[-1].split(":", 1)[1])[:90] if procs else "?"
    per_proc[proc] += n
    if "_find_and_load" in stack:
        imports[proc] += n
        mods = [f[10:-1].rsplit(":", 1)[0] for f in frames if f.startswith("<module> (")
                and "<string>" not in f and "/bin/rlhf" not in f]
        mods = [x for x in mods if x != "rlhf"]  # the console script itself
        top[proc][mods[0].split("/")[0] if mods else "?"] += n
for proc, n in per_proc.most_common():
    print(json.dumps({"process": proc, "cpu_s": round(n / RATE, 1), "import_s": round(imports[proc] / RATE, 1),
                      "top_imports_s": {k: round(v / RATE, 1) for k, v in top[proc].most_common(5)}}))
