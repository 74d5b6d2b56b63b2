"""Machine-limit probes for the throughput benchmarks (``throughput.py``, ``vs_trl.py``).

Measured in the same process and with the same thread settings as the run they judge:

- ``gemm_probe``: FLOP/s of ``F.linear`` at a decoder's layer shapes (q, k, v, o, SwiGLU gate,
  up, down for every layer and the LM head once) on ``tokens`` rows, weighted as in one
  forward: total FLOPs / total time. The update's "needed FLOPs per second" over this is its
  efficiency.
- ``bandwidth_probe``: bytes/s of reading (summing) a tensor several times larger than the
  last-level cache. Decoding B sequences can emit at most B x bandwidth / weight bytes
  tokens/s (``salvage.core.flops.decode_floor_tokens_per_s``).
- ``published_peak``: a GPU's published dense bf16 peak FLOP/s (for MFU), or None.

Medians over ``reps`` timed repetitions after one warm-up: on a shared machine the median
reflects the conditions of the run better than the best repetition.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from salvage.core.memory import Shape

# Published dense bf16 tensor-core peaks (no sparsity), FLOP/s; the first matching name wins.
PEAKS_BF16 = (
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
)


def published_peak(device_name: str) -> float | None:
    """The published dense bf16 peak of a GPU named ``device_name`` (None: not in the table)."""
    for key, peak in PEAKS_BF16:
        if key.lower() in device_name.lower():
            return peak
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, reps: int) -> float:  # noqa: ANN001
    """Median seconds per call of ``fn``; calls are batched so that a repetition lasts >= 10 ms."""
    t0 = time.perf_counter()
    fn()  # warm-up
    _sync(device)
    number = max(1, int(0.01 / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def layer_gemms(shape: Shape, tokens: int) -> list[tuple[int, int, int, int]]:
    """(rows, in, out, count per forward) of the matmuls of one forward over ``tokens`` rows."""
    h, kv, i, L = shape.hidden, shape.kv_dim, shape.intermediate, shape.layers
    return [
        (tokens, h, h, 2 * L),  # q, o
        (tokens, h, kv, 2 * L),  # k, v
        (tokens, h, i, 2 * L),  # gate, up
        (tokens, i, h, L),  # down
        (tokens, h, shape.vocab, 1),  # LM head
    ]


def gemm_probe(
    shape: Shape,
    tokens: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    reps: int = 3,
) -> float:
    """Achieved FLOP/s of the layer matmuls of ``shape`` on ``tokens`` rows (see module doc)."""
    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    flops = seconds = 0.0
    for rows, n_in, n_out, count in layer_gemms(shape, tokens):
        x = torch.randn(rows, n_in, generator=g).to(dev, dtype)
        w = torch.randn(n_out, n_in, generator=g).to(dev, dtype)
        with torch.no_grad():
            dt = median_time(lambda x=x, w=w: F.linear(x, w), dev, reps)
        flops += count * 2.0 * rows * n_in * n_out
        seconds += count * dt
    return flops / seconds


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (Linux sysfs), or 32 MiB when it cannot be read."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    for idx in base.glob("index*"):
        try:
            s = (idx / "size").read_text().strip().upper()
            mult = {"K": 1024, "M": 1024**2}.get(s[-1], 1)
            best = max(best, int(s.rstrip("KM")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 * 1024**2


def bandwidth_probe(
    device: str | torch.device = "cpu", nbytes: int | None = None, reps: int = 5
) -> float:
    """Bytes/s of reading an fp32 tensor of ``nbytes`` (default: 8x the last-level cache, at
    least 256 MiB on CPU; 2 GiB on a GPU) once."""
    dev = torch.device(device)
    if nbytes is None:
        nbytes = 2 * 1024**3 if dev.type == "cuda" else max(8 * last_level_cache_bytes(), 2**28)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dt = median_time(lambda: x.sum(), dev, reps)
    return x.numel() * 4 / dt
