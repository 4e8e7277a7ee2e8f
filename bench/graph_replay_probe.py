"""Does a CUDA-graph replay on new inputs equal eager on those inputs? A probe for the graphs tier.

    python bench/graph_replay_probe.py                      # wan-tiny, dense and under VSA, on CUDA
    python bench/graph_replay_probe.py --attention sdpa_cudnn

One ``GraphedStep`` per model is captured on its first call and replayed on new latents and new
timesteps; each replay is compared with the eager forward on the same inputs. The VSA model is
``wan-tiny``'s DiT with compression gates added (random), VSA at sparsity 0.5 over (1, 2, 2) tiles.
Off CUDA the step runs eager (``GraphedStep``'s fallback), so the errors are 0 by construction.
"""

from __future__ import annotations

import argparse
import sys

import torch

from fv_kernel.api import InstanceOptions, build_instance
from fv_kernel.compute.compile import CompileCache, CompileKey, GraphedStep
from fv_kernel.compute.video_sparse_attention import VideoSparseAttention
from fv_wan.cards import wan_cards
from fv_wan.models.transformer import WanTransformer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="sdpa", help="the DiT's attention backend (default sdpa)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    instance = build_instance(card, InstanceOptions(device=device, precision="bf16", attention_backend=args.attention))
    dense = instance.component("transformer")
    gated = WanTransformer(dense.config.model_copy(update={"has_gate_compress": True})).to(device, torch.bfloat16).eval()
    gated.load_state_dict(dense.state_dict(), strict=False)  # the gates stay random
    gated.set_attention_fn(dense._attention_fn)
    gated.set_video_attention(VideoSparseAttention(sparsity=0.5, tile=(1, 2, 2)).attend_video)
    generator = torch.Generator(device=device)
    worst = 0.0
    for name, model in (("dense", dense), ("vsa", gated)):
        config = model.config

        def inputs(seed: int, t: float) -> dict[str, torch.Tensor]:
            generator.manual_seed(seed)
            return {"x": torch.randn(1, config.in_channels, 5, 16, 16, device=device, generator=generator).bfloat16(),
                    "t": torch.tensor([t], device=device),
                    "context": torch.randn(1, 24, config.text_dim, device=device, generator=generator).bfloat16()}

        def forward(batch: dict[str, torch.Tensor], model: WanTransformer = model) -> dict[str, torch.Tensor]:
            return {"v": model(batch["x"], batch["t"], batch["context"], None).float()}

        step = GraphedStep(forward, key_base=CompileKey(model="wan-tiny", component=name, precision="bf16",
                                                        backend=args.attention, tier="graphs"), cache=CompileCache())
        print(f"{name} ({args.attention}, {device}):")
        with torch.inference_mode():
            for label, batch in (("capture inputs", inputs(1, 900.0)), ("new x, same t", inputs(2, 900.0)),
                                 ("new x, new t", inputs(3, 500.0)), ("capture inputs again", inputs(1, 900.0))):
                eager, graphed = forward(batch)["v"], step(batch)["v"]
                error = ((graphed - eager).norm() / eager.norm()).item()
                worst = max(worst, error)
                print(f"  {label:22s} graph vs eager {error:.3e} (replays {step.replays}, eager calls {step.eager_calls})")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
