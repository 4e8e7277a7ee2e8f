"""ComfyUI's fp8 Wan files load with their own scales (precision.md §2): the legacy ``*_fp8_scaled``
layout, the current ``comfy_quant`` layout (per-layer JSON tensors or the header's
``_quantization_metadata``) and ``*_fp8_e4m3fn`` (no scales). Each test writes a tiny file in the
layout from wan-tiny's seeded weights and checks it against the dequantized weights loaded as fp32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from fv_wan.instance import load_transformer
from safetensors.torch import save_file
from tiny_wan_checkpoints import TO_ORIGINAL

from fv_kernel.api import (
    Fp8Error,
    Fp8Linear,
    InstanceOptions,
    InvalidRequest,
    fp8_target_paths,
)

CARD = "wan-tiny"
PREFIX = "model.diffusion_model."  # ComfyUI's single-file wrapper
TARGET = re.compile(r"blocks\.\d+\.(attn[12]\.to_(q|k|v|out\.0)|ffn\.net\.(0\.proj|2))\.weight")
E4M3 = torch.float8_e4m3fn


def _original(key: str) -> str:
    for pattern, replacement in TO_ORIGINAL:
        key = re.sub(pattern, replacement, key)
    return PREFIX + key


def _native(card: Any) -> dict[str, torch.Tensor]:
    model = load_transformer(card, "transformer", InstanceOptions(precision="fp32"))
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("rope.")}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-tensor e4m3 weight as ComfyUI's converters write it (written here, not by fv)."""
    scale = w.abs().max() / 448.0
    return (w / scale).to(E4M3), scale.reshape(1).float()


def _write(root: Path, card: Any, layout: str, **extra: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """``root`` with a ``transformer/`` of wan-tiny in ``layout``; and the dequantized fp32 weights
    (diffusers names) the file stands for."""
    native = _native(card)
    file: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    layers: dict[str, Any] = {}
    for key, tensor in native.items():
        name = _original(key)
        if not TARGET.fullmatch(key):
            file[name], dequantized[key] = tensor, tensor
            continue
        layer = name[: -len(".weight")]
        if layout == "e4m3fn":
            q = tensor.clamp(-448, 448).to(E4M3)
            file[name], dequantized[key] = q, q.float()
            continue
        q, scale = _quantize(tensor)
        file[name], dequantized[key] = q, q.float() * scale
        if layout == "scaled_fp8":
            file[f"{layer}.scale_weight"] = scale
            file[f"{layer}.scale_input"] = torch.ones(())
        else:
            file[f"{layer}.weight_scale"] = scale.reshape(())
            conf = {"format": extra.get("format", "float8_e4m3fn")}
            if extra.get("header"):
                layers[layer] = conf
            else:
                file[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    if layout == "scaled_fp8":
        file["scaled_fp8"] = torch.empty(0, dtype=extra.get("marker_dtype", E4M3))
    if layers:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    folder = root / "transformer"
    folder.mkdir(parents=True)
    save_file(file, str(folder / "wan_tiny_fp8.safetensors"), metadata=metadata or None)
    spec = card.components["transformer"].config
    (folder / "config.json").write_text(json.dumps(dict(spec)))
    return root, dequantized


def _reference_root(root: Path, card: Any, weights: dict[str, torch.Tensor]) -> Path:
    folder = root / "transformer"
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(card.components["transformer"].config)))
    return root


def _inputs(model: Any) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    c = model.config
    x = torch.randn(1, c.in_channels, 2, 8, 8, generator=g)
    return x, torch.tensor([500.0]), torch.randn(1, 8, c.text_dim, generator=g)


def _load(card: Any, root: Path, path: str, precision: str = "fp32") -> Any:
    return load_transformer(card, "transformer", InstanceOptions(precision=precision, source=str(root)), precision_path=path)


@pytest.mark.parametrize("layout, extra", [
    ("scaled_fp8", {}), ("comfy_quant", {}), ("comfy_quant", {"header": True}), ("e4m3fn", {}),
])
def test_fp8_file_loads_bit_exact_and_matches_dequantized_reference(tmp_path, wan_card, layout, extra) -> None:
    card = wan_card(CARD)
    root, dequantized = _write(tmp_path / "fp8", card, layout, **extra)
    model = _load(card, root, "fp8_weights")
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(fp8) == sorted(k[: -len(".weight")] for k in dequantized if TARGET.fullmatch(k))
    # The file's bytes and scale, as they are (no dequantize -> requantize round trip).
    from safetensors.torch import load_file

    file = load_file(str(root / "transformer" / "wan_tiny_fp8.safetensors"))
    name = "blocks.1.attn2.to_out.0"
    stored = file[_original(f"{name}.weight")]
    assert torch.equal(fp8[name].weight.view(torch.uint8), stored.view(torch.uint8))
    assert fp8[name].weight_scale.dim() == 0
    if layout != "e4m3fn":
        scale_key = "scale_weight" if layout == "scaled_fp8" else "weight_scale"
        assert fp8[name].weight_scale.item() == file[_original(f"{name}.weight")[: -len("weight")] + scale_key].item()
    else:
        assert fp8[name].weight_scale.item() == 1.0
    assert model.scale_shift_table.dtype == torch.float32 and not isinstance(model.proj_out, Fp8Linear)

    reference = _load(card, _reference_root(tmp_path / "ref", card, dequantized), "native")
    with torch.no_grad():
        got, want = model(*_inputs(model)), reference(*_inputs(reference))
    # Dequantize-then-fp32-matmul is Fp8Linear's torch kernel: equal to fp32 rounding.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The native path dequantizes the file's layers into plain linears: the same weights exactly.
    native = _load(card, root, "native")
    assert not any(isinstance(m, Fp8Linear) for m in native.modules())
    assert torch.equal(native.blocks[1].attn2.to_out[0].weight, dequantized[f"{name}.weight"])


