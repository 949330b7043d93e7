"""benchmarks.gpu_memory.live_by_origin: a snapshot's active blocks summed by the line that allocated them."""

from benchmarks.gpu_memory import GIB, live_by_origin


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_live_blocks_are_summed_by_the_innermost_frame_outside_torch():
    mlp = frame("/site/transformers/models/llama/modeling_llama.py", 80, "forward")
    linear = frame("/site/torch/nn/modules/linear.py", 125, "forward")
    ours = frame("/repo/rlhf_core/passes/generation.py", 40, "response_logprobs")
    snapshot = {"segments": [
        {"blocks": [{"state": "active_allocated", "size": 3 * GIB, "frames": [linear, mlp, ours]},
                    {"state": "active_allocated", "size": GIB, "frames": [mlp, ours]},
                    {"state": "inactive", "size": 7 * GIB, "frames": [ours]}]},
        {"blocks": [{"state": "active_allocated", "size": GIB // 2, "frames": [ours]},
                    {"state": "active_allocated", "size": GIB // 4, "frames": []},
                    {"state": "active_allocated", "size": GIB // 4, "frames": [linear]}]},
    ]}
    live = live_by_origin(snapshot)
    assert live["total_gib"] == 5.0
    assert live["origins"] == [["modeling_llama.py:80 forward", 4.0], ["generation.py:40 response_logprobs", 0.5],
                               ["(before recording)", 0.25], ["(torch internals)", 0.25]]
    assert live_by_origin(snapshot, top=1)["origins"] == [["modeling_llama.py:80 forward", 4.0]]
