"""The flow-matching method: its target's sign against the kernel's samplers, its recipe errors, and a tiny CPU run.

``test_tiny_cpu_run_trains_exports_and_checks_parity`` is the CI smoke run of the wan-toy recipe
(``recipes/wan-toy-ci.yaml``: the same method and card, a few steps on 32x32 clips).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fv_kernel.api import CARD_FILE, ModelCard, RecipeError, RecipeSpec, SamplerBinding, bound_sampler
from fv_kernel.plugins import PluginHost
from fv_kernel.training.recipe import load_recipe, parse_options
from fv_kernel.training.runner import resolve_method, run_training
from fv_rl import flow_matching
from fv_rl.flow_matching import FlowMatching, FlowMatchingOptions

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _oracle_sample(x0: torch.Tensor, steps: int = 12, sampler: str = "unipc") -> torch.Tensor:
    """Sample with a kernel sampler from a model that is the exact minimiser of the method's loss for a
    point-mass data distribution at ``x0``: given x_t and sigma, eps is determined, and the model
    returns the method's own target for (x0, eps) -- computed through the method's ``loss``."""
    method = FlowMatching()

    def model(x_t: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        sigma = (t / flow_matching.TIMESTEP_SCALE).reshape(-1, *[1] * (x_t.ndim - 1))
        eps = (x_t - (1 - sigma) * x0) / sigma
        return flow_matching.flow_target(x0.expand_as(eps), eps)

    s = bound_sampler(SamplerBinding(name=sampler, config={"shift": 3.0}))
    state = s.init_state(steps)
    x = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    # The loss of the oracle on fresh noise is 0: it predicts exactly the method's target.
    batch = {"model": model, "x0": x0, "noise": torch.randn_like(x0), "sigma": torch.full((x0.shape[0],), 0.4), "context": None}
    assert method.loss(batch).item() < 1e-10
    while not s.is_done(state):
        v = model(x, s.timestep(state).reshape(1).expand(x.shape[0]).float(), None)
        state, x = s.step(state, v, x)
    return x


@pytest.mark.parametrize("sampler", ["unipc", "euler"])
def test_the_target_sign_is_the_samplers_convention(sampler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x0 = torch.linspace(-1, 1, 2 * 4 * 3 * 3).reshape(2, 4, 1, 3, 3)
    assert (_oracle_sample(x0, sampler=sampler) - x0).abs().max() < 1e-3
    # Negative control: the opposite sign (x0 - eps) is a model the samplers walk away from the data.
    monkeypatch.setattr(flow_matching, "flow_target", lambda x0, noise: x0 - noise)
    assert (_oracle_sample(x0, sampler=sampler) - x0).abs().max() > 0.5


def test_the_method_is_registered_through_the_plugin_host() -> None:
    host = PluginHost()
    host.start()
    assert resolve_method(host, "flow-matching") is FlowMatching
    assert resolve_method(host, "fv-rl/flow-matching") is FlowMatching


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_recipe_errors_name_the_field(tmp_path: Path) -> None:
    base = "method: flow-matching\ncard: wan-toy-init\noutput_model_id: x\n"
    with pytest.raises(RecipeError, match=r"options\.dit\.steps: .*greater than or equal to 1"):
        parse_options(load_recipe(_recipe(tmp_path, base + "options: {dit: {steps: 0}}\n")), FlowMatchingOptions)
    with pytest.raises(RecipeError, match=r"options\.vae\.batchsize: Extra inputs"):
        parse_options(load_recipe(_recipe(tmp_path, base + "options: {vae: {batchsize: 4}}\n")), FlowMatchingOptions)
    with pytest.raises(RecipeError, match=r"options\.dit\.text_encoder: .*'train' or 'frozen'"):
        parse_options(load_recipe(_recipe(tmp_path, base + "options: {dit: {text_encoder: thaw}}\n")), FlowMatchingOptions)
    with pytest.raises(RecipeError, match=r"^epochs: Extra inputs .*allowed: card, device, method"):
        load_recipe(_recipe(tmp_path, base + "epochs: 3\n"))
    with pytest.raises(RecipeError, match=r"^output_model_id: String should match pattern"):
        load_recipe(_recipe(tmp_path, "method: flow-matching\ncard: wan-toy-init\noutput_model_id: Bad Id\n"))
    host = PluginHost()
    host.start()
    with pytest.raises(RecipeError, match=r"^method: no registered training method 'dpo'; allowed: .*flow-matching"):
        resolve_method(host, "dpo")


def test_recipe_geometry_is_checked_against_the_card(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, "method: flow-matching\ncard: wan-toy-init\noutput_model_id: x\ndevice: cpu\n"
                                "options: {frames: 6, vae: {steps: 0}, dit: {steps: 1}}\n")
    host = PluginHost()
    with pytest.raises(RecipeError, match=r"^options\.frames: 6 is not 4k\+1"):
        run_training(recipe, tmp_path / "run", host, progress=False)


def test_the_shipped_recipes_parse() -> None:
    shipped = sorted(RECIPES.glob("wan-toy*.yaml"))
    assert {"wan-toy.yaml", "wan-toy-ci.yaml", "wan-toy-continue-5.yaml"} <= {path.name for path in shipped}
    for path in shipped:
        recipe = load_recipe(path)
        assert isinstance(parse_options(recipe, FlowMatchingOptions), FlowMatchingOptions)


def test_tiny_cpu_run_trains_exports_and_checks_parity(tmp_path: Path) -> None:
    """The CI smoke run: losses fall, the export passes the card's parity check, the card records the recipe."""
    from fv_wan.toy.world import GENERATOR_VERSION

    outcome = run_training(RECIPES / "wan-toy-ci.yaml", tmp_path, PluginHost(), progress=False)
    log = outcome.log
    assert log.last("dit", "flow_mse", 4) < log.first("dit", "flow_mse", 4)
    # The VAE stage ran (3 steps on 3 different random batches: too few for its loss to show a trend).
    assert [step for step, _ in log.curves["vae"]["l1"]] == [1, 2, 3]
    assert outcome.parity.passed and outcome.parity.value < 1e-4
    for name in ("losses.json", "losses.png", "training.json"):
        assert (tmp_path / name).stat().st_size > 0
    card = ModelCard.model_validate_json((outcome.checkpoint / CARD_FILE).read_text())
    assert card.model_id == "wan-toy-ci" and card.checkpoint.layout == "diffusers"
    assert card.recipe.method == "flow-matching" and card.recipe.parents == ("wan-toy-init",)
    assert GENERATOR_VERSION in card.recipe.data_contract and "DiT 12 steps" in card.recipe.data_contract
    defaults = card.capabilities.defaults
    assert (defaults.frames, defaults.height, defaults.width, defaults.steps) == (5, 32, 32, 3)
    vae = json.loads((outcome.checkpoint / "vae" / "config.json").read_text())
    assert vae["latents_std"] != [1.0] * 16  # measured on the encoded clips, not the placeholders
    training = json.loads((tmp_path / "training.json").read_text())
    assert training["steps"] == {"vae": 3, "dit": 12}


