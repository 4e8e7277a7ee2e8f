"""``fv quantize`` (docs/precision.md): a card's fp8 weights written once, loaded back as they are.

The written folder holds the quantized components' state dicts (e4m3 ``weight`` + fp32
``weight_scale`` for each fp8 target) as safetensors and ``fv-card.json``, whose
``recipe.quantized_from`` names the card, weights version and path. Loading it back must not
quantize anything, and must run bit-identically to quantizing at load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, run_local
from fv_kernel.card.spec import ModelCard
from fv_kernel.cli.app import app
from fv_kernel.compute.fp8 import Fp8Linear
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.model.catalog import read_card_file_beside
from fv_kernel.model.instance import build_instance
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.precision import fp8_target_paths
from fv_kernel.model.quantize import QuantizeError, quantize_card
from fv_kernel.testing.toy import ToyDiT, toy_card

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def video(card: ModelCard, options: InstanceOptions | None = None, prompt: str = "a blue bird", seed: int = 5) -> torch.Tensor:
    request = Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                      diffusion=DiffusionParams(seed=seed))
    (out,) = run_local(request, build_instance(card, options or InstanceOptions()))
    return out.frames


@pytest.fixture
def written(tmp_path: Path) -> tuple[ModelCard, Path]:
    out = tmp_path / "toy-fp8"
    return quantize_card(toy_card("toy-dit"), InstanceOptions(), "fp8_dynamic", out), out


def test_the_folder_holds_e4m3_targets_and_a_card_with_provenance(written: tuple[ModelCard, Path]) -> None:
    card, out = written
    source = toy_card("toy-dit")
    assert card.model_id == "toy-dit-fp8_dynamic" and card.recipe.assumes_precision == "fp8_dynamic"
    q = card.recipe.quantized_from
    assert q is not None and (q.model_id, q.weights_version, q.path, q.components) == ("toy-dit", "toy-seeded", "fp8_dynamic", ("dit",))
    assert card.recipe.parents == ("toy-dit",) and q.tool.startswith("fv quantize")
    assert json.loads((out / "fv-card.json").read_text())["recipe"]["quantized_from"]["path"] == "fp8_dynamic"
    # Only the quantized component moved to files; the others keep their seeds.
    assert card.checkpoint.components["dit"].random_init_seed is None and card.checkpoint.components["dit"].subfolder == "dit"
    assert card.checkpoint.components["lm"].random_init_seed == source.checkpoint.components["lm"].random_init_seed
    targets = set(fp8_target_paths(source, "dit", ToyDiT()))
    with safe_open(str(out / "dit" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["fv_quantized_from"] == "toy-dit" and f.metadata()["fv_precision_path"] == "fp8_dynamic"
        for target in targets:
            assert f.get_tensor(f"{target}.weight").dtype == torch.float8_e4m3fn
            scale = f.get_tensor(f"{target}.weight_scale")
            assert scale.dtype == torch.float32 and scale.dim() == 1
        assert f.get_tensor("proj_in.weight").dtype == torch.float32  # a native linear stays as it was
    assert {k.rsplit(".", 1)[0] for k in keys if k.endswith("weight_scale")} == targets
    # The stored weights are the reference quantization of the original's: absmax/448 per output channel.
    original = build_instance(source).component("dit").get_submodule("blocks.0.qkv").weight.float()
    with safe_open(str(out / "dit" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        w, s = f.get_tensor("blocks.0.qkv.weight"), f.get_tensor("blocks.0.qkv.weight_scale")
    assert torch.allclose(s, original.abs().amax(dim=1) / 448.0)
    assert torch.equal(w, (original / s[:, None]).to(torch.float8_e4m3fn))


def test_loading_it_back_quantizes_nothing_and_is_bit_identical(written: tuple[ModelCard, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _, out = written
    at_load = video(toy_card("toy-dit"), InstanceOptions(precision_path="fp8_dynamic"))

    def no_quantizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fp8 card was quantized again at load")

    # Every weight quantization goes through Fp8Linear.from_linear (activations' rows are quantized per call).
    monkeypatch.setattr(Fp8Linear, "from_linear", classmethod(no_quantizing))
    card = read_card_file_beside(out)
    instance = build_instance(card)
    assert instance.precision_path == "fp8_dynamic"
    assert isinstance(instance.component("dit").get_submodule("blocks.0.qkv"), Fp8Linear)
    assert torch.equal(video(card), at_load)
    # Negative controls: quantizing at load is caught by the patch, and native weights differ.
    with pytest.raises(AssertionError, match="quantized again"):
        video(toy_card("toy-dit"), InstanceOptions(precision_path="fp8_dynamic"))
    monkeypatch.undo()
    assert not torch.equal(video(toy_card("toy-dit")), at_load)


def test_the_quantized_card_refuses_a_path_its_weights_were_not_written_for(written: tuple[ModelCard, Path]) -> None:
    card = read_card_file_beside(written[1])
    with pytest.raises(RecipeMismatch) as info:
        build_instance(card, InstanceOptions(precision_path="native"))
    assert info.value.param == "precision_path"
    # Under an override the stored fp8 weights still load, as fp8_weights (what the file holds).
    overridden = build_instance(card, InstanceOptions(precision_path="native", allow_recipe_mismatch=True))
    layer = overridden.component("dit").get_submodule("blocks.0.qkv")
    assert isinstance(layer, Fp8Linear) and layer.mode == "fp8_weights"


def test_bad_asks_are_typed_errors_and_write_nothing(tmp_path: Path, written: tuple[ModelCard, Path]) -> None:
    card = toy_card("toy-dit")
    with pytest.raises(InvalidRequest) as info:
        quantize_card(card, InstanceOptions(), "fp8_attention", tmp_path / "a")
    assert info.value.param == "precision_path" and info.value.allowed == ("fp8_weights", "fp8_dynamic")
    with pytest.raises(InvalidRequest) as info:
        quantize_card(toy_card("toy-lm"), InstanceOptions(), "fp8_weights", tmp_path / "b")
    assert info.value.param == "precision_path" and "does not list" in info.value.message
    with pytest.raises(QuantizeError) as exists:
        quantize_card(card, InstanceOptions(), "fp8_weights", written[1])
    assert exists.value.param == "output"
    with pytest.raises(InvalidRequest, match="already quantized"):
        quantize_card(read_card_file_beside(written[1]), InstanceOptions(), "fp8_dynamic", tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c", "a.partial", "c.partial"))


def test_fv_quantize_cli_writes_a_card_fv_generate_runs(tmp_path: Path) -> None:
    card_file = tmp_path / "toy-dit.json"
    card_file.write_text(toy_card("toy-dit").model_dump_json())
    out = tmp_path / "q"
    done = CliRunner().invoke(app, ["quantize", "--model", str(card_file), "--precision-path", "fp8_weights", "--output", str(out)])
    assert done.exit_code == 0, done.output
    assert "toy-dit-fp8_weights" in done.output and (out / "fv-card.json").is_file()
    video_file = tmp_path / "v.mp4"
    ran = CliRunner().invoke(app, ["generate", "--model", str(out), "--prompt", "a red fox", "-q", "--output", str(video_file)])
    assert ran.exit_code == 0, ran.output
    assert video_file.stat().st_size > 0
    named = CliRunner().invoke(app, ["quantize", "--model", str(card_file), "--precision-path", "fp8_dynamic", "--output",
                                     str(tmp_path / "n"), "--model-id", "toy-dit-f8"])
    assert named.exit_code == 0 and read_card_file_beside(tmp_path / "n").model_id == "toy-dit-f8"
    bad = CliRunner().invoke(app, ["quantize", "--model", str(card_file), "--precision-path", "fp8", "--output", str(tmp_path / "x")])
    assert bad.exit_code == 2 and bad.output.startswith("error: precision_path") and "fp8_weights" in bad.output


def test_a_checkpoint_folder_is_written_in_its_layout_with_its_other_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A card whose weights are files: the quantized component replaces its weights, the rest is copied."""
    from safetensors.torch import save_file

    from fv_kernel.testing.toy import build_component

    source = tmp_path / "src"
    for component, seed in (("dit", 1), ("decoder", 2)):
        (source / component).mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in build_component(component, seed).state_dict().items()},
                  str(source / component / "diffusion_pytorch_model.safetensors"))
        (source / component / "config.json").write_text(json.dumps({"component": component}))
    (source / "model_index.json").write_text("{}")
    (source / "tokenizer").mkdir()  # a folder that is no component's, as a tokenizer's or a scheduler's is
    (source / "tokenizer" / "tokenizer.json").write_text('{"vocab": {}}')
    seeded = toy_card("toy-dit")
    data = seeded.model_dump()
    data["checkpoint"]["source"] = str(source)
    for component in ("dit", "decoder"):
        data["checkpoint"]["components"][component].update(random_init_seed=None, subfolder=component)
    from_files = ModelCard.model_validate(data)
    assert torch.equal(video(from_files), video(seeded))  # the files hold the seeded weights

    out = tmp_path / "q"
    card = quantize_card(from_files, InstanceOptions(), "fp8_weights", out)
    assert (out / "model_index.json").read_text() == "{}"
    assert (out / "tokenizer" / "tokenizer.json").read_text() == '{"vocab": {}}'
    assert json.loads((out / "dit" / "config.json").read_text()) == {"component": "dit"}
    assert (out / "decoder" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        source / "decoder" / "diffusion_pytorch_model.safetensors").read_bytes()
    with safe_open(str(out / "dit" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert f.get_tensor("blocks.0.o.weight").dtype == torch.float8_e4m3fn
    assert card.checkpoint.source == str(out.resolve())
    at_load = video(from_files, InstanceOptions(precision_path="fp8_weights"))
    monkeypatch.setattr(Fp8Linear, "from_linear", classmethod(lambda *a, **k: pytest.fail("quantized again")))
    assert torch.equal(video(read_card_file_beside(out)), at_load)


def test_preflight_charges_the_stored_fp8_weights_one_byte_each(written: tuple[ModelCard, Path]) -> None:
    from fv_kernel.model.preflight import preflight

    card = read_card_file_beside(written[1])
    assert card.checkpoint.layout == "diffusers"  # the seeded weights are files now
    dit = ToyDiT()
    targets = fp8_target_paths(toy_card("toy-dit"), "dit", dit)
    fp8 = sum(dit.get_submodule(t).weight.numel() for t in targets)
    # Everything else in the file (biases, scales, native linears) is charged at the card's fp32.
    rest = sum(t.numel() for t in dit.state_dict().values()) - fp8 + sum(dit.get_submodule(t).out_features for t in targets)
    report = preflight(card, InstanceOptions())
    assert sorted((c.precision, c.elements) for c in report.components) == sorted([("fp8_e4m3", fp8), ("fp32", rest)])
    assert report.weights_bytes == fp8 + 4 * rest
