"""fv train with options.lora, end to end (NFT, GRPO, DMD2): the trained LoRA is written as a
diffusers/PEFT safetensors file with provenance, diffusers' load_lora_weights reproduces the
trained function from it, and merged into the base it is exactly the exported card's transformer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fv_kernel.api import (
    AdapterWeights, CardCatalog, InstanceOptions, LowRankUpdate, build_instance, merge_adapters, read_card_file_beside,
)
from fv_kernel.plugins import PluginHost
from fv_kernel.training.runner import run_training
from fv_rl.lora import LORA_FILE
from rl_helpers import host, tiny_instance

LORA = {"rank": 4, "alpha": 8.0}
PROMPT = "a red circle moves left quickly on a black background"


def _recipe(tmp: Path, method: str, options: dict) -> Path:
    path = tmp / f"{method}.json"
    path.write_text(json.dumps({"method": method, "card": "wan-toy", "output_model_id": f"wan-toy-{method}-lora-ci",
                                "device": "cpu", "options": {"lora": LORA, **options}}))
    return path


ONLINE = {"reward": "colour", "prompts": [PROMPT], "group_size": 2, "epochs": 2, "steps": 2, "height": 32, "width": 32,
          "frames": 5, "eval_seeds": [5], "lr": 1e-3}
OPTIONS = {
    "nft": ONLINE,
    "grpo": ONLINE,
    "dmd2": {"steps": 4, "batch": 2, "critic_updates": 2, "height": 32, "width": 32, "frames": 5, "log_every": 1, "lr": 1e-3},
}


@pytest.fixture(scope="module", params=["nft", "grpo", "dmd2"])
def trained(request, tmp_path_factory):
    method = request.param
    tmp = tmp_path_factory.mktemp(method)
    outcome = run_training(_recipe(tmp, method, OPTIONS[method]), tmp / "run", PluginHost(), progress=False)
    return method, outcome, tmp / "run"


@pytest.fixture(scope="module")
def base():
    return tiny_instance(CardCatalog(host()).get("wan-toy")).component("transformer")


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _as_adapter(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> AdapterWeights:
    """The file read the PEFT way (a reference reader: keys and the LoraConfig metadata, nothing from fv_rl)."""
    config = json.loads(metadata["lora_adapter_metadata"])
    modules = sorted({k[len("transformer."):].rsplit(".lora_", 1)[0] for k in state})
    updates = {m: LowRankUpdate(state[f"transformer.{m}.lora_A.weight"], state[f"transformer.{m}.lora_B.weight"],
                                config["transformer.lora_alpha"]) for m in modules}
    return AdapterWeights("file", "transformer", updates)


def _exported_transformer(outcome):
    card = read_card_file_beside(outcome.checkpoint)
    options = InstanceOptions(device="cpu", precision="fp32", local_files_only=True, registry=host().registry())
    return build_instance(card, options).component("transformer")


def test_the_adapter_file_is_peft_format_with_provenance(trained, base):
    method, outcome, out = trained
    state, metadata = _read(out / LORA_FILE)
    targets = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")
               and (".attn" in n or ".ffn." in n)]
    assert sorted(state) == sorted(f"transformer.{t}.lora_{ab}.weight" for t in targets for ab in "AB")
    linear = base.get_submodule(targets[0])
    assert state[f"transformer.{targets[0]}.lora_A.weight"].shape == (4, linear.in_features)
    assert state[f"transformer.{targets[0]}.lora_B.weight"].shape == (linear.out_features, 4)
    assert any(float(v.abs().max()) > 0 for k, v in state.items() if "lora_B" in k)  # B trained off zero
    config = json.loads(metadata["lora_adapter_metadata"])
    assert (config["transformer.r"], config["transformer.lora_alpha"]) == (4, 8.0)
    assert sorted(config["transformer.target_modules"]) == sorted(targets)
    assert (metadata["fv.method"], metadata["fv.base_card"], metadata["fv.model_id"]) == (method, "wan-toy", f"wan-toy-{method}-lora-ci")
    assert json.loads(metadata["fv.steps"]) == ({"dmd2": 4} if method == "dmd2" else {"epochs": 2, "updates": 2})
    assert "LoRA rank 4 alpha 8" in metadata["fv.data_contract"] == outcome.card.recipe.data_contract
    assert json.loads(metadata["fv.seed"]) == 0
    if method == "dmd2":
        assert (metadata["fv.assumes_loop"], json.loads(metadata["fv.assumes_steps"])) == ("dmd_3step", 3)
    else:
        assert metadata["fv.reward"] == "colour"
    assert outcome.parity.passed


def test_the_exported_card_is_the_base_with_the_file_merged_in(trained, base):
    """fv reads the file back: merged into the base weights it gives the exported card's transformer bit for bit."""
    _, outcome, out = trained
    exported = _exported_transformer(outcome).state_dict()
    merged = tiny_instance(CardCatalog(host()).get("wan-toy")).component("transformer")
    merge_adapters(merged, [(_as_adapter(*_read(out / LORA_FILE)), 1.0)])
    expected = merged.state_dict()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    untouched = [k for k in expected if not any(f"{t}.weight" == k for t in _as_adapter(*_read(out / LORA_FILE)).low_rank)]
    assert all(torch.equal(exported[k], base.state_dict()[k]) for k in untouched)  # only the LoRA targets moved
    moved = [k for k in expected if k not in untouched]
    assert any(not torch.equal(exported[k], base.state_dict()[k]) for k in moved)


