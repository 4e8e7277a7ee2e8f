"""Does a CUDA-graph replay on new inputs equal eager on those inputs? A probe for the graphs tier.

    python bench/graph_replay_probe.py                      # wan-tiny, dense and under VSA, on CUDA
    python bench/graph_replay_probe.py --card fastwan2.1-t2v-1.3b --kernels --trajectory   # real size, random weights
    python bench/graph_replay_probe.py --card wan2.1-t2v-1.3b --attention sdpa_cudnn

(``wan-tiny``'s head dim is no multiple of 8, so the pinned cuDNN and flash drivers have no kernel
for it: probe those on a real-size card.)

One ``GraphedStep`` per model is captured on its first call and replayed on new latents, new
timesteps and new text context; each replay is compared with the eager forward on the same inputs.

- ``wan-tiny`` (default): its DiT dense, and with compression gates added (random) under VSA at
  sparsity 0.5 over (1, 2, 2) tiles, on a 5x16x16 latent and 24 text tokens.
- a real-size card (``--card``, seeded random weights): its DiT at the card's default size and 512
  text tokens, with the card's own attention (FastWan: VSA 0.8 over 4x4x4 tiles) and with dense
  ``--attention``.
- ``--kernels``: the attention kernels alone at the card's token count (12 heads of 128): each
  dense SDPA backend and the VSA driver, captured in a graph and replayed on new q/k/v.
- ``--trajectory``: the card's default request end to end through its loops with the graphs tier
  (``compute.cuda_graphs``) and the card's attention; every ``dit_forward`` call is checked
  against the eager model on the very inputs the loop gave it.

Off CUDA the step runs eager (``GraphedStep``'s fallback), so the errors are 0 by construction.
Exit status 1 when any replay differs from eager.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from fv_kernel.api import InstanceOptions, build_instance
from fv_kernel.model.instance import ModelInstance
from fv_kernel.card.spec import ModelCard
from fv_kernel.compute.compile import CompileCache, CompileKey, ComputeOptions, GraphedStep
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.compute.video_sparse_attention import VideoSparseAttention
from fv_kernel.runtime.local import run_local
from fv_wan.cards import wan_cards
from fv_wan.instance import dit_inputs
from fv_wan.models.transformer import WanTransformer
from bench_tier_parity import wrap_dit_forwards  # bench/, beside this script
from random_weights import wan_card_for_device

Latent = tuple[int, int, int]


def _report(label: str, eager: torch.Tensor, graphed: torch.Tensor, step: GraphedStep) -> float:
    error = ((graphed.float() - eager.float()).norm() / eager.float().norm()).item()
    print(f"  {label:24s} graph vs eager {error:.3e} (replays {step.replays}, eager calls {step.eager_calls})", flush=True)
    return error


def probe_model(name: str, model: WanTransformer, latent: Latent, context_len: int, device: str, backend: str) -> float:
    """The worst relative error of a graph replay against eager, over five input sets."""
    config = model.config
    generator = torch.Generator(device=device)

    def inputs(seed: int, t: float) -> dict[str, torch.Tensor]:
        generator.manual_seed(seed)
        return {"x": torch.randn(1, config.in_channels, *latent, device=device, generator=generator).bfloat16(),
                "t": torch.tensor([t], device=device),
                "context": torch.randn(1, context_len, config.text_dim, device=device, generator=generator).bfloat16()}

    def forward(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"v": model(batch["x"], batch["t"], batch["context"], None).float()}

    step = GraphedStep(forward, key_base=CompileKey(model="probe", component=name, precision="bf16",
                                                    backend=backend, tier="graphs"), cache=CompileCache())
    print(f"{name} ({backend}, latent {list(latent)}, {context_len} text tokens, {device}):", flush=True)
    worst = 0.0
    with torch.inference_mode():
        for label, batch in (("capture inputs", inputs(1, 1000.0)), ("new x, same t", inputs(2, 1000.0)),
                             ("new x, new t", inputs(3, 757.0)), ("new x, new t again", inputs(4, 522.0)),
                             ("capture inputs again", inputs(1, 1000.0))):
            eager = forward(batch)["v"]
            worst = max(worst, _report(label, eager, step(batch)["v"], step))
    del step
    torch.cuda.empty_cache()  # a no-op without CUDA
    return worst


def probe_kernels(tokens: Latent, device: str) -> float:
    """Each attention kernel alone, captured at ``tokens`` (a (T, H, W) token grid) and replayed."""
    length = math.prod(tokens)
    kernels: dict[str, Callable[..., torch.Tensor]] = {}
    for label, backend in (("sdpa cudnn", "CUDNN_ATTENTION"), ("sdpa flash", "FLASH_ATTENTION"),
                           ("sdpa efficient", "EFFICIENT_ATTENTION")):
        kind = getattr(torch.nn.attention.SDPBackend, backend)

        def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, kind=kind) -> torch.Tensor:
            with torch.nn.attention.sdpa_kernel([kind]):
                return F.scaled_dot_product_attention(q, k, v)

        kernels[label] = dense
    vsa = VideoSparseAttention(sparsity=0.8, tile=(4, 4, 4))
    kernels["vsa 0.8 4x4x4"] = lambda q, k, v, g: vsa.attend_video(q, k, v, grid=tokens, gate=g)
    generator = torch.Generator(device=device)

    def qkvg(seed: int) -> dict[str, torch.Tensor]:
        generator.manual_seed(seed)
        return {n: torch.randn(1, 12, length, 128, device=device, generator=generator).bfloat16() for n in "qkvg"}

    worst = 0.0
    print(f"attention kernels alone, {length} tokens ({list(tokens)}), 12 heads x 128, {device}"
          f" (cuDNN {torch.backends.cudnn.version()}):", flush=True)
    for label, kernel in kernels.items():
        def forward(batch: dict[str, torch.Tensor], kernel=kernel) -> dict[str, torch.Tensor]:
            return {"o": kernel(batch["q"], batch["k"], batch["v"], batch["g"])}

        try:
            with torch.inference_mode():
                forward(qkvg(0))
        except RuntimeError as exc:  # a backend this device/shape does not support
            print(f"  {label}: not runnable here ({str(exc).splitlines()[0][:100]})", flush=True)
            continue
        step = GraphedStep(forward, key_base=CompileKey(model="probe", component=label, precision="bf16",
                                                        backend=label, tier="graphs"), cache=CompileCache())
        print(f" {label}:", flush=True)
        with torch.inference_mode():
            for name, seed in (("capture inputs", 1), ("new q/k/v", 2), ("new q/k/v again", 3), ("capture inputs again", 1)):
                batch = qkvg(seed)
                worst = max(worst, _report(name, forward(batch)["o"], step(batch)["o"], step))
    return worst


def probe_trajectory(card: ModelCard, device: str, backend: str) -> float:
    """The card's default request through its loops with graphs on; each forward against eager."""
    instance = build_instance(card, InstanceOptions(device=device, precision="bf16", attention_backend=backend,
                                                    allow_recipe_mismatch=True, compute=ComputeOptions(cuda_graphs=True)))
    errors: list[float] = []

    def checked(name: str, fn: Callable[..., Mapping[str, torch.Tensor]], inst: ModelInstance) -> Callable[..., Any]:
        model: WanTransformer = inst.component(name.split(":")[1])

        def call(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
            out = fn(inputs, params)
            x, t, context, image = dit_inputs(model, inputs)
            eager = torch.cat([model(x[i:i + 1], t[i:i + 1], context[i:i + 1], None if image is None else image[i:i + 1])
                               for i in range(x.shape[0])]).float()
            errors.append(((out["v"] - eager).norm() / eager.norm()).item())
            print(f"  {name} call {len(errors)}: t {t.tolist()}, rows {x.shape[0]}, graph vs eager {errors[-1]:.3e}",
                  flush=True)
            return out

        return call

    wrap_dit_forwards(instance, checked)
    d = card.capabilities.defaults
    request = Request(request_id="probe", model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                      inputs=(TextPart(text="a red fox runs through fresh snow at dawn"),),
                      diffusion=DiffusionParams(seed=0, steps=d.steps, height=d.height, width=d.width, frames=d.frames))
    print(f"{card.model_id} request through its loops, graphs tier, {backend}, {d.frames}x{d.height}x{d.width}:", flush=True)
    with torch.inference_mode():
        run_local(request, instance)
    del instance
    torch.cuda.empty_cache()
    return max(errors, default=0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="sdpa", help="the dense attention backend (default sdpa)")
    parser.add_argument("--card", default="wan-tiny", help="an fv-wan card id (real sizes: random weights, CUDA)")
    parser.add_argument("--kernels", action="store_true", help="also probe the attention kernels alone (CUDA)")
    parser.add_argument("--trajectory", action="store_true",
                        help="also run the card's default request with graphs on, each forward against eager (CUDA)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worst = 0.0
    if args.card == "wan-tiny":
        card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
        instance = build_instance(card, InstanceOptions(device=device, precision="bf16", attention_backend=args.attention))
        dense = instance.component("transformer")
        gated = WanTransformer(dense.config.model_copy(update={"has_gate_compress": True})).to(device, torch.bfloat16).eval()
        gated.load_state_dict(dense.state_dict(), strict=False)  # the gates stay random
        gated.set_attention_fn(dense._attention_fn)
        gated.set_video_attention(VideoSparseAttention(sparsity=0.5, tile=(1, 2, 2)).attend_video)
        for name, model in (("dense", dense), ("vsa", gated)):
            worst = max(worst, probe_model(name, model, (5, 16, 16), 24, device, args.attention))
        tokens: Latent = (5, 8, 8)
    else:
        card = wan_card_for_device(args.card, torch.device("cuda"))
        if card is None:
            return 0
        defaults = card.capabilities.defaults
        latent = ((defaults.frames - 1) // 4 + 1, defaults.height // 8, defaults.width // 8)
        tokens = (latent[0], latent[1] // 2, latent[2] // 2)
        assumed = card.recipe.assumes_attention
        backends = [args.attention] if assumed is None else [assumed.kind, args.attention]
        for backend in backends:
            instance = build_instance(card, InstanceOptions(device=device, precision="bf16", attention_backend=backend,
                                                            allow_recipe_mismatch=True))
            worst = max(worst, probe_model(card.model_id, instance.component("transformer"), latent, 512, device, backend))
            del instance
            torch.cuda.empty_cache()
    if args.kernels and device == "cuda":
        worst = max(worst, probe_kernels(tokens, device))
    if args.trajectory:
        assumed = card.recipe.assumes_attention
        worst = max(worst, probe_trajectory(card, device, args.attention if assumed is None else assumed.kind))
    print(f"worst replay error {worst:.3e}")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
