"""add_rmsnorm_capture at Kimi width (H = 7168, bf16), in one run:

- "add_rmsnorm": the plain fused add + RMSNorm (capture off) vs PyTorch's `residual += x; x = rms_norm`
  vs torch.compile of the same. Bytes: x and residual read and written, the weight read.
- "add_rmsnorm_capture": the same with the capture of every row into an aux slot (25% more bytes) vs the
  PyTorch way (`aux[:, slot] = residual` after the add) and its torch.compile.
- "copy(same bytes)" in both: a plain `dst.copy_(src)` moving the op's bytes, the weight aside (capture off:
  2 x T x H bf16 copied, 4 x T x H x 2 bytes of traffic), so the table shows what a copy of this size
  reaches in the same run.
- "capture_3_layers": what capturing three layers costs on top of the norms. torch: SGLang/vLLM's path,
  `h + r` per captured layer then `torch.cat` into [T, 3H]; eagle3: three times (capture on - capture
  off) from the rows above (the extra cost of the fused capture, 0 where on measured no slower than off),
  shown as its share of the torch path (the "vs torch" column of that row).

Device time: CUDA-graph replays of back-to-back calls over input sets rotated past L2 (median per call).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import graph_time_us, rotation

import eagle3_ops  # noqa: F401

H, N_AUX, SLOT, EPS = 7168, 3, 1, 1e-6
TS = [1, 64, 512, 4096]
_times: dict = {}


def _plain(x, r, w, aux):
    r.add_(x)
    if aux is not None:
        aux[:, SLOT * H:(SLOT + 1) * H] = r
    x.copy_(F.rms_norm(r, (H,), w, EPS))


_compiled = torch.compile(_plain, dynamic=False)
COPY = "copy(same bytes)"
PROVIDERS = {
    "eagle3": lambda x, r, w, aux: torch.ops.eagle3.add_rmsnorm_capture(x, r, w, EPS, aux, SLOT, None),
    "torch": _plain,
    "torch.compile": _compiled,
    COPY: lambda dst, src: dst.copy_(src),
}


def input_sets(T, capture):
    nbytes = 4 * T * H * 2 + (T * H * 2 if capture else 0)
    sets = []
    for _ in range(rotation(nbytes)):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        aux = torch.empty(T, N_AUX * H, device="cuda", dtype=torch.bfloat16) if capture else None
        sets.append((x, r, w, aux))
    return sets, nbytes + H * 2


def copy_sets(T, capture):
    """(dst, src) pairs whose copy reads and writes the op's bytes (the weight aside)."""
    nbytes = 4 * T * H * 2 + (T * H * 2 if capture else 0)
    n = nbytes // 4  # bf16 elements copied: half the traffic is read, half written
    sets = [(torch.empty(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16))
            for _ in range(rotation(nbytes))]
    return sets, nbytes


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("capture", [False, True], ids=["off", "capture"])
@pytest.mark.parametrize("T", TS)
def test_add_rmsnorm(benchmark, recorder, provider, capture, T):
    fn = PROVIDERS[provider]
    sets, nbytes = (copy_sets if provider == COPY else input_sets)(T, capture)
    us = graph_time_us([lambda s=s: fn(*s) for s in sets])
    benchmark.pedantic(lambda: fn(*sets[0]), rounds=100, warmup_rounds=10)
    _times[(provider, capture, T)] = us
    recorder.add("add_rmsnorm_capture" if capture else "add_rmsnorm", f"T={T} H={H}", provider, us, nbytes,
                 host_us=benchmark.stats.stats.median * 1e6)


@pytest.mark.parametrize("T", TS)
def test_capture_3_layers(benchmark, recorder, T):
    """The plain capture path (3 x `h + r`, then cat) timed here; ours is 3 x the measured extra of the
    fused capture (needs test_add_rmsnorm's eagle3 rows of the same T, run first in this file)."""
    nbytes = 3 * 3 * T * H * 2 + 2 * 3 * T * H * 2  # 3 x (read h, r; write the sum), then cat: read + write 3TH
    sets = []
    for _ in range(rotation(nbytes)):
        hs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
        sets.append(hs)

    def plain(hs):
        torch.cat([hs[0] + hs[1], hs[2] + hs[3], hs[4] + hs[5]], dim=-1)

    us = graph_time_us([lambda s=s: plain(s) for s in sets])
    benchmark.pedantic(lambda: plain(sets[0]), rounds=50, warmup_rounds=5)
    shape = f"T={T} H={H}"
    recorder.add("capture_3_layers", shape, "torch", us, nbytes)
    on, off = _times.get(("eagle3", True, T)), _times.get(("eagle3", False, T))
    if on is not None and off is not None:
        extra = 3 * max(on - off, 0.0)
        # the fused capture's own bytes: 3 aux slices written
        recorder.add("capture_3_layers", shape, "eagle3", extra, 3 * T * H * 2,
                     derived="3 x (capture on - capture off)", share_of_torch=extra / us)
