"""``wan-toy``: a small Wan-architecture card trained by fv on the toy world (``fv_wan.toy``).

Two cards share one architecture (fv-wan's transformer, VAE and UMT5 text encoder at a
few million parameters):

- ``wan-toy-init``: embedded, seeded random weights and a word-level tokenizer over the
  toy grammar's vocabulary. It is what the fv-rl recipe trains
  (``plugins/fv-rl/recipes/wan-toy.yaml``), and the trained card's recipe parent.
- ``wan-toy``: the trained weights, shipped in this package as a diffusers ``WanPipeline``
  directory (``fv_wan/weights/wan-toy/``) and loaded offline. Its card is the one the
  export wrote beside the weights (``fv-card.json``: the recipe method, data contract,
  step counts and parent filled in by the trainer), pointed at the installed folder.

The tokenizer maps each whitespace-separated word (lower-cased) of a prompt to its id;
words outside the grammar's vocabulary become ``<unk>``, so the model sees only the words
it was trained on (it was never trained with ``<unk>``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from fv_kernel.api import (
    BatchedVsAlone,
    CompileCache,
    ComponentCheckpoint,
    ComponentSpec,
    GenerationDefaults,
    InstanceOptions,
    ModelCard,
    ModelInstance,
    ParityTolerance,
    PrecisionContract,
    PrecisionPolicy,
    RecipeSpec,
    TaskType,
    TextVocabulary,
    TrainedEnvelope,
    read_card_file_beside,
)
from fv_wan.cards import VAE_SCHEMA, WAN_ADAPTER_FORMAT, _card
from fv_wan.fp8 import wan_precision_contract
from fv_wan.models.transformer import WanTransformerConfig
from fv_wan.models.vae import WanVAEConfig

__all__ = [
    "TOY_INIT_ID", "TOY_ID", "TOY_TRANSFORMER", "TOY_VAE", "TOY_TEXT", "TOY_DEFAULTS", "TOY_CONTEXT_LENGTH", "TOY_DATA_SEED", "weights_dir",
    "toy_tokenizer", "toy_text_encoder", "wan_toy_init_card", "wan_toy_card", "build_toy_instance", "load_full_vae",
    "toy_parameter_count", "toy_envelope", "TOY_CAUSAL_ID", "TOY_CAUSAL_PROVENANCE", "wan_toy_causal_card", "causal_weights_dir",
]

TOY_INIT_ID = "wan-toy-init"
TOY_ID = "wan-toy"
#: The toy world's training seed (the recipe's data contract); held-out prompts never appear in training.
TOY_DATA_SEED = 0

#: UMT5 width, depth and heads of the toy text encoder (the transformer's ``text_dim``).
TOY_TEXT = {"d_model": 128, "num_layers": 2, "num_heads": 4, "d_kv": 32, "d_ff": 256}
TOY_TRANSFORMER = WanTransformerConfig(
    patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=32, in_channels=16, out_channels=16,
    text_dim=TOY_TEXT["d_model"], freq_dim=128, ffn_dim=512, num_layers=6, rope_max_seq_len=64,
)  # fmt: skip
#: Wan 2.1 VAE layout at base width 24: 4x spatial, 4x temporal, z 16. The latent statistics
#: here are placeholders for the untrained card; the trainer measures them on toy-world data.
TOY_VAE = WanVAEConfig(
    base_dim=24, z_dim=16, dim_mult=(1, 2, 2), num_res_blocks=1, temperal_downsample=(True, True),
    scale_factor_spatial=4, latents_mean=(0.0,) * 16, latents_std=(1.0,) * 16,
)  # fmt: skip
#: Prompt context of the toy cards' ``text_encode`` loop (the grammar's longest prompt is 18 words + EOS).
#: Wan pads every prompt to 512 rows that cross-attention attends to unmasked: at ~20 real tokens
#: the prompt would get a few percent of the attention mass it gets at 24, and its cost is 20x less.
TOY_CONTEXT_LENGTH = 24
TOY_DEFAULTS = GenerationDefaults(height=64, width=64, frames=17, fps=8.0, steps=25, guidance=4.5, shift=3.0)

_PKG = "fv_wan"
_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as T5
_BUCKETS = 16


def weights_dir() -> Path:
    """The installed ``wan-toy`` checkpoint directory (package data)."""
    return Path(__file__).resolve().parent / "weights" / TOY_ID


def toy_tokenizer() -> Any:
    """A Hugging Face fast tokenizer: word level over the toy vocabulary, T5 conventions (pad 0, eos 1, unk 2)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from fv_wan.toy.grammar import VOCABULARY

    vocab = {token: i for i, token in enumerate((*_SPECIALS, *VOCABULARY))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def toy_text_encoder(seed: int) -> Any:
    """The seeded, untrained UMT5 encoder over :func:`toy_tokenizer` (``wan-toy-init``'s text encoder)."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from fv_wan.models.encoders import WanTextEncoder

    tokenizer = toy_tokenizer()
    config = UMT5Config(
        vocab_size=len(tokenizer), d_model=TOY_TEXT["d_model"], d_kv=TOY_TEXT["d_kv"], d_ff=TOY_TEXT["d_ff"],
        num_layers=TOY_TEXT["num_layers"], num_heads=TOY_TEXT["num_heads"], relative_attention_num_buckets=_BUCKETS,
        relative_attention_max_distance=32, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(config)
    return WanTextEncoder(model.eval(), tokenizer)


def load_full_vae(card: ModelCard, component_id: str, options: InstanceOptions) -> Any:
    """The ``vae`` training component: encoder and decoder together, fp32 (serving loads one half)."""
    from fv_wan.export import full_vae

    return full_vae(card, options, component_id).eval().requires_grad_(False)


def _vocabulary_size() -> int:
    from fv_wan.toy.grammar import VOCABULARY

    return len(VOCABULARY)


def umt5_encoder_elements(*, vocab_size: int, d_model: int, num_layers: int, num_heads: int, d_kv: int, d_ff: int,
                          buckets: int = 16) -> int:
    """Weights of a gated-GELU ``UMT5EncoderModel`` (per-layer relative bias), by arithmetic: the pre-flight
    runs in loader threads, where importing transformers' lazy modules concurrently can fail."""
    inner = num_heads * d_kv
    attention = 4 * d_model * inner + buckets * num_heads + d_model
    ffn = 3 * d_model * d_ff + d_model
    return vocab_size * d_model + num_layers * (attention + ffn) + d_model


def toy_parameter_count(spec: ComponentSpec) -> int:
    """``ComponentSpec.parameters`` of the toy cards: the word-level text encoder and the whole ``vae``
    counted here (on the meta device); the other components as every Wan card counts them."""
    import torch

    from fv_wan.footprint import parameter_count
    from fv_wan.models.vae import WanVAE

    def elements(module: Any) -> int:
        return sum(t.numel() for t in module.parameters()) + sum(t.numel() for t in module.buffers())

    if spec.component_id == "text_encoder":
        return umt5_encoder_elements(vocab_size=3 + _vocabulary_size(), **TOY_TEXT)
    if spec.component_id == "vae":
        with torch.device("meta"):
            return elements(WanVAE(WanVAEConfig.from_diffusers_config(spec.config)))
    return parameter_count(spec)


def build_toy_instance(card: ModelCard, options: InstanceOptions, compute: Any = None) -> ModelInstance:
    """fv-wan's instance, plus: the seeded word-level text encoder when the card has no checkpoint,
    and the whole-VAE ``vae`` component a trainer trains (serving never loads it)."""
    from fv_wan.checkpoint import seed_of
    from fv_wan.instance import build_wan_instance, wan_ops

    base = build_wan_instance(card, options, compute)
    compute = compute if compute is not None else options.compute

    def load(component_id: str) -> Any:
        if component_id == "vae":
            return load_full_vae(card, component_id, options)
        if component_id == "text_encoder" and (seed := seed_of(card, component_id, options)) is not None:
            return toy_text_encoder(seed).to(device=options.device).requires_grad_(False)
        return base.component_loader(component_id)

    ops_builder = wan_ops if compute is None else functools.partial(wan_ops, compute=compute, compile_cache=CompileCache())
    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=ops_builder,
                         weights_version=base.weights_version)


