"""How fast the toy DiT learns to use its prompt, by prompt context length (a CPU-sized recipe probe).

    python bench/bench_toy_context.py                       # contexts 24 and 512, 300 steps each
    python bench/bench_toy_context.py --contexts 24 --steps 600

Wan pads every prompt to ``max_sequence_length`` rows (512 in WanPipeline) and its
cross-attention attends to all of them unmasked; ``wan-toy-init`` pads to 24. This trains
the same seeded ``wan-toy-init`` transformer and text encoder with fv-rl's flow-matching
loss (``FlowMatching.loss``, the trainer's own embedding and sigma sampling) on latents of
toy-world clips encoded by the shipped ``wan-toy`` VAE, once per context length, same seeds
and batches. Every ``--eval-every`` steps it reports the flow loss on held-out clips with
their own prompts and with the prompts shuffled among them, at fixed sigmas: the
**conditioning gain** ``1 - loss(own) / loss(shuffled)`` is the share of the loss the prompt
explains. A model that ignores its prompt scores 0.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fv_kernel.api import CardCatalog, InstanceOptions, build_instance
from fv_kernel.plugins import PluginHost
from fv_rl.flow_matching import DiTStage, FlowMatching, _embed_with_grad, sample_sigmas
from fv_wan.toy.world import ToyWorld

EVAL_SIGMAS = (0.3, 0.6, 0.9)


def encode_clips(vae: torch.nn.Module, world: ToyWorld, clips: int, chunk: int = 16) -> tuple[torch.Tensor, list[str]]:
    latents, prompts = [], []
    with torch.no_grad():
        for index in range(0, clips, chunk):
            videos, text = world.batch(index // chunk, min(chunk, clips - index), device=torch.device("cpu"))
            latents.append(vae.encode(videos.permute(0, 2, 1, 3, 4).mul(2).sub(1))[0])
            prompts.extend(text)
    return vae.normalize_latents(torch.cat(latents)), prompts


def run(context: int, args: argparse.Namespace, data: dict[str, tuple[torch.Tensor, list[str]]]) -> list[dict[str, float]]:
    host = PluginHost()
    init = CardCatalog(host).get("wan-toy-init")
    torch.manual_seed(0)
    instance = build_instance(init, InstanceOptions(device="cpu", precision="fp32"))
    transformer, text_encoder = instance.component("transformer"), instance.component("text_encoder")
    transformer.train().requires_grad_(True)
    text_encoder.train().requires_grad_(True)
    embed = _embed_with_grad(text_encoder)
    method, stage = FlowMatching(), DiTStage()
    params = [*transformer.parameters(), *text_encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(1)

    def context_of(prompts: list[str], grad: bool) -> torch.Tensor:
        tokens = text_encoder.tokenizer(prompts, padding="longest", truncation=True, max_length=context, return_tensors="pt")
        with torch.set_grad_enabled(grad):
            return embed(text_encoder, tokens.input_ids, tokens.attention_mask, context, dtype=torch.float32)

    train_latents, train_prompts = data["train"]
    eval_latents, eval_prompts = data["eval"]
    shuffled = eval_prompts[1:] + eval_prompts[:1]
    eval_noise = torch.randn(eval_latents.shape, generator=torch.Generator().manual_seed(2))

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        transformer.eval()
        losses = []
        for prompts in (eval_prompts, shuffled):
            ctx = context_of(prompts, grad=False)
            total = 0.0
            for sigma in EVAL_SIGMAS:
                total += method.loss({"model": transformer, "x0": eval_latents, "noise": eval_noise, "context": ctx,
                                      "sigma": torch.full((len(prompts),), sigma)}).item()
            losses.append(total / len(EVAL_SIGMAS))
        transformer.train()
        return losses[0], losses[1]

    rows, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        index = torch.randint(0, train_latents.shape[0], (args.batch,), generator=generator)
        x0 = train_latents[index]
        loss = method.loss({
            "model": transformer, "x0": x0, "context": context_of([train_prompts[i] for i in index.tolist()], grad=True),
            "noise": torch.randn(x0.shape, generator=generator), "sigma": sample_sigmas(args.batch, stage, 3.0, generator, torch.device("cpu")),
        })  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            own, other = evaluate()
            rows.append({"context": context, "step": step, "seconds": round(time.perf_counter() - start, 1),
                         "loss_own": own, "loss_shuffled": other, "gain": 1 - own / other})
            print(f"context {context:4d} step {step:5d} ({rows[-1]['seconds']:6.1f} s): held-out flow loss {own:.4f} "
                  f"own prompts, {other:.4f} shuffled, conditioning gain {rows[-1]['gain']:.3%}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[24, 512])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clips", type=int, default=512, help="training clips (encoded once)")
    parser.add_argument("--eval-clips", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    host = PluginHost()
    toy = CardCatalog(host).get("wan-toy")
    vae = build_instance(toy, InstanceOptions(device="cpu", precision="fp32")).component("vae")
    d = toy.capabilities.defaults
    data = {
        "train": encode_clips(vae, ToyWorld(frames=d.frames, height=d.height, width=d.width, seed=1), args.clips),
        "eval": encode_clips(vae, ToyWorld(frames=d.frames, height=d.height, width=d.width, seed=99), args.eval_clips),
    }
    rows = [row for context in args.contexts for row in run(context, args, data)]
    print("\n| context | step | seconds | held-out loss, own prompts | shuffled prompts | conditioning gain |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['step']} | {r['seconds']} | {r['loss_own']:.4f} | {r['loss_shuffled']:.4f} | {r['gain']:.2%} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
