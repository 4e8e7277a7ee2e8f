"""The Wan VAE decoder's fused norm + SiLU and its memory-lean decode.

- ``channel_rms_norm_silu``: the torch reference equals the decoder's eager norm then SiLU bit
  for bit; the Triton kernel equals the reference (fp32 under Triton's interpreter, rel < 1e-6;
  bf16 on CUDA, rel < 1e-2) on channels-last, contiguous and padded-buffer-view layouts, and
  the comparison catches a norm over the wrong axis and a dropped SiLU (negative controls).
- The whole decoder with fused ops equals eager: bitwise with the torch reference, within
  1e-5 relative with the Triton kernel (every norm + SiLU going through it).
- The kernel compiles for sm_90 (Triton's compiler and its wheel's ptxas, no GPU) at the
  decoder's widths with 16-byte loads and stores and no spills; a 5-channel layout gets no
  wide accesses (negative control). How fast it runs needs a GPU (bench/bench_vae_decode.py).
- The decode's activation peak (storage bytes alive at once, counted op by op) stays below
  the residual block that holds conv1's padded input while conv2's is built, and below the
  stage loop that keeps a stage's input alive (negative controls); frame-chunked decoding is
  bitwise the whole-step decode in fp32 and lowers that peak.

The Triton checks run on CUDA when there is one, else in a fresh Python under
``TRITON_INTERPRET=1`` (see ``fv_kernel.testing.triton_checks``).
"""

from __future__ import annotations

import json
import re
import sys
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fv_kernel.compute.fused import FusedOps, TorchFusedOps, TritonFusedOps
from fv_kernel.testing.triton_checks import compile_for_sm90, run_kernel_checks
from fv_wan.models import vae_blocks
from fv_wan.models.vae import WanVAE, WanVAEConfig
from tiny_vae_configs import CFG21, CFG22, seeded_vae

BENCH = Path(__file__).resolve().parents[3] / "bench"



def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


_vae = seeded_vae