@pytest.mark.parametrize("layout", ["scaled_fp8", "comfy_quant"])
def test_a_loader_ignoring_the_scale_gives_garbage(tmp_path, wan_card, monkeypatch, layout) -> None:
    """Negative control (precision.md §2, stable-diffusion.cpp#1898): a scale dropped at load is caught."""
    card = wan_card(CARD)
    root, dequantized = _write(tmp_path / "fp8", card, layout)
    reference = _load(card, _reference_root(tmp_path / "ref", card, dequantized), "native")
    with torch.no_grad():
        want = reference(*_inputs(reference))
    import fv_wan.fp8 as fp8_module

    monkeypatch.setattr(fp8_module, "_scale_tensor", lambda scale, weight, key: torch.ones(()))
    broken = _load(card, root, "fp8_weights")
    with torch.no_grad():
        got = broken(*_inputs(broken))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - want).norm() / want.norm() > 0.1


def test_fp8_file_at_fp8_dynamic_and_card_precision(tmp_path, wan_card) -> None:
    card = wan_card(CARD)
    root, _ = _write(tmp_path / "fp8", card, "scaled_fp8")
    model = _load(card, root, "fp8_dynamic", precision="bf16")
    layer = model.blocks[0].ffn.net[2]
    assert isinstance(layer, Fp8Linear) and layer.mode == "fp8_dynamic"
    assert layer.weight.dtype == E4M3 and layer.weight_scale.dtype == torch.float32  # not cast to bf16
    assert model.blocks[0].attn1.to_q.bias.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(*(t.to(torch.bfloat16) if t.is_floating_point() and t.dim() > 1 else t for t in _inputs(model)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_quantize_at_load_takes_the_card_targets_only(wan_card) -> None:
    card = wan_card(CARD)
    model = load_transformer(card, "transformer", InstanceOptions(precision="fp32"), precision_path="fp8_weights")
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear))
    assert fp8 == sorted(fp8_target_paths(card, "transformer", model))
    assert len(fp8) == 10 * len(model.blocks)
    assert all(m.weight_scale.dim() == 1 for n, m in model.named_modules() if isinstance(m, Fp8Linear))  # per channel
    assert not any(m.training for m in model.modules())  # the quantized layers take the loaded model's eval mode
    for native in ("condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1", "proj_out"):
        assert type(model.get_submodule(native)) is torch.nn.Linear


def test_fp8_errors_name_the_field_and_allowed_values(tmp_path, wan_card) -> None:
    card = wan_card(CARD)
    with pytest.raises(InvalidRequest, match="precision_path.*allowed: native, fp8_weights"):
        load_transformer(card, "transformer", InstanceOptions(), precision_path="fp4")
    root, _ = _write(tmp_path / "nvfp4", card, "comfy_quant", format="nvfp4")
    with pytest.raises(Fp8Error, match="'nvfp4' cannot be loaded; allowed: float8_e4m3fn"):
        _load(card, root, "fp8_weights")
    root, _ = _write(tmp_path / "e5m2", card, "scaled_fp8", marker_dtype=torch.float8_e5m2)
    with pytest.raises(Fp8Error, match="float8_e5m2 cannot be loaded; allowed: float8_e4m3fn"):
        _load(card, root, "fp8_weights")


def _frames(card: Any, options: InstanceOptions, prompt: str, *, steps: int | None = None, seed: int = 2,
            fresh_memory: bool = False) -> torch.Tensor:
    """One text-to-video request's frames; ``fresh_memory``: the transformer's parameters copied to newly allocated
    memory first (tensors read from a file sit at other alignments, which CPU GEMMs sum in another order)."""
    from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, build_instance, run_local

    instance = build_instance(card, options)
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    if fresh_memory:
        with torch.no_grad():
            for param in instance.component("transformer").parameters():
                param.data = param.data.clone()
    request = Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                      diffusion=DiffusionParams(seed=seed, steps=steps))
    (video,) = run_local(request, instance)
    return video.frames


