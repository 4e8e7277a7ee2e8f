"""options.lora under orchestration: ray -- the learner actor sends only the adapter to the rollout
actors, and the run ends on the same adapter (and exported weights) as the single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fv_kernel.api import CardCatalog, TrainingRecipe, TrainingRun
from fv_rl.lora import LORA_FILE, LoraOptions
from fv_rl.nft import DiffusionNFT, NFTOptions
from rl_helpers import host, tiny_instance

OPTIONS = dict(prompts=("a red fox", "a blue lake"), group_size=2, epochs=2, steps=2, height=32, width=32, frames=5,
               eval_seeds=(5,), lr=1e-3, lora=LoraOptions(rank=4))


def _run(tmp_path: Path, options: NFTOptions) -> TrainingRun:
    card = CardCatalog(host()).get("wan-tiny")
    recipe = TrainingRecipe(method="nft", card="wan-tiny", output_model_id="wan-tiny-nft-lora-ray", device="cpu")
    return TrainingRun(recipe=recipe, options=options, card=card, instance=tiny_instance(card), device=torch.device("cpu"),
                       output=tmp_path, report=lambda *a: None)


def test_lora_over_ray_actors_matches_the_local_run(tmp_path):
    ray = pytest.importorskip("ray")
    remote = _run(tmp_path / "ray", NFTOptions(orchestration="ray", rollout_workers=2, **OPTIONS))
    b = DiffusionNFT(remote.options).train(remote).modules["transformer"].state_dict()
    assert not ray.is_initialized()
    local = _run(tmp_path / "local", NFTOptions(**OPTIONS))
    a = DiffusionNFT(local.options).train(local).modules["transformer"].state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    file_a, file_b = load_file(tmp_path / "local" / LORA_FILE), load_file(tmp_path / "ray" / LORA_FILE)
    assert sorted(file_a) == sorted(file_b) and any(float(v.abs().max()) > 0 for k, v in file_b.items() if "lora_B" in k)
    assert max(float((file_a[k] - file_b[k]).abs().max()) for k in file_a) < 1e-5
