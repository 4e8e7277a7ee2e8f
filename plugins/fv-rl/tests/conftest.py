"""fv-rl tests: tiny CPU runs; one intra-op thread (the machine is shared)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
