"""fv-wan's own UMT5 encoder and ``tokenizers``-backed tokenizer, for checkpoints that need no more.

Importing transformers' UMT5 costs seconds of a cold start (transformers itself, torch._dynamo
through its masking utilities, scikit-learn when installed), more than a few-million-parameter
encoder takes to load and run. :func:`load_umt5` reads a diffusers-layout ``text_encoder/`` +
``tokenizer/`` pair with torch, ``safetensors`` and ``tokenizers`` only, when the pair is one it
reproduces bit for bit (``tests/test_umt5.py`` holds it to ``UMT5EncoderModel`` with SDPA in fp32,
bf16 and fp16, and to ``AutoTokenizer``): a gated-GELU UMT5 encoder in one
``model.safetensors``, and a plain ``tokenizers`` tokenizer (``tokenizer.json``; the class fv's
export writes). Anything else (a SentencePiece ``T5Tokenizer``, sharded weights, another
activation) returns None and the caller loads transformers' classes as before.

The module names match ``UMT5EncoderModel``'s, so its state dict, ``save_pretrained`` output and
fv's LoRA/fp8 targets are the same.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fv_wan.models.tokenizer import TokenizerOutput

#: tokenizer_config.json classes that are the ``tokenizer.json`` backend and nothing else.
PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_WEIGHTS = "model.safetensors"
_TIED = "encoder.embed_tokens.weight"


@dataclass(frozen=True)
class UMT5Config:
    """The fields the encoder uses; ``raw`` is config.json as read (written back by ``save_pretrained``)."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    layer_norm_epsilon: float
    raw: dict[str, Any]

    @classmethod
    def supported(cls, raw: dict[str, Any]) -> UMT5Config | None:
        """The config when this module reproduces it, else None: a UMT5 whose ``feed_forward_proj`` is
        ``gated-gelu`` (for which transformers runs ``gelu_new`` whatever ``dense_act_fn`` says)."""
        if raw.get("model_type") != "umt5" or raw.get("feed_forward_proj", "relu") != "gated-gelu":
            return None
        try:
            return cls(
                vocab_size=int(raw["vocab_size"]), d_model=int(raw["d_model"]), d_kv=int(raw["d_kv"]), d_ff=int(raw["d_ff"]),
                num_layers=int(raw["num_layers"]), num_heads=int(raw["num_heads"]),
                relative_attention_num_buckets=int(raw.get("relative_attention_num_buckets", 32)),
                relative_attention_max_distance=int(raw.get("relative_attention_max_distance", 128)),
                layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-6)), raw=raw,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class EncoderOutput:
    last_hidden_state: torch.Tensor


class _LayerNorm(nn.Module):
    """T5's RMS norm: fp32 variance, cast to a half-precision weight's dtype before the scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def _embedding(rows: int, width: int) -> nn.Embedding:
    """On the meta device, no normal_ init: it runs torch's Python decompositions, whose first use
    imports torch._dynamo (seconds of a cold start for weights that are loaded next)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, width, _weight=torch.empty(rows, width))
    return nn.Embedding(rows, width)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class _Attention(nn.Module):
    """Unscaled self-attention with this layer's own bidirectional relative position bias."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_heads, config.d_kv
        self.buckets, self.max_distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
        inner = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.relative_attention_bias = _embedding(config.relative_attention_num_buckets, config.num_heads)

    def _bucket(self, relative: torch.Tensor) -> torch.Tensor:
        half = self.buckets // 2  # bidirectional: one half for keys after the query
        bucket = (relative > 0).to(torch.long) * half
        distance = torch.abs(relative)
        exact = half // 2
        log_ratio = torch.log(distance.float() / exact) / math.log(self.max_distance / exact) * (half - exact)
        large = torch.clamp_max(exact + log_ratio.to(torch.long), half - 1)
        return bucket + torch.where(distance < exact, distance, large)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        batch, length = x.shape[:2]
        q, k, v = (proj(x).view(batch, -1, self.heads, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        positions = torch.arange(length, dtype=torch.long, device=x.device)
        bias = self.relative_attention_bias(self._bucket(positions[None, :] - positions[:, None]))
        bias = bias.permute(2, 0, 1).unsqueeze(0)  # (1, heads, L, L) in the bias weight's dtype
        if keep is not None:
            floor = max(torch.finfo(k.dtype).min, torch.finfo(bias.dtype).min)
            bias = torch.where(keep, bias, floor)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.contiguous(), dropout_p=0.0, scale=1.0)
        return self.o(out.transpose(1, 2).contiguous().reshape(batch, length, -1))


class _SelfAttentionLayer(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.SelfAttention = _Attention(config)
        self.layer_norm = _LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), keep)


class _GatedFF(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _gelu_new(self.wi_0(x)) * self.wi_1(x)
        if x.dtype != self.wo.weight.dtype and self.wo.weight.dtype != torch.int8:
            x = x.to(self.wo.weight.dtype)  # transformers keeps ``wo`` in fp32 for half models
        return self.wo(x)


class _FFLayer(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.DenseReluDense = _GatedFF(config)
        self.layer_norm = _LayerNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


def _clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """transformers' fp16 overflow guard, kept so fp16 outputs match it."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(x.dtype).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class _Block(nn.Module):
    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList([_SelfAttentionLayer(config), _FFLayer(config)])

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = _clamp_fp16(self.layer[0](x, keep))
        return _clamp_fp16(self.layer[1](x))


