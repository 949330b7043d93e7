"""Peak RSS above the logits of the logged entropy (``entropy_from_logits`` without a gradient) of one training
micro-batch of the #31 GPU workload, ``[32, 256, 32000]`` bf16 logits, in one pass (``LOGPROB_CHUNK_ELEMENTS`` =
2**40, the behaviour before chunking) or in 64 MiB chunks (2**24, the default). A fresh process per figure::

    for c in 1099511627776 16777216 1099511627776 16777216; do
        python docs/measurements/entropy_memory_cpu.py $c >> docs/measurements/train-memory-cpu-2026-11-27.jsonl; done
"""
import json
import resource
import sys

import torch

from rlhf_core.algos import losses


def main() -> None:
    losses.LOGPROB_CHUNK_ELEMENTS = int(sys.argv[1])
    logits = torch.randn(32, 256, 32000, dtype=torch.bfloat16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    with torch.no_grad():
        losses.entropy_from_logits(logits)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - before
    print(json.dumps({"cmd": " ".join(sys.argv), "what": "entropy", "logits": [32, 256, 32000],
                      "chunk_elements": losses.LOGPROB_CHUNK_ELEMENTS, "peak_above_logits_gib": round(peak, 2)}))


if __name__ == "__main__":
    main()
