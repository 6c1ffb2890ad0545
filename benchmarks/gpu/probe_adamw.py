# Where the AdamW step's time goes on CUDA (7.2 ms for 16M parameters on the H100 in the first GPU run,
# against 0.21 ms for PyTorch's fused AdamW): the step at three parameter layouts, one elementwise
# launch for scale, the transfers per step, and a cProfile of the step. Run on the GPU machine:
#   PYTHONPATH=/tmp/taifuse-site:src python3 benchmarks/gpu/probe_adamw.py
import time

import numpy as np

import taifuse

taifuse.set_backend("taichi", arch="cuda")
from taifuse import nn, optim
from taifuse.backends import taichi as tb


def timed(fn, n=20):
    fn()
    tb.sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    tb.sync()
    return (time.perf_counter() - t) / n * 1e3


rng = np.random.default_rng(0)
for count, shape in ((4, (2048, 2048)), (1, (4096, 4096)), (64, (256, 256))):
    ps = [nn.Parameter(rng.standard_normal(shape, dtype=np.float32)) for _ in range(count)]
    opt = optim.AdamW(ps, lr=1e-3)
    sum((p * taifuse.tensor(rng.standard_normal(shape, dtype=np.float32))).sum() for p in ps).backward()
    print(f"AdamW {count}x{shape}: {timed(opt.step):.3f} ms/step")
x = tb.from_numpy(np.ones(16 * 2**20, np.float32))
o = tb.empty(x.shape, x.dtype)
import taifuse.functional as F

print(f"gelu 16M: {timed(lambda: F.gelu(x, out=o)):.4f} ms")
print(f"relu 16M: {timed(lambda: F.relu(x, out=o)):.4f} ms")
tb.reset_transfer_stats()
opt.step()
tb.sync()
print("transfers per step", tb.transfer_stats())
import cProfile
import pstats

pr = cProfile.Profile()
pr.enable()
for _ in range(10):
    opt.step()
tb.sync()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(8)