class _Stack(nn.Module):
    def __init__(self, config: UMT5Config, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([_Block(config) for _ in range(config.num_layers)])
        self.final_layer_norm = _LayerNorm(config.d_model, config.layer_norm_epsilon)


class UMT5Encoder(nn.Module):
    """``UMT5EncoderModel``'s inference forward (eval, no dropout) under its module names."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = _embedding(config.vocab_size, config.d_model)
        self.encoder = _Stack(config, self.shared)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> EncoderOutput:
        keep = None
        # All tokens real: no mask, as transformers' SDPA path skips it (same scores either way).
        if attention_mask is not None and not bool(attention_mask.gt(0).all()):
            keep = attention_mask.gt(0)[:, None, None, :]
        x = self.encoder.embed_tokens(input_ids)
        for block in self.encoder.block:
            x = block(x, keep)
        return EncoderOutput(last_hidden_state=self.encoder.final_layer_norm(x))

    def save_pretrained(self, directory: str | Path, safe_serialization: bool = True) -> None:
        """config.json and model.safetensors as transformers writes them (the tied embedding once)."""
        from safetensors.torch import save_file

        del safe_serialization  # always safetensors
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if k != _TIED}
        raw = dict(self.config.raw)
        dtypes = {v.dtype for v in state.values()}
        if len(dtypes) == 1:
            raw["dtype"] = str(dtypes.pop()).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        save_file(state, str(directory / _WEIGHTS), metadata={"format": "pt"})

    @classmethod
    def load(cls, directory: Path, config: UMT5Config) -> UMT5Encoder | None:
        """Weights from ``directory/model.safetensors`` (fp32 as stored), or None when it is not one
        file holding exactly this architecture's tensors."""
        from safetensors.torch import load_file

        if not (directory / _WEIGHTS).is_file():
            return None
        state = load_file(str(directory / _WEIGHTS))
        if _TIED in state and "shared.weight" in state and not torch.equal(state[_TIED], state["shared.weight"]):
            return None
        state.setdefault(_TIED, state.get("shared.weight"))  # type: ignore[arg-type]
        state.setdefault("shared.weight", state[_TIED])
        with torch.device("meta"):
            model = cls(config)
        expected = model.state_dict()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            return None
        model.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
        model.encoder.embed_tokens = model.shared  # assign replaced the parameter; keep one tied module
        return model.eval()


PaddingMode = Literal["max_length", "longest", "do_not_pad"]


class BackendTokenizer:
    """A ``tokenizers.Tokenizer`` answering the Hugging Face call subset Wan's text path and fv-rl use."""

    def __init__(self, backend: Any, pad_token: str, model_max_length: int, config: dict[str, Any]) -> None:
        pad_id = backend.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"pad token {pad_token!r} is not in the tokenizer's vocabulary")
        self.backend = backend
        self.pad_token = pad_token
        self.pad_token_id: int = pad_id
        self.model_max_length = model_max_length
        self.config = config

    @property
    def transformers_class(self) -> str:
        """The transformers class that loads this tokenizer (model_index.json names it)."""
        return str(self.config["tokenizer_class"])

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def __call__(
        self,
        texts: str | Sequence[str],
        max_length: int | None = None,
        padding: bool | PaddingMode = False,
        truncation: bool = False,
        add_special_tokens: bool = True,
        return_attention_mask: bool = True,
        return_tensors: Literal["pt"] | None = None,
    ) -> TokenizerOutput:
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not all(isinstance(text, str) for text in batch):
            raise TypeError("texts must be a str or a sequence of str")
        mode = ("longest" if padding else "do_not_pad") if isinstance(padding, bool) else padding
        if mode not in ("max_length", "longest", "do_not_pad"):
            raise ValueError(f"padding must be one of 'max_length', 'longest', 'do_not_pad', True, False; got {padding!r}")
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        limit = max_length if max_length is not None else self.model_max_length
        self.backend.no_truncation()
        self.backend.no_padding()
        if truncation:
            self.backend.enable_truncation(limit)
        if mode != "do_not_pad":
            self.backend.enable_padding(pad_id=self.pad_token_id, pad_token=self.pad_token,
                                        length=limit if mode == "max_length" else None)
        encodings = self.backend.encode_batch(batch, add_special_tokens=add_special_tokens)
        sequences = [list(e.ids) for e in encodings]
        masks = [list(e.attention_mask) for e in encodings]
        if return_tensors == "pt":
            if len({len(ids) for ids in sequences}) > 1:
                raise ValueError("return_tensors='pt' needs equal lengths: use padding='max_length' or 'longest'")
            return TokenizerOutput(torch.tensor(sequences, dtype=torch.long),
                                   torch.tensor(masks, dtype=torch.long) if return_attention_mask else None)
        return TokenizerOutput(sequences, masks if return_attention_mask else None)

    def save_pretrained(self, directory: str | Path) -> None:
        """tokenizer.json and tokenizer_config.json, loadable by ``AutoTokenizer`` and by :func:`load_umt5`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> BackendTokenizer | None:
        """The tokenizer in ``directory`` when it is a plain ``tokenizer.json`` one, else None."""
        config_path, backend_path = directory / "tokenizer_config.json", directory / "tokenizer.json"
        if not (config_path.is_file() and backend_path.is_file()):
            return None
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES or not isinstance(config.get("pad_token"), str):
            return None
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(backend_path)), config["pad_token"], int(config.get("model_max_length", 512)), config)


def load_umt5(encoder_dir: Path, tokenizer_dir: Path) -> tuple[UMT5Encoder, BackendTokenizer] | None:
    """The encoder (fp32, CPU) and tokenizer of a checkpoint this module reproduces, else None."""
    config_path = encoder_dir / "config.json"
    if not config_path.is_file():
        return None
    config = UMT5Config.supported(json.loads(config_path.read_text()))
    if config is None:
        return None
    tokenizer = BackendTokenizer.load(tokenizer_dir)
    if tokenizer is None:
        return None
    model = UMT5Encoder.load(encoder_dir, config)
    return None if model is None else (model, tokenizer)
