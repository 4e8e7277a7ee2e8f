"""Test session setup for fv-wan's CPU parity tests."""

import torch

# The tiny models are far below the size where intra-op threads pay off, and on a shared
# machine OpenMP workers spinning against other processes make each op ~100x slower.
torch.set_num_threads(1)
