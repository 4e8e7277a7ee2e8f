"""fv-wan's own UMT5 encoder and tokenizer against transformers' (the reference), on the shipped
wan-toy checkpoint: bit-identical outputs, the same ids, loadable both ways, and the fallback."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from fv_wan.models import umt5
from fv_wan.models.encoders import WanTextEncoder
from fv_wan.models.umt5 import BackendTokenizer, UMT5Encoder, load_umt5
from fv_wan.toy_card import weights_dir

PROMPTS = ["a red cube moves on the blue background", "A  GREEN ball and", "", "xyzzy moves " * 30]
CALLS = [
    dict(padding="max_length", max_length=40, truncation=True),
    dict(padding="longest", truncation=True, max_length=16),
    dict(padding="longest"),
    dict(padding=True, truncation=True, max_length=8, add_special_tokens=False),
]


@pytest.fixture(scope="module")
def toy() -> Path:
    return weights_dir()


@pytest.fixture(scope="module")
def reference(toy: Path):
    transformers = pytest.importorskip("transformers")
    model = transformers.UMT5EncoderModel.from_pretrained(toy / "text_encoder", local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(toy / "tokenizer", local_files_only=True)


def _ids(tokenizer, prompts=PROMPTS, length: int = 48):
    return tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")


def test_the_toy_checkpoint_loads_without_transformers(toy: Path) -> None:
    loaded = load_umt5(toy / "text_encoder", toy / "tokenizer")
    assert loaded is not None
    model, tokenizer = loaded
    assert isinstance(model, UMT5Encoder) and isinstance(tokenizer, BackendTokenizer)
    assert model.encoder.embed_tokens is model.shared  # tied, as transformers ties it
    encoder = WanTextEncoder.from_pretrained(toy)
    assert isinstance(encoder.model, UMT5Encoder) and encoder.model.config.d_model == 128


@pytest.mark.parametrize("call", CALLS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_tokenizer_ids_and_mask_match_autotokenizer(toy: Path, reference, call: dict) -> None:
    ours = BackendTokenizer.load(toy / "tokenizer")
    theirs = reference[1](PROMPTS, return_tensors="pt", **call)
    mine = ours(PROMPTS, return_tensors="pt", **call)
    assert torch.equal(mine.input_ids, theirs["input_ids"])
    assert torch.equal(mine.attention_mask, theirs["attention_mask"])
    assert len(ours) == len(reference[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_encoder_output_is_bit_identical_to_umt5_encoder_model(toy: Path, reference, dtype: torch.dtype) -> None:
    model, tokenizer = load_umt5(toy / "text_encoder", toy / "tokenizer")
    ref = copy.deepcopy(reference[0]).to(dtype)
    model = model.to(dtype)
    tokens = _ids(tokenizer)
    with torch.no_grad():
        for mask in (tokens.attention_mask, torch.ones_like(tokens.attention_mask)):  # padded and mask-free paths
            ours = model(tokens.input_ids, mask).last_hidden_state
            theirs = ref(tokens.input_ids, mask).last_hidden_state
            assert ours.dtype == theirs.dtype == dtype
            assert torch.equal(ours, theirs)


def test_a_wrong_activation_is_caught(toy: Path, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: exact GELU instead of gelu_new's tanh form is close, and still fails the check."""
    model, tokenizer = load_umt5(toy / "text_encoder", toy / "tokenizer")
    monkeypatch.setattr(umt5, "_gelu_new", torch.nn.functional.gelu)
    tokens = _ids(tokenizer)
    with torch.no_grad():
        ours = model(tokens.input_ids, tokens.attention_mask).last_hidden_state
        theirs = reference[0](tokens.input_ids, tokens.attention_mask).last_hidden_state
    assert not torch.equal(ours, theirs)


def test_save_pretrained_round_trips_through_transformers(toy: Path, reference, tmp_path: Path) -> None:
    model, tokenizer = load_umt5(toy / "text_encoder", toy / "tokenizer")
    model.save_pretrained(tmp_path / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    transformers = pytest.importorskip("transformers")
    back = transformers.UMT5EncoderModel.from_pretrained(tmp_path / "text_encoder", local_files_only=True).eval()
    back_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer", local_files_only=True)
    tokens = _ids(back_tokenizer)
    assert torch.equal(tokens["input_ids"], _ids(reference[1])["input_ids"])
    with torch.no_grad():
        assert torch.equal(back(tokens["input_ids"], tokens["attention_mask"]).last_hidden_state,
                           reference[0](tokens["input_ids"], tokens["attention_mask"]).last_hidden_state)
    assert load_umt5(tmp_path / "text_encoder", tmp_path / "tokenizer") is not None
    assert tokenizer.transformers_class == "TokenizersBackend" and hasattr(transformers, tokenizer.transformers_class)


def _copy(toy: Path, tmp_path: Path) -> Path:
    for sub in ("text_encoder", "tokenizer"):
        shutil.copytree(toy / sub, tmp_path / sub)
    return tmp_path


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("change", [
    ("tokenizer/tokenizer_config.json", {"tokenizer_class": "T5Tokenizer"}),  # SentencePiece semantics: transformers'
    ("text_encoder/config.json", {"feed_forward_proj": "gated-silu"}),
    ("text_encoder/config.json", {"model_type": "t5"}),
], ids=lambda c: f"{c[0]}:{c[1]}")
def test_anything_else_is_left_to_transformers(toy: Path, tmp_path: Path, change) -> None:
    root = _copy(toy, tmp_path)
    _edit(root / change[0], **change[1])
    assert load_umt5(root / "text_encoder", root / "tokenizer") is None


def test_an_unsupported_encoder_loads_through_transformers(toy: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    root = _copy(toy, tmp_path)
    _edit(root / "text_encoder" / "config.json", feed_forward_proj="gated-silu")
    encoder = WanTextEncoder.from_pretrained(root)
    assert type(encoder.model).__name__ == "UMT5EncoderModel"
    assert encoder.encode("a red cube", max_sequence_length=8).shape == (1, 8, 128)


def test_weights_of_another_shape_fall_back(toy: Path, tmp_path: Path) -> None:
    root = _copy(toy, tmp_path)
    _edit(root / "text_encoder" / "config.json", d_ff=64)
    assert load_umt5(root / "text_encoder", root / "tokenizer") is None


def test_tokenizer_refuses_bad_arguments(toy: Path) -> None:
    tokenizer = BackendTokenizer.load(toy / "tokenizer")
    with pytest.raises(ValueError, match="padding must be one of"):
        tokenizer(["a"], padding="sideways")
    with pytest.raises(ValueError, match="return_tensors must be 'pt' or None"):
        tokenizer(["a"], return_tensors="np")
    with pytest.raises(TypeError, match="texts must be a str"):
        tokenizer([1])