def test_fv_quantize_of_wan_toy_loads_back_as_the_same_fp8_layers(tmp_path) -> None:
    """``fv quantize`` writes per-channel ``weight_scale`` keys; fv-wan's loader takes them as they
    are: the same e4m3 bytes and scales as quantizing wan-toy at load, and nothing quantized again."""
    from fv_wan.toy_card import wan_toy_card
    from typer.testing import CliRunner

    from fv_kernel.api import build_instance, read_card_file_beside
    from fv_kernel.cli.app import app

    toy = wan_toy_card()
    if toy is None:
        pytest.skip("wan-toy's weights are not installed")
    out = tmp_path / "wan-toy-fp8"
    result = CliRunner().invoke(app, ["quantize", "--model", "wan-toy", "--precision-path", "fp8_weights", "--output", str(out)])
    assert result.exit_code == 0, result.output
    loaded = build_instance(read_card_file_beside(out), InstanceOptions()).component("transformer")
    at_load = build_instance(toy, InstanceOptions(precision_path="fp8_weights")).component("transformer")
    want = {n: m for n, m in at_load.named_modules() if isinstance(m, Fp8Linear)}
    got = {n: m for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(got) == sorted(want) and len(got) == 10 * len(at_load.blocks)
    for name, module in got.items():
        assert module.mode == "fp8_weights" and module.weight_scale.shape == (module.out_features,)
        assert torch.equal(module.weight.view(torch.uint8), want[name].weight.view(torch.uint8))
        assert torch.equal(module.weight_scale, want[name].weight_scale)
    # The whole card runs from the folder: its tokenizer and scheduler folders (no component's) were copied too
    # (before, the written card's text encoder found no tokenizer and fv generate failed).
    assert (out / "tokenizer" / "tokenizer.json").exists() and (out / "scheduler" / "scheduler_config.json").exists()
    # The same bytes read from a file sit at other memory alignments than freshly quantized ones, which CPU GEMMs
    # sum in another order (4 guided steps grow that to ~3e-5); with every parameter in fresh memory, bit for bit.
    written, at_load = read_card_file_beside(out), InstanceOptions(precision_path="fp8_weights")
    toy_prompt, steps = "a red circle moves left quickly on a black background", 4
    assert (_frames(written, InstanceOptions(), toy_prompt, steps=steps) - _frames(toy, at_load, toy_prompt, steps=steps)
            ).abs().max() <= 1e-3
    assert torch.equal(_frames(written, InstanceOptions(), toy_prompt, steps=steps, fresh_memory=True),
                       _frames(toy, at_load, toy_prompt, steps=steps, fresh_memory=True))


def test_fv_quantize_of_a_seeded_card_loads_back_and_generates_as_quantizing_at_load(tmp_path, wan_card) -> None:
    """wan-tiny's weights are seeded, not files. ``fv quantize`` writes its transformer as files (with the card's
    config as ``config.json``) and keeps its VAE and text encoder seeded beside them; the written card loads (before:
    ``fv generate`` on the folder failed on the missing ``transformer/config.json``, then on looking for the seeded
    VAE's folder) and generates what quantizing at load generates. Its weights are those bytes exactly; the video
    agrees to fp32 rounding, and bit for bit once the loaded parameters are copied to fresh memory: tensors read from
    a safetensors file sit at other memory alignments than freshly allocated ones, and CPU GEMMs sum those in
    another order."""
    from fv_kernel.api import read_card_file_beside
    from fv_kernel.model.quantize import quantize_card

    card = wan_card(CARD)
    out = tmp_path / "wan-tiny-fp8"
    written = quantize_card(card, InstanceOptions(), "fp8_weights", out)
    config = json.loads((out / "transformer" / "config.json").read_text())
    assert config == json.loads(json.dumps(card.components["transformer"].config))
    assert not (out / "vae").exists() and not (out / "text_encoder").exists()
    seeds = {c: s.random_init_seed for c, s in written.checkpoint.components.items()}
    assert seeds["transformer"] is None and seeds["vae_decoder"] == card.checkpoint.components["vae_decoder"].random_init_seed

    loaded = read_card_file_beside(out)
    at_load = _frames(card, InstanceOptions(precision_path="fp8_weights"), "a red fox")
    assert (_frames(loaded, InstanceOptions(), "a red fox") - at_load).abs().max() <= 1e-5
    # ``fv generate --model FOLDER`` names the card's own folder as the source: the seeded parts stay seeded.
    assert torch.equal(_frames(loaded, InstanceOptions(source=str(out)), "a red fox"), _frames(loaded, InstanceOptions(), "a red fox"))
    assert torch.equal(_frames(loaded, InstanceOptions(), "a red fox", fresh_memory=True), at_load)


def test_fv_quantize_of_wan_toy_causal_streams_a_session(tmp_path) -> None:
    """The quantized causal card's folder runs on its own: a session streams from it (``fv realtime --model DIR``)."""
    from fv_wan.toy_card import wan_toy_causal_card

    import fv_kernel as fv
    from fv_kernel.model.quantize import quantize_card

    causal = wan_toy_causal_card()
    if causal is None:
        pytest.skip("wan-toy-causal's weights are not installed")
    out = tmp_path / "wan-toy-causal-fp8"
    quantize_card(causal, InstanceOptions(), "fp8_weights", out)
    with fv.load(str(out)).session("a red circle moves left quickly on a navy background", seed=1, max_chunks=2) as session:
        chunks = list(session)
    assert len(chunks) == 2 and all(chunk.frames.shape[-2:] == (64, 64) for chunk in chunks)