_PARITY_TOY = ParityTolerance(
    name="loop_vs_diffusers", metric="max_abs", dtype="fp32", value=1e-4,
    justification=(
        "decoded frames in [0, 1], fp32 on CPU, fv serving the shipped directory vs diffusers' WanPipeline.from_pretrained "
        "of it (its own tokenizer, encoder, UniPC scheduler and seeded noise), 25 steps with CFG 4.5. Trained weights "
        "amplify kernel reduction-order residue more than the random tiny cards (1e-5): 1e-4 is 1/40 of one 8-bit level."
    ),
)


_BATCHED_TOY = BatchedVsAlone(
    precision="fp32", max_abs=1e-4,
    justification=(
        "decoded frames in [0, 1], fp32 on CPU, 17 frames at 64x64, 4 requests fused vs run alone: measured 1.2e-5 "
        "with staggered arrivals, 5.8e-6 concurrent (bench/bench_batched_vs_alone.py --card wan-toy). Trained weights "
        "amplify reduction-order residue more than the random tiny cards; 1e-4 is 1/40 of one 8-bit level"
    ),
)


def wan_toy_init_card() -> ModelCard:
    """The untrained card the recipe starts from (embedded: seeded weights, no download)."""
    card = _card(
        TOY_INIT_ID, summary="Untrained wan-toy architecture (seeded random weights): what fv-rl's flow-matching recipe trains",
        transformer=TOY_TRANSFORMER, vae=TOY_VAE, tasks=frozenset({_t2v()}), defaults=TOY_DEFAULTS, source=None, max_frames=33,
    )  # fmt: skip
    components = dict(card.components)
    components["text_encoder"] = components["text_encoder"].model_copy(update={
        "config": {"d_model": TOY_TEXT["d_model"]}, "parameters": f"{_PKG}.toy_card:toy_parameter_count"})
    components["vae"] = ComponentSpec(parameters=f"{_PKG}.toy_card:toy_parameter_count", component_id="vae", kind="vae", builder=f"{_PKG}.toy_card:load_full_vae",
                                      config=TOY_VAE.to_diffusers_config(), config_schema=VAE_SCHEMA,
                                      precision_policy=PrecisionPolicy(dtype="fp32"))
    loops = dict(card.loops)
    text_loop = loops["text_encode"]
    loops["text_encode"] = text_loop.model_copy(update={"config": {**text_loop.config, "max_sequence_length": TOY_CONTEXT_LENGTH}})
    checkpoint = dict(card.checkpoint.components)
    checkpoint["vae"] = ComponentCheckpoint(subfolder="vae", random_init_seed=2)  # the same seeded VAE as vae_decoder
    parity = card.parity.model_copy(update={
        "tolerances": (_PARITY_TOY, *[t for t in card.parity.tolerances if t.name != "loop_vs_diffusers"]),
        "batched_vs_alone": (_BATCHED_TOY,),
        "tests": (*card.parity.tests, "plugins/fv-wan/tests/test_wan_toy.py"),
    })  # fmt: skip
    data = card.model_copy(update={
        "components": components, "loops": loops, "checkpoint": card.checkpoint.model_copy(update={"components": checkpoint}),
        "factory": f"{_PKG}.toy_card:build_toy_instance", "parity": parity,
        "precision": PrecisionContract(default="fp32", supported=frozenset({"fp32", "bf16"})),
        "recipe": RecipeSpec(method="base", data_contract="seeded random initialisation (no training)"),
    }).model_dump()  # fmt: skip
    return ModelCard.model_validate(data)