def _diffusers_forward(base, lora: Path | dict, x, t, ctx) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    model = WanTransformer3DModel.from_config(base.config.to_diffusers_config())
    model.load_state_dict(base.state_dict(), strict=True)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(), transformer=model)
    pipe.load_lora_weights(lora)
    with torch.no_grad():
        return pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]


def test_diffusers_load_lora_weights_gives_the_trained_function(trained, base):
    _, outcome, out = trained
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 2, 4, 4, generator=g)
    t = torch.tensor([600.0])
    ctx = torch.randn(1, 8, base.config.text_dim, generator=g)
    with torch.no_grad():
        fv = _exported_transformer(outcome)(x, t, ctx)
        plain = base(x, t, ctx)
    ref = _diffusers_forward(base, out / "lora", x, t, ctx)  # the folder: diffusers finds its default file name
    assert float((fv - ref).abs().max()) < 1e-5
    assert float((fv - plain).abs().max()) > 1e-4  # the adapter does something here
    # Negative control: the same tensors without the metadata; diffusers then takes alpha = r (scale 1, not 2).
    state, _ = _read(out / LORA_FILE)
    alpha_lost = _diffusers_forward(base, state, x, t, ctx)
    assert float((fv - alpha_lost).abs().max()) > 1e-4


def test_the_trained_file_registers_as_a_serving_adapter(trained, base):
    """The file fv train writes is an adapter a deployment serves: the card's own converter reads it
    into the same updates the PEFT-way reader gets, and a distilled (DMD2) file declares its loop and
    step count, so serving it with another step count is refused."""
    from fv_kernel.api import AdapterRegistry, converter_for

    method, _, out = trained
    card = CardCatalog(host()).get("wan-toy")
    registry = AdapterRegistry(converter_for(card))
    info = registry.add_file(out / LORA_FILE, name=f"{method}-lora")
    assert info.components == ("transformer",) and info.rank == 4
    weights = registry.weights(registry.get(info.name).version, "transformer", "cpu")
    reference = _as_adapter(*_read(out / LORA_FILE))
    assert sorted(weights.low_rank) == sorted(reference.low_rank)
    for path, update in reference.low_rank.items():
        torch.testing.assert_close(weights.low_rank[path].weight_delta(), update.weight_delta(), rtol=0, atol=1e-7)
    if method == "dmd2":
        assert (info.assumes_loop, info.assumes_steps) == ("dmd_3step", 3)
    else:
        assert (info.assumes_loop, info.assumes_steps) == (None, None)
