"""DMD2 distillation: the objective, and the new card it exports (recipe, few-step loop, parity, RecipeMismatch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fv_kernel.api import CardCatalog, Engine, InstanceOptions, RecipeMismatch, build_instance, read_card_file_beside
from fv_kernel.plugins import PluginHost
from fv_kernel.training.runner import run_training
from fv_rl.dmd2 import dmd_loss, few_step_loop
from rl_helpers import request


def test_dmd_loss_is_zero_when_the_scores_agree_and_its_gradient_is_the_score_difference():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, 2, 3, 3, generator=g).requires_grad_(True)
    real = torch.randn(x0.shape, generator=g)
    assert float(dmd_loss(x0, real, real).detach()) == 0.0
    fake = real + 0.3
    dmd_loss(x0, real, fake).backward()
    normalizer = (x0.detach() - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    torch.testing.assert_close(x0.grad, ((fake - real) / normalizer) / x0.numel())


def test_few_step_loop_binds_the_dmd_sampler_with_fixed_steps():
    card = CardCatalog(PluginHost()).get("wan-toy")
    loop = few_step_loop(card, (1000.0, 600.0))
    assert loop.loop_id == "dmd_2step" and loop.guidance == "none" and loop.kind == "diffusion_denoise"
    assert loop.sampler.name == "dmd" and loop.sampler.fixed_steps == 2 and loop.sampler.config["denoising_timesteps"] == [1000.0, 600.0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dmd2")
    recipe = tmp / "dmd2.json"
    recipe.write_text(json.dumps({
        "method": "dmd2", "card": "wan-toy", "output_model_id": "wan-toy-dmd2-ci", "device": "cpu",
        "options": {"steps": 4, "batch": 2, "critic_updates": 2, "height": 32, "width": 32, "frames": 5, "log_every": 1},
    }))
    outcome = run_training(recipe, tmp / "run", PluginHost(), progress=False)
    return outcome


def test_dmd2_exports_a_new_card_with_its_recipe_filled_in(exported):
    card = exported.card
    assert card.model_id == "wan-toy-dmd2-ci"
    r = card.recipe
    assert (r.method, r.parents, r.assumes_loop) == ("dmd2", ("wan-toy",), "dmd_3step")
    assert "DMD2 from teacher 'wan-toy'" in r.data_contract and "3-step schedule" in r.data_contract
    assert card.loops["dmd_3step"].sampler.fixed_steps == 3
    assert (card.capabilities.defaults.steps, card.capabilities.defaults.guidance) == (3, 1.0)
    assert exported.parity.passed and exported.parity.reference.startswith("diffusers")
    assert exported.log.curves["dmd2"]["critic"] and exported.log.curves["dmd2"]["dmd"]


def test_the_exported_card_runs_its_few_step_loop_and_refuses_50_steps(exported):
    card = read_card_file_beside(exported.checkpoint)
    host = PluginHost()
    host.start()
    engine = Engine()
    engine.add_instance(build_instance(card, InstanceOptions(device="cpu", precision="fp32", registry=host.registry())))
    ok = engine.generate(request(model=card.model_id, capture="final", steps=3))
    assert ok.status == "completed"
    record = ok.artifact("behavior")
    assert record.sampler.startswith("dmd:") and len(record.steps) == 3
    with pytest.raises(RecipeMismatch, match="assumes loop 'dmd_3step'.*50 steps"):
        engine.validate(request(model=card.model_id, steps=50))
    with pytest.raises(RecipeMismatch, match="sampler"):
        engine.validate(request(model=card.model_id, steps=3, sampler="unipc"))


def test_parity_at_export_discriminates_loops(exported):
    """Negative control: the parity check run with the few-step loop assumed (fv's DMD loop vs
    diffusers' multi-step pipeline) fails -- which is why export checks the weights on the base loop."""
    card = read_card_file_beside(exported.checkpoint)
    host = PluginHost()
    host.start()
    result = host.hooks.check_parity(card, Path(exported.checkpoint))
    assert not result.passed


def test_fv_generate_runs_the_card_and_refuses_a_50_step_request(exported, tmp_path):
    import subprocess
    import sys

    card_file = str(Path(exported.checkpoint) / "fv-card.json")
    fv = [sys.executable, "-m", "fv_kernel.cli.app"]
    ok = subprocess.run([*fv, "generate", "--model", card_file, "--prompt", "a red circle", "--output", str(tmp_path / "v.pt")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run([*fv, "generate", "--model", card_file, "--prompt", "a red circle", "--steps", "50",
                              "--output", str(tmp_path / "w.pt")], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "assumes loop 'dmd_3step'" in refused.stderr and not (tmp_path / "w.pt").exists()
