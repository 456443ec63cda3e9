"""The bodies the `openai` engine sends its replicas.

The request (`POST {base_url}/v1/chat/completions`, Bearer key when the replica has one)::

    {"model": NAME, "stream": true, "stream_options": {"include_usage": true},
     "messages": [{"role": "system" | "user" | "assistant", "content": CONTENT}, ...],
     "max_tokens": M, "max_completion_tokens": M, "temperature": T, "top_p": P, "n": N,
     "seed": S,                              # when set
     "stop": [...],                          # when set
     "logprobs": true, "top_logprobs": K,    # when log-probabilities are asked for
     "structured_outputs": {"grammar": G}}   # constrained output (tools, response formats)

CONTENT is a string (the message's text parts joined by newlines) when a message has no
image, else a list of parts in order: `{"type": "text", "text": ...}` and, per image,

- bytes mode (`image_input == "bytes"`, settings `upstream_images = "data_url"`)::

    {"type": "image_url", "uuid": DIGEST,
     "image_url": {"url": "data:<mime>;base64,<bytes>", "content_hash": "sha256:<hex>"}}

  DIGEST is the gateway's content id: vLLM keys its multimodal cache by the part's `uuid`
  (so a replica that saw the image skips decoding and encoding it); SGLang takes a caller's
  digest as `image_url.content_hash` ("sha256:" and the 64 hex digits of the bytes, which it
  checks), so that one is sent only when the content id is the bytes' own sha256 (not when
  images are private to each API key and the id is a per-key name). Other servers ignore
  both fields.

- embeds mode (`"embeds"`; vLLM started with `--enable-mm-embeds`)::

    {"type": "image_embeds", "uuid": "<fingerprint16>:<sha256>", "image_embeds": B64}

  B64 is the image's visual tokens [N, hidden] serialized as vLLM's own `tensor2base64`
  does (`torch.save` of the tensor, base64): the replica loads it with
  `torch.load(weights_only=True)`. For M-RoPE checkpoints (Qwen2-VL, Qwen2.5-VL) the part is
  the dict form vLLM documents, `"image_embeds": {"image_embeds": B64, "image_grid_thw":
  B64([t, h, w])}`, the grid in patches before the spatial merge, one 1-D tensor of 3 per
  image (vLLM stacks the images' grids; a [1, 3] grid is refused with "size_per_item should be
  a 1-D tensor"). vLLM accepts image embeds in
  one message per request only; the upstream's 400 says so when a conversation has more.

A plain-text prompt (`raw_prompt`) goes to `/v1/completions` with `prompt` instead of
`messages` (and `logprobs: K`, the completions form).

Constrained output: tools, `tool_choice` and response formats are planned by the gateway as for
its own engine (`gateway.chat.output_grammar`): the tools are described in the prompt's text,
and one grammar G (llguidance's Lark, JSON schemas embedded as `%json`) makes the answer one of
the allowed shapes; the gateway reads calls back from the streamed text. G goes as vLLM's
`structured_outputs.grammar`. vLLM's "auto" structured-output backend hands a grammar that
xgrammar cannot take (any with `%json`) to llguidance; `--structured-outputs-config
'{"backend": "guidance"}'` sends every one there. No `tools` field is sent, so the replica needs
no tool-call parser (`--enable-auto-tool-choice`, `--tool-call-parser`): with one, it still
leaves the text alone. A replica that takes no such grammar (SGLang and TensorRT-LLM name
theirs differently) answers 400, passed on as `invalid_request` with its words.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.engine.interface import ImageInput

if TYPE_CHECKING:
    from gateway.engine.interface import GenerationRequest, ImageInputKind
    from gateway.engine.upstream.wire import ImageParts

__all__ = ("request_body",)


def request_body(
    request: GenerationRequest, images: ImageParts, image_input: ImageInputKind, *, salted: bool
) -> tuple[str, dict[str, Any]]:
    """The path and body of `request`, without "model" (one per replica); `salted`: with the
    prefix-cache namespace of its API key, when it has one."""
    s = request.sampling
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    if request.raw_prompt is not None:
        path = "/v1/completions"
        body["prompt"] = request.raw_prompt
    else:
        path = "/v1/chat/completions"
        body["messages"] = [
            {"role": m.role, "content": _content(m.content, images, image_input)}
            for m in request.messages
        ]
    if salted and request.cache_salt is not None:
        # vLLM's prefix-cache namespace: blocks are shared only between requests of one
        # API key (a hash of the key's owner id, which itself names no key)
        body["cache_salt"] = _salt_of(request.cache_salt)
    body["max_tokens"] = s.max_output_tokens
    if request.raw_prompt is None:
        body["max_completion_tokens"] = s.max_output_tokens
    body["temperature"] = s.temperature
    body["top_p"] = s.top_p
    body["n"] = max(1, s.n)
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.logprobs is not None:
        if request.raw_prompt is not None:
            body["logprobs"] = s.logprobs
        else:
            body["logprobs"] = True
            body["top_logprobs"] = s.logprobs
    if s.grammar is not None:
        body["structured_outputs"] = {"grammar": s.grammar}
    return path, body


def _content(
    parts: Sequence[str | ImageInput], images: ImageParts, image_input: ImageInputKind
) -> str | list[dict[str, Any]]:
    if all(isinstance(p, str) for p in parts):
        return "\n".join(parts)  # type: ignore[arg-type]
    return [
        {"type": "text", "text": p} if isinstance(p, str) else images.get(p, image_input)
        for p in parts
    ]


def _salt_of(owner: str) -> str:
    return hashlib.sha256(f"visiongate-cache-salt\0{owner}".encode()).hexdigest()