def test_training_continues_from_an_earlier_export(tmp_path: Path) -> None:
    """A recipe's ``card`` may name the folder an earlier run exported: the next run starts from its
    weights (not the parent card's), records it as the parent, and with ``vae.steps: 0`` keeps its VAE."""
    from safetensors.torch import load_file

    first = run_training(RECIPES / "wan-toy-ci.yaml", tmp_path / "first", PluginHost(), progress=False)
    recipe = load_recipe(RECIPES / "wan-toy-ci.yaml").model_copy(update={"card": str(first.checkpoint), "output_model_id": "wan-toy-ci-2"})
    options = dict(recipe.options)
    options["vae"] = {**options["vae"], "steps": 0}
    options["dit"] = {**options["dit"], "steps": 2, "lr": 1e-12, "ema": 0.0}  # a negligible update: the weights stay the start's
    second = run_training(recipe.model_copy(update={"options": options}), tmp_path / "second", PluginHost(), progress=False)
    card = ModelCard.model_validate_json((second.checkpoint / CARD_FILE).read_text())
    assert card.recipe.parents == ("wan-toy-ci",) and second.parity.passed

    def weights(root: Path, sub: str) -> dict[str, torch.Tensor]:
        return load_file(root / sub / "diffusion_pytorch_model.safetensors")

    start, after = weights(first.checkpoint, "transformer"), weights(second.checkpoint, "transformer")
    assert all(torch.allclose(start[k], after[k], atol=1e-6) for k in start)
    assert weights(first.checkpoint, "vae").keys() == weights(second.checkpoint, "vae").keys()
    assert all(torch.equal(a, b) for a, b in zip(weights(first.checkpoint, "vae").values(), weights(second.checkpoint, "vae").values()))
    # Control: the first run did move the transformer away from wan-toy-init's seeded weights.
    init = run_training(recipe.model_copy(update={"card": "wan-toy-init", "options": options}), tmp_path / "init", PluginHost(), progress=False)
    moved = weights(init.checkpoint, "transformer")
    assert any(not torch.allclose(start[k], moved[k], atol=1e-6) for k in start)


def test_the_trainer_feeds_the_dit_the_prompt_context_serving_builds() -> None:
    """Training embeds prompts exactly as the card's ``text_encode`` loop does, at the card's context length
    (the toy card's 24 rows; a trainer that padded to Wan's 512 would train on rows serving never gives)."""
    from fv_kernel.api import InstanceOptions, build_instance
    from fv_wan.toy_card import TOY_CONTEXT_LENGTH, wan_toy_init_card

    card = wan_toy_init_card()
    assert flow_matching.context_length_of(card) == TOY_CONTEXT_LENGTH == 24
    text_encoder = build_instance(card, InstanceOptions(device="cpu")).component("text_encoder")
    prompts = ["a red circle moves left quickly on a navy background", "a blue square moves up slowly on a grey background"]
    length = flow_matching.context_length_of(card)
    tokens = text_encoder.tokenizer(prompts, padding="longest", truncation=True, max_length=length, return_tensors="pt")
    trained = flow_matching._embed_with_grad(text_encoder)(text_encoder, tokens.input_ids, tokens.attention_mask, length)
    served = text_encoder.encode(prompts, length)
    assert trained.shape == served.shape == (2, 24, 128)
    # Serving pads the ids to 24 before the encoder, training to the longest prompt: masked, so equal up to
    # reduction order.
    torch.testing.assert_close(trained, served, rtol=0, atol=1e-5)


