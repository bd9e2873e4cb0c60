"""Static-shape steps of the decode loop under CUDA graphs: per step (StepGraph: decode, verify, draft,
catch-up) or a whole speculative round at once (RoundGraph).

A StepGraph wraps one step function of tensors. Its first call allocates static copies of the inputs; on CUDA
it warms the function up on a side stream and captures it into a CUDA graph (every StepGraph of a run shares
one memory pool), and every call copies the new inputs into the static ones and replays. Whatever the step
reads besides its inputs (weights, the paged caches, prefix_lens, preallocated buffers) is read through the
same addresses at each replay, so it must be updated in place between calls, as the loop does.

The outputs are the same tensors at every call: read or copy them before the next one. On the CPU there is
no graph: the function runs at each call and its outputs are copied into static tensors all the same, so the
CPU tests see the aliasing a graph has.

The first call's warm-up and capture (the device drained around them) is kept in setup_seconds, apart from
the replay that follows: an engine captures its graphs once at start-up, so the decode loop reports that time
apart (DecodeStats.setup_seconds) rather than inside its steps.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch import Tensor


def _warm_up(fn: Callable, args, times: int, state: list) -> None:
    """fn(*args) `times` times, the tensors in ``state`` saved before and restored after (so the warm-up calls
    leave what the run carries where it was)."""
    saved = [s.clone() for s in state]
    for _ in range(times):
        fn(*args)
    for s, v in zip(state, saved):
        s.copy_(v)


class StepGraph:
    """fn(*inputs) -> Tensor | tuple of Tensor, replayed from a CUDA graph on CUDA (see the module docstring).

    Parameters
    ----------
    fn : callable
        The step, of tensors only; everything else it uses is closed over.
    pool : optional
        A CUDA graph memory pool handle shared with the other steps (torch.cuda.graph_pool_handle()).
    warmup : int
        Eager calls on a side stream before the capture (compilations, allocator).
    state : list of Tensor, optional
        Tensors fn updates in place (a drafter's call count): saved before the warm-up calls, restored after.
    """

    def __init__(self, fn: Callable, pool=None, warmup: int = 2, state: Optional[list] = None):
        self.fn, self.pool, self.warmup = fn, pool, warmup
        self.state = state or []  # tensors fn updates in place that its warm-up calls must leave as found
        self.static_in: Optional[list[Tensor]] = None
        self.static_out = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.replays = 0
        self.setup_seconds = 0.0  # the first call's warm-up and capture (0 on the CPU)

    def _copy_in(self, inputs) -> None:
        for dst, src in zip(self.static_in, inputs):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"StepGraph: an input changed shape or dtype ({tuple(dst.shape)} {dst.dtype} -> "
                                 f"{tuple(src.shape)} {src.dtype}); a graph replays one shape")
            if dst is not src:
                dst.copy_(src)

    def __call__(self, *inputs: Tensor):
        if self.static_in is None:
            self.static_in = [x.clone() for x in inputs]
            if inputs[0].is_cuda:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                self._capture()
                torch.cuda.synchronize()
                self.setup_seconds = time.perf_counter() - t0
        else:
            self._copy_in(inputs)
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            return self.static_out
        out = self.fn(*self.static_in)
        outs = out if isinstance(out, tuple) else (out,)
        if self.static_out is None:
            self.static_out = tuple(o.clone() for o in outs)
        else:
            for dst, src in zip(self.static_out, outs):
                dst.copy_(src)
        return self.static_out if isinstance(out, tuple) else self.static_out[0]

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _warm_up(self.fn, self.static_in, self.warmup, self.state)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.static_out = self.fn(*self.static_in)


class RoundGraph:
    """A whole decode round in one CUDA graph: fn() reads and updates ``state`` (tensors) in place, and may
    write scratch memory that the next real round overwrites before it reads it (the caches' rows past
    prefix_lens). Every call is one round.

    prepare() (the first call makes it) warms fn up on a side stream with ``state`` saved before and restored
    after (so the warm-up rounds leave the decode where it was), then captures it; that time is
    setup_seconds. On the CPU, or with capture=False (an eager round that still wants the same seam: the
    adaptive loop's eager mode), prepare runs the same warm-up and restore, then every call runs fn eagerly,
    so the CPU tests check that the warm-up leaves no trace. prepares counts prepare()'s calls (1 at most: a
    graph is captured once, whatever the rounds around it replay).
    """

    def __init__(self, fn: Callable[[], None], state: list, pool=None, warmup: int = 2,
                 on_warmup: Optional[Callable[[bool], None]] = None, capture: bool = True):
        self.fn, self.state, self.pool, self.warmup, self.capture = fn, state, pool, warmup, capture
        self.on_warmup = on_warmup  # called with True before the warm-up rounds, False after (e.g. timers off)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.ready = False
        self.setup_seconds = 0.0
        self.replays = 0
        self.prepares = 0

    def _warm(self) -> None:
        if self.on_warmup:
            self.on_warmup(True)
        try:
            _warm_up(self.fn, (), self.warmup, self.state)
        finally:
            if self.on_warmup:
                self.on_warmup(False)

    def prepare(self) -> None:
        """Warm up and (on CUDA) capture, once; runs no round."""
        if self.ready:
            return
        self.prepares += 1
        if self.state[0].is_cuda and self.capture:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._warm()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.fn()
            torch.cuda.synchronize()
            self.setup_seconds = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            self._warm()
            self.setup_seconds = time.perf_counter() - t0
        self.ready = True

    def __call__(self) -> None:
        self.prepare()
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
        else:
            self.fn()

    def measure(self, reps: int = 5) -> float:
        """Median seconds of one round (a replay, or the eager round), timed `reps` times after prepare(), with
        ``state`` saved before and restored after (the decode is left where it was); the device is drained
        around each round. Not counted in replays."""
        self.prepare()
        cuda = self.state[0].is_cuda
        saved = [s.clone() for s in self.state]
        times = []
        if self.on_warmup:
            self.on_warmup(True)
        try:
            for _ in range(reps):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                self.graph.replay() if self.graph is not None else self.fn()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        finally:
            for s, v in zip(self.state, saved):
                s.copy_(v)
            if self.on_warmup:
                self.on_warmup(False)
        return sorted(times)[len(times) // 2]


def new_pool(device) -> Optional[object]:
    """A graph memory pool for one run's steps (None on the CPU)."""
    return torch.cuda.graph_pool_handle() if torch.device(device).type == "cuda" else None


__all__ = ["RoundGraph", "StepGraph", "new_pool"]
