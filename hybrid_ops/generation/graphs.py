"""`CudaGraphStep`: a packaged step (`packaged.PackagedStep`) replayed from a CUDA graph per step shape.

A `StepRunner` with `cuda_graphs` pads every step to buckets of requests and tokens (`hybrid_ops.buckets`), so a
handful of shapes recur: each (forward mode, input sizes) is captured once, on its first step, into a graph whose
inputs are static buffers, and replayed after copying the step's inputs into them. The mode is part of the key: the
ops route on the host, so a graph holds one mode's kernels. Planning stays outside the graphs: before each capture
and replay, the backend the step's layers route to plans the static metadata (`buckets.plan_for_graph`).
"""

import torch

from ..buckets import plan_for_graph
from ..metadata import ForwardBatch
from ..modes import ForwardMode, select_path


class CudaGraphStep:
    """`step` (a step function of `runner.py`'s signature over `cache`) through CUDA graphs, one per step shape.

    backends: the (prefill, decode) backends the package's ops name; q_dtype: the model's dtype (the queries');
    states: a hybrid model's `StatePool`, or None (the step then takes no state_slots)."""

    def __init__(self, step, cache, backends, q_dtype, states=None):
        self.step, self.cache, self.backends, self.q_dtype = step, cache, tuple(backends), q_dtype
        self.states = states
        self.graphs = {}  # (forward_mode, input sizes) -> (static inputs, static logits, torch.cuda.CUDAGraph)
        self.pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: they share one memory pool

    def __call__(self, input_ids, position_ids, logits_index, forward_mode, cu_seqlens_q, seq_lens, block_table,
                 state_slots=None):  # fmt: skip
        inputs = (input_ids, position_ids, logits_index, cu_seqlens_q, seq_lens, block_table)
        inputs += () if state_slots is None else (state_slots,)
        key = (int(forward_mode), *(tuple(t.shape) for t in inputs))
        if key not in self.graphs:
            self.graphs[key] = self._capture(int(forward_mode), inputs)
        static, logits, graph = self.graphs[key]
        for buffer, tensor in zip(static, inputs):
            buffer.copy_(tensor)
        self._plan(forward_mode, static)
        graph.replay()
        return logits.clone()  # the next replay of this shape overwrites its static logits

    def _run(self, forward_mode, static):
        input_ids, position_ids, logits_index, *metadata = static
        return self.step(input_ids, position_ids, logits_index, forward_mode, *metadata)

    def _plan(self, forward_mode, static):
        batch = ForwardBatch(ForwardMode(forward_mode), *static[3:6])
        path = select_path(batch.forward_mode)  # as hybrid::attn routes it (a package's speculative mode: "prefill")
        plan_for_graph(self.backends[path == "decode"], path, *self.cache.layer(0), batch, self.q_dtype)

    def _capture(self, forward_mode, inputs):
        """One eager run of the step on a side stream (first launches and lazy initialisation stay out of the
        graph; it writes the step's own K/V, which the replay writes again, and advances its states, which are put
        back: a state is not written the same twice), then the capture."""
        static = [t.clone() for t in inputs]
        self._plan(forward_mode, static)
        kept = [] if self.states is None else [t.clone() for t in self.states.all_states]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(forward_mode, static)
            for state, before in zip(self.states.all_states if kept else (), kept):
                state.copy_(before)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run(forward_mode, static)
        return static, logits, graph