def _t2v() -> Any:
    from fv_kernel.api import TaskType

    return TaskType.TEXT_TO_VIDEO


def toy_envelope() -> TrainedEnvelope:
    """What ``wan-toy`` was trained on (its data contract: toy-world clips of 17 frames at 64x64,
    labelled 8 fps) and its tokenizer's words: a 33-frame clip or a prompt of other words is garbage."""
    from fv_wan.toy.grammar import _FUNCTION_WORDS, VOCABULARY

    return TrainedEnvelope(
        frames=(TOY_DEFAULTS.frames,), sizes=((TOY_DEFAULTS.width, TOY_DEFAULTS.height),), fps=(TOY_DEFAULTS.fps,),
        vocabulary=TextVocabulary(words=VOCABULARY, function_words=_FUNCTION_WORDS, lowercase=True),
    )


def wan_toy_card() -> ModelCard | None:
    """The trained card, from the shipped directory's ``fv-card.json``; None when the weights are not installed.

    The shipped file predates ``RecipeSpec.envelope`` and ``PrecisionContract.paths``: its recipe
    gets :func:`toy_envelope` and its precision Wan's fp8 paths under the judged contract (an export
    that declares them keeps its own)."""
    root = weights_dir()
    if not (root / "fv-card.json").is_file():
        return None
    card = read_card_file_beside(root)
    if card.adapter_format is None:  # the shipped file predates ModelCard.adapter_format
        card = card.model_copy(update={"adapter_format": WAN_ADAPTER_FORMAT})
    if card.recipe.envelope is None:
        card = card.model_copy(update={"recipe": card.recipe.model_copy(update={"envelope": toy_envelope()})})
    if not card.precision.paths:  # the shipped file predates precision.paths: Wan's fp8 paths, judged
        card = card.model_copy(update={"precision": wan_precision_contract(card.precision, ("transformer",), judged=True)})
    if TaskType.TEXT_TO_IMAGE in card.capabilities.tasks and 1 not in (card.recipe.envelope.frames or (1,)):
        # Trained on 17-frame clips only: one frame is outside the envelope (it made a blob), so the
        # card does not offer images rather than refusing each one on ``frames``.
        tasks = card.capabilities.tasks - {TaskType.TEXT_TO_IMAGE}
        programs = {task: program for task, program in card.programs.items() if task in tasks}
        card = card.model_copy(update={"capabilities": card.capabilities.model_copy(update={"tasks": tasks}),
                                       "programs": programs})
    return card


