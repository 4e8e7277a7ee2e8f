"""orchestration: ray -- 2 rollout actors and 1 learner on a local Ray cluster, 2 updates, clean shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fv_kernel.api import CardCatalog, InvalidRequest, TrainingRecipe, TrainingRun
from fv_rl.nft import DiffusionNFT, NFTOptions
from rl_helpers import host, tiny_instance


def _run(tmp_path: Path, options: NFTOptions, reports: list[tuple[str, int]] | None = None) -> TrainingRun:
    card = CardCatalog(host()).get("wan-tiny")
    recipe = TrainingRecipe(method="nft", card="wan-tiny", output_model_id="wan-tiny-nft-ray", device="cpu")
    sink = reports if reports is not None else []
    return TrainingRun(recipe=recipe, options=options, card=card, instance=tiny_instance(card), device=torch.device("cpu"),
                       output=tmp_path, report=lambda stage, step, total, losses: sink.append((stage, step)))


OPTIONS = dict(prompts=("a red fox", "a blue lake"), group_size=2, epochs=2, steps=2, height=32, width=32, frames=5,
               eval_seeds=(5,), lr=1e-4)


def test_two_rollout_actors_and_a_learner_run_two_updates_shut_down_and_match_the_local_run(tmp_path):
    ray = pytest.importorskip("ray")
    reports: list[tuple[str, int]] = []
    remote = _run(tmp_path / "ray", NFTOptions(orchestration="ray", rollout_workers=2, **OPTIONS), reports)
    before = {k: v.clone() for k, v in remote.instance.component("transformer").state_dict().items()}
    b = DiffusionNFT(remote.options).train(remote).modules["transformer"].state_dict()
    assert reports == [("rl", 0), ("rl", 1), ("rl", 2)]
    assert any(not torch.equal(before[k], b[k]) for k in before)  # the learner's updates came back
    assert (tmp_path / "ray" / "rewards.json").exists()
    assert not ray.is_initialized()  # the cluster this run started is gone
    # Same seeds, same updates: the distributed run ends on the weights of the single-process run.
    local = _run(tmp_path / "local", NFTOptions(**OPTIONS))
    a = DiffusionNFT(local.options).train(local).modules["transformer"].state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_ray_missing_is_a_typed_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    run = _run(tmp_path, NFTOptions(orchestration="ray", **OPTIONS))
    with pytest.raises(InvalidRequest, match="options.orchestration"):
        DiffusionNFT(run.options).train(run)
