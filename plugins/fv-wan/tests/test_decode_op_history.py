"""The decode op hands the causal history back in the activations' own layout.

Packing every slot to the default contiguous layout on the way out, and reading it back into
the channels-last conv buffers on the way in, cost 219 ms of a 16-step 448x832 decode on the
H200 (949 against 729 ms). Unpacked, the streamed decode is still ``WanVAE.decode`` bit for
bit, also when the history goes through ``torch.save`` between steps, as a paused request's
does. ``bench/bench_decode_op.py`` (which measures it) runs at tiny size here, every path
equal to the one-call decode.
"""

from __future__ import annotations

import io

import torch

from fv_kernel.api import InstanceOptions, build_instance
from fv_wan.cards import wan_cards

TINY = next(card for card in wan_cards() if card.model_id == "wan-tiny")


def _stream(op, z: torch.Tensor, *, through_disk: bool) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:  # type: ignore[no-untyped-def]
    history: dict[str, torch.Tensor] = {}
    frames, handed_back = [], []
    for k in range(z.shape[2]):
        last = k == z.shape[2] - 1
        out = op.fn({"z": z[:, :, k : k + 1], **{f"cache.{n}": v for n, v in history.items()}}, {"last": last})
        frames.append(out["frames"])
        history = {n[len("cache."):]: v for n, v in out.items() if n.startswith("cache.")}
        if not last:
            handed_back.append(history)
        if through_disk:
            buffer = io.BytesIO()
            torch.save(history, buffer)
            history = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    return torch.cat(frames, dim=2), handed_back


def test_decode_op_returns_history_unpacked_and_decodes_exactly() -> None:
    instance = build_instance(TINY, InstanceOptions(device="cpu", precision="fp32"))
    vae = instance.component("vae_decoder")
    op = instance.op("vae_decode_frame")
    z = torch.randn(1, vae.config.z_dim, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        streamed, handed_back = _stream(op, z, through_disk=False)
        resumed, _ = _stream(op, z, through_disk=True)
        whole = (vae.decode(vae.denormalize_latents(z)).float() / 2 + 0.5).clamp(0, 1)
    assert torch.equal(streamed, whole)
    assert torch.equal(resumed, whole)
    # The layouts the VAE itself keeps its history in, step by step (mostly channels-last).
    kept = []
    with torch.inference_mode():
        cache = vae.new_decode_cache()
        for k in range(z.shape[2] - 1):
            _, cache = vae.decode_step(vae.denormalize_latents(z[:, :, k : k + 1]), cache)
            kept.append({f"tile0.slot{s}": t.stride() for s, t in enumerate(cache.tiles[0]) if t is not None})
    channels_last = sum(t.ndim == 5 and t.shape[1] > 1 and not t.is_contiguous() for h in handed_back for t in h.values())
    assert channels_last, "the tiny VAE keeps channels-last history slots, which packing would copy"
    for step, (history, strides) in enumerate(zip(handed_back, kept)):
        repacked = {name: (history[name].stride(), stride) for name, stride in strides.items() if history[name].stride() != stride}
        assert not repacked, f"step {step}: history slots handed back in another layout than the VAE's: {repacked}"


def test_bench_decode_op_smoke_every_path_is_the_one_call_decode(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import importlib
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "bench"))
    bench = importlib.import_module("bench_decode_op")
    assert bench.main(["--smoke", "--json", str(tmp_path / "op.json")]) == 0
    rows = json.loads((tmp_path / "op.json").read_text())["rows"]
    assert set(rows) == set(bench.ROWS)
    assert all(row["max_abs_diff_vs_decode"] == 0.0 for row in rows.values()), rows