TOY_CAUSAL_ID = "wan-toy-causal"
#: What ``wan-toy-causal`` runs until fv-rl's self_forcing ships distilled weights for it.
TOY_CAUSAL_PROVENANCE = "bidirectional weights run causally (not distilled): wan-toy's trained weights"


def wan_toy_causal_card() -> ModelCard | None:
    """``wan-toy-causal``: wan-toy's architecture streamed chunk by chunk (4 DMD steps). With fv-rl
    ``self_forcing``'s shipped export (:func:`causal_weights_dir`) it serves those weights with the
    chunking they were trained with (their ``provenance.json``), 1 sink + 8 local chunks, and their
    recipe; without it, wan-toy's weights run causally (``TOY_CAUSAL_PROVENANCE``) in 3-frame chunks,
    1 sink + 3 local. None when wan-toy's weights are not installed."""
    from fv_wan.causal import CausalRecipe, causal_card

    base = wan_toy_card()
    if base is None:
        return None
    envelope = toy_envelope().model_copy(update={"frames": None})  # a stream has no fixed length
    defaults = TOY_DEFAULTS.model_copy(update={"steps": 4, "guidance": 1.0, "shift": 5.0})
    distilled = causal_weights_dir()
    if (distilled / "fv-card.json").is_file():  # fv-rl self_forcing's export: its chunking, recipe and provenance
        trained = read_card_file_beside(distilled)
        options = json.loads((distilled / "provenance.json").read_text())["recipe"]["options"]
        recipe = CausalRecipe(frames_per_chunk=options["chunk_frames"], sink_chunks=1, local_chunks=8, context_noise=0.0,
                              max_sequence_length=TOY_CONTEXT_LENGTH, max_height=TOY_DEFAULTS.height, max_width=TOY_DEFAULTS.width)
        return causal_card(base, model_id=TOY_CAUSAL_ID, recipe=recipe, sessions=8, summary=trained.summary, source=str(distilled),
                           recipe_spec=trained.recipe.model_copy(update={"assumes_loop": "realtime", "envelope": envelope}),
                           defaults=defaults)
    recipe = CausalRecipe(frames_per_chunk=3, sink_chunks=1, local_chunks=3, context_noise=0.0,
                          max_sequence_length=TOY_CONTEXT_LENGTH, max_height=TOY_DEFAULTS.height, max_width=TOY_DEFAULTS.width)
    return causal_card(
        base, model_id=TOY_CAUSAL_ID, recipe=recipe, sessions=8,
        summary=f"wan-toy streamed causally, chunk by chunk ({TOY_CAUSAL_PROVENANCE})",
        recipe_spec=RecipeSpec(method="base", parents=(TOY_ID,), assumes_loop="realtime", data_contract=TOY_CAUSAL_PROVENANCE,
                               envelope=envelope),
        defaults=defaults,
    )


def causal_weights_dir() -> Path:
    """The installed ``wan-toy-causal`` checkpoint directory (fv-rl ``self_forcing``'s export; package data)."""
    return Path(__file__).resolve().parent / "weights" / TOY_CAUSAL_ID
