"""fv train runs the RL methods end to end (rollouts through the Engine, rewards, updates, weight
sync, evaluation, export with parity), and fv-rl passes the plugin conformance kit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fv_kernel.api import RecipeError
from fv_kernel.plugins import PluginHost
from fv_kernel.testing import PluginConformance
from fv_kernel.training.recipe import load_recipe, parse_options
from fv_kernel.training.runner import resolve_method, run_training
from fv_rl.grpo import FlowGRPO
from fv_rl.nft import DiffusionNFT

pytest_plugins = ["fv_kernel.testing"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


class TestRLPlugin(PluginConformance):
    distribution = "fv-rl"


def test_methods_rewards_and_sampler_register_through_the_host():
    host = PluginHost()
    host.start()
    assert resolve_method(host, "nft") is DiffusionNFT and resolve_method(host, "fv-rl/grpo") is FlowGRPO
    assert {"colour", "motion", "brightness", "toy-judge"} <= {c.name for c in host.hooks.rewards().values()}
    assert "flow-sde" in host.registry().samplers


@pytest.mark.parametrize("path", sorted([*EXAMPLES.glob("*.yaml"), *RECIPES.glob("*.yaml")]), ids=lambda p: p.name)
def test_the_example_and_shipped_recipes_parse(path):
    recipe = load_recipe(path)
    host = PluginHost()
    parse_options(recipe, resolve_method(host, recipe.method).options_schema)


def _recipe(tmp_path: Path, method: str, **options) -> Path:
    body = {"reward": "colour", "prompts": ["a red circle moves left quickly on a black background"], "group_size": 2,
            "epochs": 2, "steps": 2, "height": 32, "width": 32, "frames": 5, "eval_seeds": [5], **options}
    path = tmp_path / f"{method}.json"
    path.write_text(json.dumps({"method": method, "card": "wan-toy", "output_model_id": f"wan-toy-{method}-ci",
                                "device": "cpu", "options": body}))
    return path


@pytest.mark.parametrize("method", ["nft", "grpo"])
def test_fv_train_runs_the_method_end_to_end(tmp_path, method):
    outcome = run_training(_recipe(tmp_path, method), tmp_path / "run", PluginHost(), progress=False)
    rewards = json.loads((tmp_path / "run" / "rewards.json").read_text())
    assert rewards["method"] == method and rewards["epoch"] == [0, 1, 2] and len(rewards["eval_reward"]) == 3
    assert (tmp_path / "run" / "reward_curve.png").stat().st_size > 1000
    card = outcome.card
    assert card.recipe.method == method and card.recipe.parents == ("wan-toy",)
    assert "reward colour" in card.recipe.data_contract
    d = card.capabilities.defaults
    assert (d.steps, d.guidance, d.frames, d.height, d.width) == (2, 1.0, 5, 32, 32)
    assert outcome.parity.passed


def test_a_bad_reward_in_a_recipe_names_the_field(tmp_path):
    with pytest.raises(RecipeError, match="options.reward: no registered reward 'clip'"):
        run_training(_recipe(tmp_path, "nft", reward="clip"), tmp_path / "run", PluginHost(), progress=False)
