"""Run as a script: capture a CUDA graph while another thread registers host memory (common.host_memory),
in the capture mode argv[1] ("global": torch's default, or "thread_local": common.devices.graph_capture), and
print one JSON line: whether the registration and the capture succeeded and the graph's replay was right.
A child process of tests/common/test_host_memory.py, so a capture that fails leaves the test process clean."""

from __future__ import annotations

import json
import sys
import threading

import torch

from common import host_memory
from common.devices import graph_capture


def main(mode: str) -> dict:
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    capture = graph_capture(graph, stream) if mode == "thread_local" else torch.cuda.graph(
        graph, stream=stream, capture_error_mode="global")
    result: dict = {"mode": mode}
    pinned: list[torch.Tensor] = []

    def register() -> None:  # the prefix store's spill job, in small
        try:
            pinned.append(host_memory.pinned_empty((1 << 20,), torch.float32))
        except Exception as error:
            result["register_error"] = repr(error)

    try:
        with capture:
            torch.mul(x, 2, out=out)
            thread = threading.Thread(target=register)
            thread.start()
            thread.join()
            out.add_(1)
    except Exception as error:
        result["capture_error"] = repr(error)[:300]
    result["registered"] = bool(pinned) and pinned[0].is_pinned()
    if "capture_error" not in result:
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        result["replay_right"] = bool(torch.equal(out, x * 2 + 1))
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