def _latent(cfg: WanVAEConfig, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(1, cfg.z_dim, 3, 4, 6, generator=torch.Generator().manual_seed(2)).to(device, dtype)


def _norm_calls(cfg: WanVAEConfig, latent_frames: int) -> int:
    """Norm + SiLU passes of one decode: two per residual block and the output norm, per latent frame."""
    blocks = sum(isinstance(m, vae_blocks.ResidualBlock) for m in WanVAE(cfg).decoder.modules())
    return (2 * blocks + 1) * latent_frames


# --------------------------------------------------------------------------- eager = torch reference


@pytest.mark.parametrize("cfg", [CFG21, CFG22], ids=["2.1", "2.2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_fused_decode_is_bitwise_eager(cfg: WanVAEConfig, dtype: torch.dtype) -> None:
    vae = _vae(cfg, dtype)
    z = _latent(cfg, dtype=dtype)
    with torch.no_grad():
        eager = vae.decode(z)
        vae.set_fused_ops(TorchFusedOps())
        fused = vae.decode(z)
    assert torch.equal(eager, fused)


def test_eager_is_the_default_and_training_stays_eager() -> None:
    vae = _vae(CFG21)
    assert vae.decoder.fused_ops is None
    assert all(m.fused_ops is None for m in vae.decoder.modules() if isinstance(m, vae_blocks.ResidualBlock))

    class Refuses(TorchFusedOps):
        def channel_rms_norm_silu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("a fused kernel ran while autograd was recording")

    vae.set_fused_ops(Refuses())
    vae.requires_grad_(True)
    video = vae.decode(_latent(CFG21))  # autograd records: the eager (differentiable) path
    video.sum().backward()
    assert vae.decoder.conv_in.weight.grad is not None


def test_instance_fuses_the_decoder_with_the_dits_switch() -> None:
    from fv_kernel.model.options import InstanceOptions
    from fv_kernel.compute.compile import ComputeOptions
    from fv_wan.cards import wan_cards
    from fv_wan.instance import build_wan_instance

    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    inputs = {"z": torch.randn(1, 16, 1, 4, 6, generator=torch.Generator().manual_seed(3))}
    videos = {}
    for label, compute in (("default", None), ("off", ComputeOptions(fused_ops="off")),
                           ("torch", ComputeOptions(fused_ops="torch"))):
        instance = build_wan_instance(card, InstanceOptions(), compute)
        decoder = instance.component("vae_decoder").decoder
        assert isinstance(decoder.fused_ops, TorchFusedOps) == (label == "torch"), label
        assert label == "torch" or decoder.fused_ops is None
        with torch.no_grad():
            videos[label] = instance.op("vae_decode_frame").fn(inputs, {"last": True})["frames"]
    assert torch.equal(videos["torch"], videos["default"]) and torch.equal(videos["off"], videos["default"])


def test_encoder_half_refuses_fused_ops() -> None:
    vae = _vae(CFG21)
    vae.decoder = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no decoder"):
        vae.set_fused_ops(TorchFusedOps())


def test_op_refuses_bad_shapes_by_name() -> None:
    ops = TorchFusedOps()
    x = torch.randn(1, 4, 2, 3, 3)
    with pytest.raises(ValueError, match=r"\(B, C, T, H, W\)"):
        ops.channel_rms_norm_silu(x[0], torch.ones(4), 2.0)
    with pytest.raises(ValueError, match="gamma has 3 elements, x has 4 channels"):
        ops.channel_rms_norm_silu(x, torch.ones(3), 2.0)
    with pytest.raises(ValueError, match="out must match x"):
        ops.channel_rms_norm_silu(x, torch.ones(4), 2.0, out=torch.empty(1, 4, 2, 3, 3, dtype=torch.float64))


# --------------------------------------------------------------------------- Triton kernel


class _NormOverWidth(TorchFusedOps):
    """Wrong reference: L2 norm over the last (W) axis instead of channels."""

    def channel_rms_norm_silu(self, x, gamma, scale, out=None):  # type: ignore[no-untyped-def]
        y = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12) * (gamma * scale).reshape(-1, 1, 1, 1)
        return F.silu(y)


class _SiluDropped(TorchFusedOps):
    """Wrong reference: the norm without its SiLU."""

    def channel_rms_norm_silu(self, x, gamma, scale, out=None):  # type: ignore[no-untyped-def]
        y = x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-12) * (gamma * scale).reshape(-1, 1, 1, 1)
        return y


def _op_mismatches(fused: FusedOps, ref: FusedOps, device: str) -> dict[str, float]:
    """Each layout whose kernel output differs from ``ref`` beyond tolerance, with its relative error."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    g = torch.Generator().manual_seed(7)
    errors: dict[str, float] = {}
    for channels in (12, 5):  # a power of two's worth of lanes masked, and an odd count
        x = (3 * torch.randn(2, channels, 3, 5, 7, generator=g)).to(device, dtype)
        gamma = (1 + 0.3 * torch.randn(channels, 1, 1, 1, generator=g)).to(device, dtype)
        scale = channels**0.5
        want = ref.channel_rms_norm_silu(x, gamma, scale)
        cl = x.to(memory_format=torch.channels_last_3d)
        errors[f"c{channels}.channels_last"] = _rel(fused.channel_rms_norm_silu(cl, gamma, scale), want)
        errors[f"c{channels}.contiguous"] = _rel(fused.channel_rms_norm_silu(x.contiguous(), gamma, scale), want)
        # The decoder's use: write into the new-frame view of a conv's time-padded channels-last buffer.
        buffer = torch.full((2, channels, 5, 5, 7), 7.0, device=device, dtype=dtype).to(memory_format=torch.channels_last_3d)
        fused.channel_rms_norm_silu(cl, gamma, scale, out=buffer[:, :, 2:])
        errors[f"c{channels}.buffer_view"] = _rel(buffer[:, :, 2:], want)
        errors[f"c{channels}.buffer_padding_untouched"] = float((buffer[:, :, :2] != 7.0).sum())
    return {name: err for name, err in errors.items() if not err < tol}


def kernel_checks(device: str) -> dict[str, Any]:
    """The kernel against the reference and the wrong references, and the decoders with it against eager."""
    triton_ops = TritonFusedOps()
    out: dict[str, Any] = {"interpreted": triton_ops.interpreted}
    out["reference"] = _op_mismatches(triton_ops, TorchFusedOps(), device)
    out["norm_over_width"] = _op_mismatches(triton_ops, _NormOverWidth(), device)
    out["silu_dropped"] = _op_mismatches(triton_ops, _SiluDropped(), device)

    calls: Counter[str] = Counter()
    run = triton_ops.channel_rms_norm_silu

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["channel_rms_norm_silu"] += 1
        return run(*args, **kwargs)

    triton_ops.channel_rms_norm_silu = counted  # type: ignore[method-assign]
    add_bias = triton_ops.channel_bias_add_

    def counted_bias(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["channel_bias_add_"] += 1
        return add_bias(*args, **kwargs)

    triton_ops.channel_bias_add_ = counted_bias  # type: ignore[method-assign]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for label, cfg in (("2.1", CFG21), ("2.2", CFG22)):
        vae = _vae(cfg, dtype, device)
        z = _latent(cfg, device, dtype)
        with torch.no_grad():
            eager = vae.decode(z)
            vae.set_fused_ops(triton_ops)
            calls.clear()
            fused = vae.decode(z)
        biased_convs = sum(1 for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d | torch.nn.Conv2d)
                           and m.bias is not None)
        out[f"decoder[{label}]"] = {"rel": _rel(fused, eager), "calls": calls["channel_rms_norm_silu"],
                                    "expected_calls": _norm_calls(cfg, z.shape[2]),
                                    "bias_calls": calls["channel_bias_add_"], "biased_convs": biased_convs,
                                    "tol": 2e-2 if dtype == torch.bfloat16 else 1e-5}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    results = run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="the VAE norm + SiLU kernel")
    assert torch.cuda.is_available() or results["interpreted"], "TRITON_INTERPRET=1 was set but Triton compiled for a GPU"
    return results


def test_triton_kernel_matches_reference(kernels: dict[str, Any]) -> None:
    assert kernels["reference"] == {}


@pytest.mark.parametrize("wrong", ["norm_over_width", "silu_dropped"])
def test_kernel_comparison_catches_a_wrong_formula(kernels: dict[str, Any], wrong: str) -> None:
    # Every layout of both channel counts differs from the wrong reference (padding is untouched either way).
    mismatched = {k for k in kernels[wrong] if not k.endswith("padding_untouched")}
    assert len(mismatched) == 6, kernels[wrong]


@pytest.mark.parametrize("label", ["2.1", "2.2"])
def test_triton_fused_decoder_matches_eager(kernels: dict[str, Any], label: str) -> None:
    result = kernels[f"decoder[{label}]"]
    assert result["rel"] < result["tol"], result
    # Meaningful only if every norm + SiLU of the decode really went through the kernel, and every conv's bias
    # through the bias kernel (each biased conv of the decoder runs at least once).
    assert result["calls"] == result["expected_calls"], result
    assert result["bias_calls"] >= result["biased_convs"] > 0, result


# --------------------------------------------------------------------------- compiled for sm_90 (no GPU)


def compile_sm90(channels: int, frames: int = 4, height: int = 480, width: int = 832) -> dict[str, int]:
    """PTX facts and ptxas's spill report for the kernel built for an H100/H200 (sm_90) on the CPU.

    Specialised as Triton's JIT specialises a launch on the decoder's bf16 channels-last
    activations at 480x832 (16-byte aligned pointers, integers divisible by 16 marked, the unit
    channel stride constant), writing into a padded conv buffer's new-frame view.
    """
    from fv_kernel.compute.fused import _build_kernels, triton_available

    if not triton_available():
        pytest.skip("needs triton")
    pixels = height * width
    values: dict[str, Any] = {
        "x_ptr": "*bf16", "out_ptr": "*bf16", "gain_ptr": "*bf16", "voxels": frames * pixels, "channels": channels,
        "frames": frames, "height": height, "width": width,
        "sx_b": channels * frames * pixels, "sx_c": 1, "sx_t": channels * pixels, "sx_h": channels * width, "sx_w": channels,
        "so_b": channels * (frames + 2) * pixels, "so_c": 1, "so_t": channels * pixels, "so_h": channels * width,
        "so_w": channels,
    }  # fmt: skip
    block_c = max(16, 1 << (channels - 1).bit_length())
    build = compile_for_sm90(_build_kernels()[2], values, {"BLOCK_V": max(1, 4096 // block_c), "BLOCK_C": block_c})
    return {
        "wide_loads": len(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.v4\.b32", build.ptx)),
        "wide_stores": len(re.findall(r"st\.global(?:\.[a-z0-9]+)*\.v4\.b32", build.ptx)),
        "spill_bytes": build.spill_bytes,
    }


@pytest.mark.parametrize("channels", [96, 192, 384])  # the Wan 2.1 decoder's widths
def test_kernel_compiles_for_sm90_with_16_byte_accesses_and_no_spills(channels: int) -> None:
    facts = compile_sm90(channels)
    assert facts["wide_loads"] > 0 and facts["wide_stores"] > 0, facts
    assert facts["spill_bytes"] == 0, facts


def test_negative_control_a_voxel_stride_not_16_byte_aligned_gets_no_wide_accesses() -> None:
    # 5 channels: a voxel's channels start at 10-byte steps, so nothing can be loaded 16 bytes at a time.
    facts = compile_sm90(5)
    assert facts["wide_loads"] == 0 and facts["wide_stores"] == 0, facts


# --------------------------------------------------------------------------- memory


def _activation_peak(vae: WanVAE, z: torch.Tensor) -> int:
    sys.path.insert(0, str(BENCH))
    try:
        from bench_vae_decode import activation_peak_bytes
    finally:
        sys.path.remove(str(BENCH))
    with torch.no_grad():
        return activation_peak_bytes(lambda: vae.decode(z))


def _holds_conv1_buffer(self: vae_blocks.ResidualBlock, x: torch.Tensor, cache: vae_blocks.SlotList) -> torch.Tensor:
    """The earlier residual block: conv1's padded input still referenced while conv2's is built."""
    shortcut = self.conv_shortcut(x)
    buffer, new_frames = self.conv1.input_buffer(x, cache)
    self.norm1.silu_into(x, new_frames)
    h = self.conv1.run_buffer(buffer, cache)
    buffer, new_frames = self.conv2.input_buffer(h, cache)
    self.norm2.silu_into(h, new_frames)
    del h
    return self.conv2.run_buffer(buffer, cache).add_(shortcut)


def test_residual_blocks_never_hold_two_padded_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    vae = _vae(CFG21)
    z = _latent(CFG21)
    lean = _activation_peak(vae, z)
    monkeypatch.setattr(vae_blocks.ResidualBlock, "forward", _holds_conv1_buffer)
    held = _activation_peak(vae, z)
    assert lean < 0.95 * held, (lean, held)


def test_decoder_releases_stage_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: running each 2.1 stage through ``UpBlock.forward`` (the caller keeps the
    stage's input alive) raises the peak; the decoder's own loop over the stage's layers does not."""
    vae = _vae(CFG21)
    z = _latent(CFG21)
    lean = _activation_peak(vae, z)
    monkeypatch.setattr(vae_blocks.UpBlock, "layers", lambda self: [lambda x, cache, _f=self._stage: _f(x, cache)])
    monkeypatch.setattr(vae_blocks.UpBlock, "_stage", lambda self, x, cache: _run_stage(self, x, cache), raising=False)
    held = _activation_peak(vae, z)
    assert lean < held, (lean, held)


def _run_stage(stage: vae_blocks.UpBlock, x: torch.Tensor, cache: vae_blocks.SlotList) -> torch.Tensor:
    for resnet in stage.resnets:
        x = resnet(x, cache)
    if stage.upsamplers is not None:
        x = stage.upsamplers[0](x, cache)
    return x


if __name__ == "__main__":  # the fresh-process interpreter run (TRITON_INTERPRET=1 set by the caller)
    torch.set_num_threads(1)
    print(json.dumps(kernel_checks("cpu")))


@pytest.mark.parametrize("cfg", [CFG21, CFG22], ids=["2.1", "2.2"])
def test_frame_chunked_decode_is_bitwise_the_whole_step_decode(cfg: WanVAEConfig) -> None:
    vae = _vae(cfg)
    z = torch.randn(1, cfg.z_dim, 4, 6, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = vae.decode(z)
        for chunk in (1, 2, 3):  # 3 leaves a remainder of 1 from a step's 4 frames
            for ops in (None, TorchFusedOps()):
                vae.set_decode_frame_chunk(chunk)
                vae.set_fused_ops(ops)
                assert torch.equal(vae.decode(z), whole), (chunk, ops)


def test_frame_chunked_decode_in_bf16_is_within_one_rounding() -> None:
    # The norms' fp32 reductions may add in another order on the smaller tensors; values stay within a bf16 ulp.
    vae = _vae(CFG22, torch.bfloat16)
    z = torch.randn(1, CFG22.z_dim, 4, 6, 8, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        whole = vae.decode(z).float()
        vae.set_decode_frame_chunk(1)
        chunked = vae.decode(z).float()
    assert (chunked - whole).abs().max() <= 2**-7


def test_frame_chunks_lower_the_activation_peak() -> None:
    vae = _vae(CFG21)
    z = torch.randn(1, CFG21.z_dim, 4, 6, 8, generator=torch.Generator().manual_seed(3))
    whole = _activation_peak(vae, z)
    vae.set_decode_frame_chunk(1)
    assert _activation_peak(vae, z) < 0.95 * whole


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_frame_chunk_refuses_bad_values_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="frame_chunk must be a positive int or None"):
        _vae(CFG21).set_decode_frame_chunk(bad)


# --------------------------------------------------------------------------- the bench script


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on CUDA the script measures for real")
def test_bench_skips_without_cuda_and_its_smoke_run_compares_all_three(tmp_path: Path) -> None:
    import subprocess

    script = str(BENCH / "bench_vae_decode.py")
    skipped = subprocess.run([sys.executable, script, str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 0 and "skipped" in skipped.stdout and not (tmp_path / "none").exists()
    smoke = subprocess.run([sys.executable, script, str(tmp_path), "--smoke"], capture_output=True, text=True, timeout=300)
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    result = json.loads((tmp_path / "vae_decode.json").read_text())
    assert result["fused_max_abs_diff_vs_eager"] == 0.0  # the torch reference ops on CPU
    assert result["fv_max_abs_diff_vs_diffusers"] < 1e-4
    # fv keeps less alive at once than diffusers (the figure docs/performance.md quotes)
    assert result["fv_eager"]["activation_peak_mib"] < result["diffusers"]["activation_peak_mib"]
    assert 0 < result["resident_mib"]["causal_cache"] < result["fv_eager"]["activation_peak_mib"]


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole-step", "frame-chunked"])
@pytest.mark.parametrize("halo", [False, True], ids=["untiled", "halo"])
def test_only_conv_outs_input_lives_through_conv_out(monkeypatch: pytest.MonkeyPatch, chunk: int | None, halo: bool) -> None:
    """The last stage's output is freed once the output norm has written conv_out's padded input: while
    conv_out runs, no caller frame still holds it (the untiled, frame-chunked and halo-tiled decodes)."""
    vae = _vae(CFG21)
    vae.set_decode_frame_chunk(chunk)
    stage_outputs: list[weakref.ref[torch.Tensor]] = []
    alive_during_conv_out: list[bool] = []
    real_buffer, real_run = vae_blocks.Decoder3d._output_buffer, vae_blocks.CachedCausalConv3d.run_buffer

    def output_buffer(self: vae_blocks.Decoder3d, x: torch.Tensor, *args: Any) -> torch.Tensor:
        stage_outputs.append(weakref.ref(x))
        return real_buffer(self, x, *args)

    def run_buffer(self: vae_blocks.CachedCausalConv3d, buffer: torch.Tensor, cache: Any) -> torch.Tensor:
        if self is vae.decoder.conv_out:
            alive_during_conv_out.append(stage_outputs[-1]() is not None)
        return real_run(self, buffer, cache)

    monkeypatch.setattr(vae_blocks.Decoder3d, "_output_buffer", output_buffer)
    monkeypatch.setattr(vae_blocks.CachedCausalConv3d, "run_buffer", run_buffer)
    from fv_wan.models.vae import HaloTiling

    with torch.no_grad():
        vae.decode(torch.randn(1, CFG21.z_dim, 3, 8, 12, generator=torch.Generator().manual_seed(3)),
                   halo=HaloTiling(columns=2) if halo else None)
    assert alive_during_conv_out and not any(alive_during_conv_out)
