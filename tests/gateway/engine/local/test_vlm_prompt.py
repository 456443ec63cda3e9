"""The engine side of real VLM checkpoints against the checkpoints' own transformers classes.

For each family (LLaVA, Idefics3 / SmolVLM, Qwen2.5-VL) a tiny random-weight checkpoint is
built, and for the same image and messages:
- `render` gives the token ids the checkpoint's processor gives (image rows as its image token),
- our language model (`load_weights`: decoder + lm_head + embed, nothing of the vision side)
  fed our `Prompt` (text rows from `embed`, image rows as the model computes them) gives the
  full model's last logits, whole or prefilled in chunks that cut through images,
- for Qwen2.5-VL, `Prompt.mrope` equals `get_rope_index`, also after dropping patches.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encoder_worker.families import UnsupportedCheckpoint
from encoder_worker.types import ImageLayout
from gateway.engine.interface import ImageInput, Message
from gateway.engine.local.kv.blocks import position_keys
from gateway.engine.local.prompt import STRUCTURED_CONTENT_ATTR, embed_positions, render
from gateway.engine.local.weights import LoadedModel, load_weights

FAMILIES = ("llava", "idefics3", "qwen2_5_vl")
SYSTEM = "You answer in one short sentence."


def _photo(name: str):
    from PIL import Image
    from skimage import data

    return Image.fromarray(getattr(data, name)()).convert("RGB")


@dataclass
class Checkpoint:
    family: str
    path: Path
    processor: Any
    hf: Any  # the full transformers model, eval mode
    loaded: LoadedModel
    placeholder: str  # what the chat template renders per image (= the image token)
    image_token_id: int


def _builder(family: str):
    name = "idefics3" if family == "idefics3" else family
    if importlib.util.find_spec(f"tests.vlm_checkpoints.{name}") is None:
        pytest.skip(f"no checkpoint builder for {family} yet")
    return importlib.import_module(f"tests.vlm_checkpoints.{name}")


def _processor(family: str, path: Path) -> Any:
    if family == "qwen2_5_vl":  # its AutoProcessor wants torchvision for the video half
        return _builder(family).load_processor(path)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def _hf_model(family: str, path: Path) -> Any:
    import transformers

    cls = {
        "llava": "LlavaForConditionalGeneration",
        "idefics3": "Idefics3ForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    }[family]
    return getattr(transformers, cls).from_pretrained(path, dtype=torch.float32).eval()


def _language_module(ckpt: Checkpoint) -> torch.nn.Module:
    inner = ckpt.hf.model
    return inner.text_model if ckpt.family == "idefics3" else inner.language_model


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory) -> Checkpoint:
    family = request.param
    path = _builder(family).build(tmp_path_factory.mktemp(family) / "ckpt")
    placeholder = "<|image_pad|>" if family == "qwen2_5_vl" else "<image>"
    loaded = load_weights(path, device="cpu", dtype="float32")
    return Checkpoint(
        family=family,
        path=path,
        processor=_processor(family, path),
        hf=_hf_model(family, path),
        loaded=loaded,
        placeholder=placeholder,
        image_token_id=loaded.tokenizer.convert_tokens_to_ids(placeholder),
    )


# -- the reference side: the checkpoint's own processor and model --------------------------------


def _hf_conversation(messages: list[Message]) -> list[dict]:
    return [
        {
            "role": m.role,
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in m.content
            ],
        }
        for m in messages
    ]


def _processor_inputs(ckpt: Checkpoint, text: str, images: list) -> dict:
    if ckpt.family == "idefics3":  # one list of images per prompt
        return ckpt.processor(text=text, images=[images] if images else None, return_tensors="pt")
    return ckpt.processor(text=text, images=images or None, return_tensors="pt")


def _reference(ckpt: Checkpoint, messages: list[Message], photos: list) -> tuple[dict, Any]:
    """The processor's inputs for the conversation, and the full model's output on them."""
    text = ckpt.processor.apply_chat_template(
        _hf_conversation(messages), add_generation_prompt=True, tokenize=False
    )
    inputs = _processor_inputs(ckpt, text, photos)
    with torch.no_grad():
        out = ckpt.hf(**inputs)
    return inputs, out


def _image_rows(ckpt: Checkpoint, photo) -> torch.Tensor:
    """[N, H] the rows the full model puts at this image's tokens (its get_image_features)."""
    captured: dict[str, torch.Tensor] = {}

    def grab(_module, _args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"].detach().clone()

    inputs = _processor_inputs(ckpt, ckpt.placeholder, [photo])
    handle = _language_module(ckpt).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            ckpt.hf(**inputs)
    finally:
        handle.remove()
    mask = inputs["input_ids"][0] == ckpt.image_token_id
    return captured["embeds"][0][mask]  # [N, H]


def _layout(ckpt: Checkpoint, photo) -> ImageLayout:
    """How the checkpoint's processor expands one image's placeholder, as an ImageLayout."""
    inputs = _processor_inputs(ckpt, ckpt.placeholder, [photo])
    ids = inputs["input_ids"][0].tolist()
    pieces: list[str | int] = []
    i = 0
    while i < len(ids):
        j = i
        is_image = ids[i] == ckpt.image_token_id
        while j < len(ids) and (ids[j] == ckpt.image_token_id) == is_image:
            j += 1
        run = ids[i:j]
        pieces.append(len(run) if is_image else ckpt.processor.tokenizer.decode(run))
        i = j
    if ckpt.family != "qwen2_5_vl":
        return ImageLayout(ckpt.placeholder, tuple(pieces))
    merge = ckpt.hf.config.vision_config.spatial_merge_size
    t, h, w = (int(x) for x in inputs["image_grid_thw"][0])
    grid = [(ti, hi, wi) for ti in range(t) for hi in range(h // merge) for wi in range(w // merge)]
    return ImageLayout(
        ckpt.placeholder,
        tuple(pieces),
        mrope=tuple(v for pos in grid for v in pos),
        mrope_advance=max(h, w) // merge,
    )


def _image(ckpt: Checkpoint, name: str) -> tuple[ImageInput, Any]:
    photo = _photo(name)
    return ImageInput(f"sha-{name}", _image_rows(ckpt, photo), _layout(ckpt, photo)), photo


# -- our side: render + LoadedModel ------------------------------------------------------------


def _positions(ckpt: Checkpoint, prompt, start: int, end: int) -> torch.Tensor:
    if prompt.mrope is not None:
        return prompt.mrope[:, start:end].unsqueeze(1)  # [3, 1, T]
    return torch.arange(start, end).unsqueeze(0)  # [1, T]


def _our_logits(ckpt: Checkpoint, prompt, cuts: tuple[int, ...] = ()) -> torch.Tensor:
    """Last logits [vocab] of the prompt through decoder + lm_head, prefilled in pieces."""
    from transformers import DynamicCache

    w = ckpt.loaded
    cache = DynamicCache(config=w.model.config.get_text_config())
    bounds = [0, *cuts, prompt.length]
    hidden = None
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            embeds = embed_positions(w.embed, prompt, start, w.dtype, w.device, end=end)
            assert embeds.shape == (1, end - start, w.hidden_size)
            out = w.decoder(
                inputs_embeds=embeds,
                position_ids=_positions(ckpt, prompt, start, end),
                cache=cache,
                use_cache=True,
            )
            hidden = out.last_hidden_state[0, -1]  # [H]
        return w.lm_head(hidden)


def _conversation(ckpt: Checkpoint, *names: str) -> tuple[list[Message], list]:
    """A system line, a user turn with the first photo, and (with two photos) an answered turn
    followed by a question about the second photo placed after the text."""
    first, photo1 = _image(ckpt, names[0])
    messages = [Message("system", [SYSTEM]), Message("user", [first, "What is in this picture?"])]
    photos = [photo1]
    if len(names) > 1:
        second, photo2 = _image(ckpt, names[1])
        messages += [
            Message("assistant", ["A person in a white suit."]),
            Message("user", ["And in this one?", second]),
        ]
        photos.append(photo2)
    return messages, photos


def _as_ids(ckpt: Checkpoint, prompt) -> list[int]:
    return [ckpt.image_token_id if t == -1 else t for t in prompt.tokens]


# -- tests ----------------------------------------------------------------------------------------


def test_language_model_only(ckpt: Checkpoint) -> None:
    w = ckpt.loaded
    assert w.family == ckpt.family
    assert w.mrope is (ckpt.family == "qwen2_5_vl")
    assert w.hidden_size == ckpt.hf.config.get_text_config().hidden_size
    names = [n for n, _ in w.decoder.named_parameters()]
    assert not [n for n in names if "vision" in n or "visual" in n or "connector" in n]
    text_params = sum(p.numel() for p in _language_module(ckpt).parameters())
    assert sum(p.numel() for p in w.decoder.parameters()) == text_params
    assert torch.equal(w.lm_head.weight, ckpt.hf.lm_head.weight)
    assert w.embed is w.decoder.get_input_embeddings()
    assert w.model.config.get_text_config().hidden_size == w.hidden_size
    eos = ckpt.hf.generation_config.eos_token_id
    assert w.model.generation_config.eos_token_id == eos
    # the processor's chat template, not the tokenizer's own
    assert w.tokenizer.chat_template == ckpt.processor.chat_template


def test_tokens_match_processor(ckpt: Checkpoint) -> None:
    messages, photos = _conversation(ckpt, "astronaut")
    prompt = render(ckpt.loaded.tokenizer, messages, add_generation_prompt=True)
    inputs, _ = _reference(ckpt, messages, photos)
    assert _as_ids(ckpt, prompt) == inputs["input_ids"][0].tolist()
    assert prompt.image_tokens == messages[1].content[0].num_tokens
    # every -1 position is covered by exactly one span, and no two image rows share a key
    covered = sorted(p for s in prompt.images for p in range(s.start, s.start + s.length))
    assert covered == [i for i, t in enumerate(prompt.tokens) if t == -1]
    keys = [k for k in position_keys(prompt.tokens, prompt.images) if isinstance(k, tuple)]
    assert len(keys) == len(set(keys)) == prompt.image_tokens


def test_logits_match_full_model(ckpt: Checkpoint) -> None:
    messages, photos = _conversation(ckpt, "astronaut", "chelsea")
    prompt = render(ckpt.loaded.tokenizer, messages, add_generation_prompt=True)
    inputs, out = _reference(ckpt, messages, photos)
    assert _as_ids(ckpt, prompt) == inputs["input_ids"][0].tolist()
    expected = out.logits[0, -1]
    torch.testing.assert_close(_our_logits(ckpt, prompt), expected, rtol=0, atol=1e-4)
    # prefilled in pieces whose boundaries fall inside the images and the text between them
    first, second = prompt.images[0], prompt.images[-1]
    cuts = (
        first.start + first.length // 2,
        second.start - 1,
        second.start + second.length - 3,
    )
    torch.testing.assert_close(_our_logits(ckpt, prompt, cuts), expected, rtol=0, atol=1e-4)
    # and the image rows really matter: another photo in the second slot moves the logits
    other, _ = _image(ckpt, "coffee")
    swapped = [*messages[:3], Message("user", ["And in this one?", other])]
    moved = _our_logits(ckpt, render(ckpt.loaded.tokenizer, swapped, add_generation_prompt=True))
    assert (moved - expected).abs().max() > 1e-2


def test_text_only_turn_matches_template(ckpt: Checkpoint) -> None:
    messages = [Message("system", [SYSTEM]), Message("user", ["Hello there."])]
    prompt = render(ckpt.loaded.tokenizer, messages, add_generation_prompt=True)
    assert prompt.images == [] and prompt.mrope is None
    expected = ckpt.processor.apply_chat_template(
        _hf_conversation(messages), add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if isinstance(expected, dict) else expected
    if expected and isinstance(expected[0], list):
        expected = expected[0]
    assert prompt.tokens == list(expected)


def test_placeholder_in_text_is_refused(ckpt: Checkpoint) -> None:
    image, _ = _image(ckpt, "astronaut")
    messages = [Message("user", [image, f"what is {ckpt.placeholder} here?"])]
    with pytest.raises(ValueError, match="placeholder"):
        render(ckpt.loaded.tokenizer, messages, add_generation_prompt=True)
    # also without any image: the tokenizer knows the checkpoint's placeholder
    assert getattr(ckpt.loaded.tokenizer, STRUCTURED_CONTENT_ATTR) == ckpt.placeholder
    with pytest.raises(ValueError, match="placeholder"):
        render(
            ckpt.loaded.tokenizer,
            [Message("user", [f"a {ckpt.placeholder}"])],
            add_generation_prompt=True,
        )


def test_layout_must_match_rows(ckpt: Checkpoint) -> None:
    image, _ = _image(ckpt, "astronaut")
    short = ImageInput(image.digest, image.embeds[:-1], image.layout)
    with pytest.raises(ValueError, match="rows"):
        render(ckpt.loaded.tokenizer, [Message("user", [short])], add_generation_prompt=True)


def test_mrope_matches_get_rope_index(ckpt: Checkpoint) -> None:
    if ckpt.family != "qwen2_5_vl":
        pytest.skip("M-RoPE is Qwen2.5-VL's")
    messages, photos = _conversation(ckpt, "astronaut", "chelsea")
    prompt = render(ckpt.loaded.tokenizer, messages, add_generation_prompt=True)
    inputs, _ = _reference(ckpt, messages, photos)
    positions, deltas = ckpt.hf.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    assert prompt.mrope is not None and prompt.mrope.dtype == torch.long
    assert torch.equal(prompt.mrope, positions[:, 0])
    assert prompt.rope_delta == int(deltas[0, 0]) != 0


def test_mrope_keeps_original_positions_after_dropping(ckpt: Checkpoint) -> None:
    if ckpt.family != "qwen2_5_vl":
        pytest.skip("M-RoPE is Qwen2.5-VL's")
    image, _ = _image(ckpt, "astronaut")
    messages = [Message("user", [image, "Describe it."])]
    full = render(ckpt.loaded.tokenizer, messages, add_generation_prompt=True)
    rows = image.num_tokens
    keep = [r for r in range(rows) if r % 3 != 1]  # drop every third row
    grid = np.asarray(image.layout.mrope).reshape(rows, 3)[keep]
    pruned_layout = ImageLayout(
        image.layout.placeholder,
        (len(keep),),
        mrope=tuple(int(v) for v in grid.reshape(-1)),
        mrope_advance=image.layout.mrope_advance,
    )
    pruned = ImageInput(image.digest, image.embeds[keep], pruned_layout)
    prompt = render(
        ckpt.loaded.tokenizer,
        [Message("user", [pruned, "Describe it."])],
        add_generation_prompt=True,
    )
    span = full.images[0]
    kept_cols = [
        i
        for i in range(full.length)
        if not (span.start <= i < span.start + rows) or (i - span.start) in keep
    ]
    assert prompt.length == full.length - (rows - len(keep))
    assert torch.equal(prompt.mrope, full.mrope[:, kept_cols])
    # generation continues where the unpruned prompt would: same next rotary index
    assert prompt.length + prompt.rope_delta == full.length + full.rope_delta


def test_both_weight_layouts_load_the_same(ckpt: Checkpoint, tmp_path: Path) -> None:
    """transformers 5 saves some families in the older key layout; the newer one (and any
    pickle file lying next to the safetensors) must give the same language model."""
    from safetensors.torch import load_file, save_file

    renames = {
        "llava": (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
        ),
        "qwen2_5_vl": (("visual.", "model.visual."), ("model.", "model.language_model.")),
        "idefics3": (),
    }[ckpt.family]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt.path, copy)
    tensors = load_file(copy / "model.safetensors")
    out = {}
    for key, value in tensors.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out[key] = value
    save_file(out, copy / "model.safetensors", metadata={"format": "pt"})
    (copy / "pytorch_model.bin").write_bytes(b"not a pickle: never read")
    other = load_weights(copy, device="cpu", dtype="float32")
    for (name, a), (_, b) in zip(
        ckpt.loaded.decoder.state_dict().items(), other.decoder.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(ckpt.loaded.lm_head.weight, other.lm_head.weight)


def test_unsupported_architecture_names_families(tmp_path: Path) -> None:
    config = {
        "model_type": "paligemma",
        "vision_config": {"model_type": "siglip_vision_model"},
        "text_config": {"model_type": "gemma"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpoint) as info:
        load_weights(tmp_path, device="cpu")
    message = str(info.value)
    assert "paligemma" in message
    for family in ("llava", "idefics3", "qwen2_5_vl"):
        assert family in message


def test_family_encoder_agrees(ckpt: Checkpoint) -> None:
    """The encoder side's family module (when present) makes the rows and layout used here."""
    from encoder_worker.families.family import FAMILIES

    module = FAMILIES[json.loads((ckpt.path / "config.json").read_text())["model_type"]]
    if importlib.util.find_spec(f"encoder_worker.families.{module}") is None:
        pytest.skip(f"encoder_worker.families.{module} is not there yet")
    from encoder_worker.families import load_family

    family = load_family(ckpt.path, torch.device("cpu"), torch.float32)
    photo = _photo("astronaut")
    out = family.encode(np.asarray(photo))
    layout = family.layout(list(out.runs), out)
    expected = _layout(ckpt, photo)
    assert layout.placeholder == expected.placeholder
    assert layout.pieces == expected.pieces
    assert layout.mrope == expected.mrope
    assert layout.mrope_advance == expected.mrope_advance
    torch.testing.assert_close(out.embeds.float(), _image_rows(ckpt, photo), rtol=0, atol=1e-4)