def test_the_vae_loss_weights_frame_zero_and_objects() -> None:
    video = torch.full((1, 3, 5, 8, 8), -1.0)
    video[..., 2:4, 2:4] = 1.0  # an object on a plain background, in every frame
    plain = flow_matching.reconstruction_weight(video, flow_matching.VAEStage(object_weight=10.0))
    weighted = flow_matching.reconstruction_weight(video, flow_matching.VAEStage(object_weight=10.0, first_frame_weight=4.0))
    assert plain[0, 0, 1, 2, 2] > plain[0, 0, 1, 0, 0] > 0  # object pixels count more than background
    torch.testing.assert_close(weighted[:, :, 0], 4 * plain[:, :, 0])
    torch.testing.assert_close(weighted[:, :, 1:], plain[:, :, 1:])


def test_a_stage_stops_at_its_wall_clock_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``time_limit_s`` stops the VAE stage as it stops the DiT's, and the card records the steps that ran.
    The clock is faked: each call advances it 1 s, so a 2.5 s budget lets a stage run 2 steps whatever the machine."""
    now = iter(float(t) for t in range(10**6))
    monkeypatch.setattr(flow_matching.time, "perf_counter", lambda: next(now))
    recipe = load_recipe(RECIPES / "wan-toy-ci.yaml")
    options = dict(recipe.options)
    options["vae"] = {**options["vae"], "steps": 50, "time_limit_s": 2.5}
    options["dit"] = {**options["dit"], "steps": 50, "time_limit_s": 2.5}
    outcome = run_training(recipe.model_copy(update={"options": options}), tmp_path, PluginHost(), progress=False)
    training = json.loads((tmp_path / "training.json").read_text())
    assert training["steps"] == {"vae": 2, "dit": 2}
    card = ModelCard.model_validate_json((outcome.checkpoint / CARD_FILE).read_text())
    assert "VAE 2 steps" in card.recipe.data_contract and "DiT 2 steps" in card.recipe.data_contract


def test_the_ema_warms_up() -> None:
    """After one update the exported average is mostly the trained weights, not the initial ones
    (a fixed 0.999 decay would leave it 99.9% initial: the control)."""
    module = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.zeros_(module.weight)
    ema = flow_matching._EMA([module], decay=0.999)
    with torch.no_grad():
        module.weight.fill_(1.0)
    ema.update([module])
    averaged = ema.shadow[0].weight
    assert torch.allclose(averaged, torch.full_like(averaged, 1 - 2 / 11))
    for _ in range(10_000):
        ema.update([module])
    assert ema.decay == 0.999 and torch.allclose(ema.shadow[0].weight, module.weight)
    fixed = torch.zeros(2, 2).lerp_(torch.ones(2, 2), 1 - 0.999)
    assert float(fixed.max()) < 0.01 < float(averaged.min())


def test_a_staged_run_records_every_stage(tmp_path: Path) -> None:
    """Continuing an export under its own id keeps its parents and chains the data contracts, so the final
    card names every stage; a stage that trains no VAE says so. The control: under a new id, the
    export is the parent and the contract is the stage's alone (test_training_continues_from_an_earlier_export)."""
    first = run_training(RECIPES / "wan-toy-ci.yaml", tmp_path / "first", PluginHost(), progress=False)
    recipe = load_recipe(RECIPES / "wan-toy-ci.yaml").model_copy(update={"card": str(first.checkpoint)})
    options = dict(recipe.options)
    options["vae"] = {**options["vae"], "steps": 0}
    options["dit"] = {**options["dit"], "steps": 3}
    second = run_training(recipe.model_copy(update={"options": options}), tmp_path / "second", PluginHost(), progress=False)
    before = ModelCard.model_validate_json((first.checkpoint / CARD_FILE).read_text()).recipe
    after = ModelCard.model_validate_json((second.checkpoint / CARD_FILE).read_text()).recipe
    assert after.parents == before.parents == ("wan-toy-init",)
    assert after.data_contract.startswith(before.data_contract + "; then ")
    last = after.data_contract.split("; then ")[-1]
    assert "VAE kept from the start (not trained)" in last and "DiT 3 steps" in last
    # Controls: under another id, or by another method, the start is the parent and the contract the stage's.
    start = ModelCard.model_validate_json((first.checkpoint / CARD_FILE).read_text())
    stage = RecipeSpec(method="flow-matching", parents=("wan-toy-ci",), data_contract="stage")
    assert flow_matching.continued_recipe(start, "wan-toy-ci-2", stage) is stage
    other = stage.model_copy(update={"method": "dmd2"})
    assert flow_matching.continued_recipe(start, "wan-toy-ci", other) is other
    assert flow_matching.continued_recipe(start, "wan-toy-ci", stage).parents == ("wan-toy-init",)
