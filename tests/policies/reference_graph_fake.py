"""A stand-in for policies/fast/reference_graph.py's CUDA graph capture, for CPU tests (the real capture needs CUDA:
tests/policies/test_consistent_gpu.py compares its replays with the eager backward)."""

from __future__ import annotations

from policies.fast import reference_graph


class FakeCaptured:
    """What _capture returns, without CUDA: the inputs copied into buffers kept from the capture, the weights read
    where they lived at capture and the incoming gradient zero past the call's rows, as the graph's replay does."""

    def __init__(self, logprob_fn, inp, leaves, grad, addresses):
        self.addresses, self.weights, self.fn = addresses, [w.detach() for w in leaves[1:]], logprob_fn
        self.table_grad = leaves[0].requires_grad
        self.buffers = inp.clone()

    @property
    def rows(self) -> int:
        return self.buffers.rows

    def replay(self, inp, table, grad):
        self.buffers.copy_from(inp)
        padded = grad.new_zeros(self.rows, *grad.shape[1:])
        padded[: inp.rows] = grad
        table = table.detach().requires_grad_(self.table_grad)
        weights = [w.detach().requires_grad_(True) for w in self.weights]
        return reference_graph.eager_grads(self.fn, self.buffers, [table, *weights], padded)
