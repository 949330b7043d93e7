"""``python -m benchmarks.prepare_scale``: the prepare stage on a large generated source; peak RSS and time.

Writes ``--rows`` distinct rows (a third demonstrations, a third preference pairs, a third bare prompts) as
JSONL to ``--source`` (a local path or any fsspec URL: ``s3://bucket/rows.jsonl`` against the endpoint in
``AWS_ENDPOINT_URL``), then runs ``rlhf stage prepare`` on it (``data.source: mixed``, the demo tokenizer)
in a fresh workspace under ``--workdir`` as a child process, and prints one JSON line: rows, source bytes,
wall seconds, the child's peak RSS (``ru_maxrss``) and the prepared counts. ``--pythonpath`` runs another
checkout's code (a before/after comparison on the same file).

    AWS_ENDPOINT_URL=http://127.0.0.1:5057 python -m benchmarks.prepare_scale --rows 1000000 \\
        --source s3://rlhf-bench/rows.jsonl --workdir /tmp/prep-bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml


def generate(n: int):
    """Distinct rows in three formats (JSONL lines)."""
    for i in range(n):
        a, b = i % 1009, i // 1009
        row = [{"prompt": f"Human: what is {a} plus {b}? Assistant:", "response": f" {a + b}"},
               {"prompt": f"Human: add {a} and {b}. Assistant:", "chosen": f" {a + b}", "rejected": f" {a + b + 1}"},
               {"prompt": f"Human: sum {a} and {b}? Assistant:"}][i % 3]
        yield json.dumps(row) + "\n"


def write_source(url: str, n: int) -> int:
    import fsspec

    with fsspec.open(url, "w") as fh:
        for line in generate(n):
            fh.write(line)
    fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    return fs.size(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--source", required=True, help="where the generated JSONL goes (path or fsspec URL)")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--reuse", action="store_true", help="the source exists already: do not write it")
    ap.add_argument("--pythonpath", default=None, help="run prepare from this checkout's code")
    args = ap.parse_args(argv)

    size = None if args.reuse else write_source(args.source, args.rows)
    args.workdir.mkdir(parents=True, exist_ok=True)
    params = {"data": {"source": "mixed", "sources": [{"path": args.source}], "max_prompt_len": 32,
                       "max_response_len": 8}}
    (args.workdir / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "RLHF_TRACKING": "off"}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stage", "prepare"], cwd=args.workdir, env=env,
                          capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return proc.returncode
    manifest = json.loads((args.workdir / "data/prepared/manifest.json").read_text())
    print(json.dumps({"rows": args.rows, "source": args.source, "source_bytes": size, "seconds": round(seconds, 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
                      "counts": manifest["counts"], "dropped_total": manifest["dropped_total"],
                      "code": args.pythonpath or "this checkout"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
