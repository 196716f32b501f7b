"""Check that the DeepSeek drop-in's float32 sums and sort ties follow torch's CPU order, on random cases.

Run: pip install torch (CPU; not a dependency of eplb), then python benchmarks/torch_order_check.py [--cases N]
Compares, bit for bit, `sum_last_like_torch` with `torch.Tensor.sum(-1)` (rows of 1 to 5,000 float32 values,
loads up to 2^30) and `argsort_desc_like_torch` with `torch.Tensor.sort(descending=True)` (rows full of ties),
prints the mismatch counts and exits 1 on any. torch's vector width follows the CPU (AVX2 and the default
build: 8 floats; AVX-512: 16): the check prints the capability torch used.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from solvers.torch_order import argsort_desc_like_torch, sum_last_like_torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    sum_bad = sort_bad = 0
    for _ in range(args.cases):
        n = int(rng.choice([rng.integers(1, 70), rng.integers(70, 600), rng.integers(600, 5000)]))
        scale = float(rng.choice([1.0, 1e3, 2.0**25, 2.0**30]))
        values = (rng.pareto(1.0, (4, n)) * scale).astype(np.float32)
        if rng.random() < 0.5:
            values = np.round(values)
        ours = sum_last_like_torch(values)
        theirs = torch.from_numpy(values).sum(-1).numpy()
        sum_bad += int(not np.array_equal(ours.view(np.int32), theirs.view(np.int32)))
        ties = rng.integers(0, max(2, n // 4), (3, n)).astype(np.float32)  # many equal values per row
        torch_order = torch.from_numpy(ties).sort(-1, descending=True).indices.numpy()
        sort_bad += int(not np.array_equal(argsort_desc_like_torch(ties), torch_order))
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"float32 row sums: {sum_bad} of {args.cases} cases differ from torch's sum(-1)")
    print(f"sort ties:        {sort_bad} of {args.cases} cases differ from torch's sort(descending=True)")
    return 1 if sum_bad or sort_bad else 0


if __name__ == "__main__":
    sys.exit(main())
