"""Encoder benchmark: the classic pipeline and visiongate's, side by side, on real photos.

    python -m bench.encoder --out DIR [--vision-model CHECKPOINT_DIR] [--repeats 3]

Baseline: Pillow decode at full size, Pillow resize + crop, numpy normalize, the whole tower
(transformers forward with every hidden state, all layers), all patch tokens through the
projector, stored as fp32.
Optimized: `EncoderPipeline` (reduced-scale decode, fused resize/normalize/patchify, tower
stopped at the feature layer with CLS-row saliency, patch dropping, projector on kept tokens,
INT4 payload).

Both see the same tower weights and the same projector, in one process, alternating runs so
machine noise hits both alike. Writes DIR/encoder.json and DIR/encoder.png.

Real VLM checkpoints (LLaVA, SmolVLM / Idefics3, Qwen2.5-VL) get the quality table of patch
dropping + INT4 instead, measured through each checkpoint's own language model
(`bench._encoder_vlm`):

    python -m bench.encoder --out DIR --vision-model VLM_DIR [--vision-model VLM_DIR2 ...]
    python -m bench.encoder --out DIR --tiny-families    # tiny random-weight checkpoints

It writes DIR/encoder_vlm.json and DIR/encoder_vlm.png. A CLIP / SigLIP `--vision-model` still
runs the benchmark above with that tower.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import skimage.data
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

from encoder_worker.config import PRUNING_MODES, EncoderConfig
from encoder_worker.patch_rows import pil_preprocess, preprocess_batch
from encoder_worker.payload import quantize_tokens, to_embeds
from encoder_worker.pipeline import EncoderPipeline
from encoder_worker.pruning import prune
from encoder_worker.tower import SYNTHETIC_SHAPES, _synthetic_model

__all__ = ("Baseline", "main", "photo_bytes", "throughput")

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry")
STAGES = ("decode", "preprocess", "vision", "prune", "project", "quantize")


def photo_bytes() -> dict[str, bytes]:
    out = {}
    for name in PHOTOS:
        buf = io.BytesIO()
        Image.fromarray(getattr(skimage.data, name)()).save(buf, "JPEG", quality=95)
        out[name] = buf.getvalue()
    return out


class Baseline:
    """The stateless path: full decode, Pillow preprocessing, full tower, fp32 storage."""

    def __init__(self, pipe: EncoderPipeline, cfg: EncoderConfig) -> None:
        if cfg.tower in SYNTHETIC_SHAPES:
            self.model = _synthetic_model(cfg.tower, cfg.seed, feature_layer=-1)  # every layer
        else:
            from transformers import CLIPVisionModel, SiglipVisionModel

            cls = SiglipVisionModel if pipe.tower.kind == "siglip" else CLIPVisionModel
            self.model = cls.from_pretrained(cfg.tower, local_files_only=True, use_safetensors=True)
        # same device and dtype as the optimized pipeline: on CUDA the classic path runs its
        # tower there too, so the comparison is of the pipelines, not of the devices
        self.device, self.dtype = pipe.device, pipe.dtype
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.spec, self.projector = pipe.spec, pipe.projector
        self.feature_layer, self.has_cls = cfg.feature_layer, pipe.tower.has_cls

    def _lap(self, t: float) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return _lap(t)

    @torch.inference_mode()
    def encode_batch(
        self, datas: list[bytes]
    ) -> tuple[list[torch.Tensor], list[int], dict[str, float]]:
        ms: dict[str, float] = {}
        t = time.perf_counter()
        arrs = [np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in datas]
        ms["decode"], t = self._lap(t)
        pixels = torch.from_numpy(np.stack([pil_preprocess(a, self.spec) for a in arrs]))
        pixels = pixels.to(self.device, self.dtype)
        ms["preprocess"], t = self._lap(t)
        out = self.model(pixel_values=pixels, output_hidden_states=True)
        feats = out.hidden_states[self.feature_layer][:, 1 if self.has_cls else 0 :]  # [B, N, D]
        ms["vision"], t = self._lap(t)
        ms["prune"] = 0.0
        embeds = [self.projector(f).float().cpu() for f in feats]  # all tokens
        ms["project"], t = self._lap(t)
        sizes = [len(e.numpy().astype(np.float32).tobytes()) for e in embeds]
        ms["quantize"], t = self._lap(t)  # here: serializing fp32
        return embeds, sizes, {k: v / len(datas) for k, v in ms.items()}


def throughput(
    base: Baseline,
    pipe: EncoderPipeline,
    datas: list[bytes],
    batch: int,
    repeats: int,
    warmup: int = 0,
) -> dict[str, list[float]]:
    """images/s of each pipeline on `batch` images (the photos repeated), one value per round.

    Runs alternate between the two so machine noise hits both alike; `warmup` untimed rounds
    first (CUDA: kernels compiled and tuned for this batch shape). Both `encode_batch` methods
    wait for the device before they return, so wall time is the whole work.
    """
    images = (datas * -(-batch // len(datas)))[:batch]
    for _ in range(warmup):
        base.encode_batch(images)
        pipe.encode_batch(images)
    rates: dict[str, list[float]] = {"baseline": [], "optimized": []}
    for _ in tqdm(range(repeats), desc=f"batch {batch}", unit="round"):
        t = time.perf_counter()
        base.encode_batch(images)
        rates["baseline"].append(batch / (time.perf_counter() - t))
        t = time.perf_counter()
        pipe.encode_batch(images)
        rates["optimized"].append(batch / (time.perf_counter() - t))
    return rates


def _lap(t: float) -> tuple[float, float]:
    now = time.perf_counter()
    return (now - t) * 1e3, now


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten()[None], b.flatten()[None]))


@torch.inference_mode()
def fidelity(pipe: EncoderPipeline, cfg: EncoderConfig, photos: dict[str, bytes]) -> dict:
    """Token cosine of INT4 vs float, and pooled-embedding cosine of each pruning mode.

    Each mode's pooled embedding is compared against the one over all tokens.
    """
    int4_cos, per_mode = [], {m: {"kept": [], "pooled_cosine": []} for m in PRUNING_MODES}
    for name, data in photos.items():
        arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()
        rows = preprocess_batch([torch.from_numpy(arr)], pipe.spec, pipe.device, pipe.dtype)
        out = pipe.tower(rows)
        full = pipe.projector(out.features[0]).mean(0)  # pooled over all tokens
        for mode in PRUNING_MODES:
            mcfg = EncoderConfig(**{**_fields(cfg), "pruning": mode})
            (p,) = prune(
                out.features, out.saliency, out.keys, mcfg, seeds=[zlib.crc32(name.encode())]
            )
            emb = pipe.projector(p.tokens)
            deq = to_embeds(quantize_tokens(emb, p.positions, rows.shape[1], cfg.int4_group_size))
            per_mode[mode]["kept"].append(p.tokens.shape[0])
            per_mode[mode]["pooled_cosine"].append(_cos(deq.mean(0), full))
            if mode == cfg.pruning:
                int4_cos.extend(F.cosine_similarity(emb.float().cpu(), deq, dim=1).tolist())
    table = {
        m: {
            "tokens_kept_mean": statistics.fmean(v["kept"]),
            "pooled_cosine_mean": statistics.fmean(v["pooled_cosine"]),
        }
        for m, v in per_mode.items()
    }
    return {
        "int4_token_cosine_mean": statistics.fmean(int4_cos),
        "int4_token_cosine_min": min(int4_cos),
        "modes": table,
    }


def _fields(cfg: EncoderConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__struct_fields__}


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = EncoderConfig(
        tower=args.vision_model or "vit-b16-224",
        pruning=args.pruning,
        int4_group_size=args.group_size,
    )
    print(f"building towers ({cfg.tower}) ...", flush=True)
    pipe = EncoderPipeline(cfg, args.hidden, target_rms=args.target_rms)
    base = Baseline(pipe, cfg)
    photos = photo_bytes()
    names, datas = list(photos), list(photos.values())
    pipe.encode_batch(datas[:1])
    base.encode_batch(datas[:1])  # warm both

    single = {"baseline": [], "optimized": []}
    stages = {"baseline": {s: [] for s in STAGES}, "optimized": {s: [] for s in STAGES}}
    kept, stored, base_bytes, fid_pooled = {}, {}, {}, []
    for _ in tqdm(range(args.repeats), desc="batch 1 (per image)", unit="round"):
        for name, data in zip(names, datas, strict=False):
            t = time.perf_counter()
            b_emb, b_size, b_ms = base.encode_batch([data])
            single["baseline"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            (r,) = pipe.encode_batch([data])
            single["optimized"].append((time.perf_counter() - t) * 1e3)
            for s in STAGES:
                stages["baseline"][s].append(b_ms[s])
                stages["optimized"][s].append(r.timings_ms.get(s, 0.0))
            kept[name], stored[name], base_bytes[name] = r.tokens_kept, r.payload.nbytes, b_size[0]
            if len(fid_pooled) < len(names):
                fid_pooled.append(_cos(r.embeds().mean(0), b_emb[0].mean(0)))

    batch8 = throughput(base, pipe, datas, 8, args.repeats)

    print("measuring fidelity of every pruning mode ...", flush=True)
    fid = fidelity(pipe, cfg, photos)
    med = {k: statistics.median(v) for k, v in single.items()}
    stage_ms = {k: {s: statistics.median(v[s]) for s in STAGES} for k, v in stages.items()}
    n_total = pipe.tokens_total
    fp16_bytes = {n: kept[n] * args.hidden * 2 for n in names}
    result = {
        "config": {
            **_fields(cfg),
            "hidden_size": args.hidden,
            "target_rms": args.target_rms,
            "device": str(pipe.device),
            "dtype": str(pipe.dtype),
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "photos": names,
        },
        "summary": {
            "speedup_vs_baseline": med["baseline"] / med["optimized"],
            "throughput_speedup_batch8": statistics.median(batch8["optimized"])
            / statistics.median(batch8["baseline"]),
            "tokens_kept_ratio_mean": statistics.fmean(kept.values()) / n_total,
            "int4_bytes_ratio_vs_fp16": sum(stored.values()) / sum(fp16_bytes.values()),
            "bytes_ratio_vs_baseline_fp32": sum(stored.values()) / sum(base_bytes.values()),
            "int4_token_cosine_mean": fid["int4_token_cosine_mean"],
            "pooled_cosine_pruned_vs_full": statistics.fmean(fid_pooled),
        },
        "ms_per_image_batch1": med,
        "stage_ms": stage_ms,
        "images_per_s": {
            "batch1": {k: 1e3 / v for k, v in med.items()},
            "batch8": {k: statistics.median(v) for k, v in batch8.items()},
        },
        "tokens_total": n_total,
        "tokens_kept": kept,
        "bytes_per_image": {
            "optimized_int4": stored,
            "baseline_fp32": base_bytes,
            "fp16_of_kept": fp16_bytes,
        },
        "fidelity": {
            "int4_token_cosine_mean": fid["int4_token_cosine_mean"],
            "int4_token_cosine_min": fid["int4_token_cosine_min"],
            "pooled_cosine_pruned_vs_full_per_image": dict(zip(names, fid_pooled, strict=False)),
            "pruning_modes": fid["modes"],
        },
    }
    pipe.close()
    return result


def print_table(res: dict) -> None:
    b, o = res["stage_ms"]["baseline"], res["stage_ms"]["optimized"]
    print(f"\n{'stage (ms/image, batch 1)':<28}{'baseline':>12}{'optimized':>12}")
    for s in STAGES:
        print(f"{s:<28}{b[s]:>12.1f}{o[s]:>12.1f}")
    m = res["ms_per_image_batch1"]
    print(f"{'end to end':<28}{m['baseline']:>12.1f}{m['optimized']:>12.1f}")
    ips = res["images_per_s"]
    for k in ("batch1", "batch8"):
        print(f"{'images/s ' + k:<28}{ips[k]['baseline']:>12.2f}{ips[k]['optimized']:>12.2f}")
    n = res["tokens_total"]
    kept = statistics.fmean(res["tokens_kept"].values())
    print(f"{'tokens per image':<28}{n:>12}{kept:>12.1f}")
    bb = statistics.fmean(res["bytes_per_image"]["baseline_fp32"].values())
    ob = statistics.fmean(res["bytes_per_image"]["optimized_int4"].values())
    print(f"{'bytes stored per image':<28}{bb:>12.0f}{ob:>12.0f}")
    print("\npruning mode      tokens kept   pooled cosine vs all tokens (INT4)")
    for mode, v in res["fidelity"]["pruning_modes"].items():
        print(f"{mode:<18}{v['tokens_kept_mean']:>11.1f}   {v['pooled_cosine_mean']:.4f}")
    print("\nsummary:")
    for k, v in res["summary"].items():
        print(f"  {k:<34}{v:.4f}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.5))
    labels = ["baseline", "optimized"]
    bottom = np.zeros(2)
    for s in STAGES:
        vals = np.array([res["stage_ms"][k][s] for k in labels])
        ax1.bar(labels, vals, bottom=bottom, label=s)
        bottom += vals
    ax1.set_ylabel("ms per image (batch 1)")
    ax1.set_title(f"latency, {res['summary']['speedup_vs_baseline']:.2f}x faster")
    ax1.legend(fontsize=8)
    ips = res["images_per_s"]
    x = np.arange(2)
    ax2.bar(x - 0.2, [ips["batch1"][k] for k in labels], 0.4, label="batch 1")
    ax2.bar(x + 0.2, [ips["batch8"][k] for k in labels], 0.4, label="batch 8")
    ax2.set_xticks(x, labels)
    ax2.set_ylabel("images / s")
    ax2.set_title("throughput")
    ax2.legend(fontsize=8)
    bb = statistics.fmean(res["bytes_per_image"]["baseline_fp32"].values())
    ob = statistics.fmean(res["bytes_per_image"]["optimized_int4"].values())
    ax3.bar(labels, [bb / 1024, ob / 1024], color=["tab:gray", "tab:green"])
    ax3.set_ylabel("KiB stored per image")
    s = res["summary"]
    ax3.set_title(
        f"storage ({s['tokens_kept_ratio_mean']:.0%} tokens, "
        f"INT4 cos {s['int4_token_cosine_mean']:.3f})"
    )
    fig.suptitle(f"visiongate encoder on {res['config']['device']} ({res['config']['tower']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Without --vision-model / --tiny-families: the synthetic ViT-B/16 tower, "
        "baseline vs "
        "optimized pipeline (encoder.json, encoder.png). With VLM checkpoints: next-token "
        "agreement and logit cosine of the optimized encodings vs the exact one, through the "
        "checkpoint's language model (encoder_vlm.json, encoder_vlm.png).",
    )
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--vision-model",
        action="append",
        default=[],
        metavar="DIR",
        help="local checkpoint directory, repeatable: a VLM checkpoint (LLaVA, SmolVLM / "
        "Idefics3, Qwen2.5-VL) joins the quality table; one CLIP/SigLIP vision checkpoint "
        "replaces the synthetic tower of the baseline-vs-optimized benchmark",
    )
    ap.add_argument(
        "--tiny-families",
        action="store_true",
        help="build tiny random-weight LLaVA, Idefics3 and Qwen2.5-VL checkpoints in a temporary "
        "directory and add them to the quality table (uses the builders in tests/vlm_checkpoints, "
        "importable from a repository checkout, and the SmolLM2 tokenizer of `visiongate "
        "convert`; their agreement numbers show the machinery, not model quality)",
    )
    ap.add_argument(
        "--greedy-tokens",
        type=int,
        default=8,
        help="VLM table: greedy continuation length compared with the reference",
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="VLM table: where the encoder and the language model run",
    )
    ap.add_argument("--pruning", default="dynamic", choices=PRUNING_MODES)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=576, help="language model hidden size")
    ap.add_argument("--target-rms", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=3)
    return ap


def _split_models(ap: argparse.ArgumentParser, dirs: list[str]) -> tuple[list[str], str | None]:
    """--vision-model dirs -> (VLM checkpoints, the one CLIP/SigLIP tower or None)."""
    from encoder_worker.config import tower_family
    from encoder_worker.families import UnsupportedCheckpoint

    vlms, towers = [], []
    for d in dirs:
        if not os.path.isdir(d):
            ap.error(f"--vision-model {d} is not a directory")
        try:
            (vlms if tower_family(d) is not None else towers).append(d)
        except UnsupportedCheckpoint as exc:
            ap.error(str(exc))
    if len(towers) > 1:
        ap.error(f"at most one CLIP/SigLIP --vision-model, got {len(towers)}: {towers}")
    return vlms, towers[0] if towers else None


def run_vlm(args: argparse.Namespace, checkpoints: list[str]) -> list[dict]:
    """The quality table for each VLM checkpoint (and the tiny ones with --tiny-families)."""
    import tempfile

    from bench import _encoder_vlm as vlm
    from bench._encoder_vlm_report import print_family_table

    torch.manual_seed(0)
    photos = photo_bytes()
    results = []
    with tempfile.TemporaryDirectory(prefix="vg-tiny-vlm-") as tmp:
        todo = [(Path(c), False) for c in checkpoints]
        if args.tiny_families:
            print("building tiny random-weight checkpoints ...", file=sys.stderr, flush=True)
            todo += [(p, True) for p in vlm.build_tiny_checkpoints(Path(tmp))]
        for path, tiny in todo:
            res = vlm.measure_checkpoint(
                path,
                photos,
                repeats=args.repeats,
                steps=args.greedy_tokens,
                device=args.device,
                random_weights=tiny,
            )
            if tiny:
                res["checkpoint"] = f"tiny {res['family']} (tests/vlm_checkpoints, seed 0)"
            print_family_table(res)
            results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.greedy_tokens < 1:
        ap.error("--repeats and --greedy-tokens must be >= 1")
    vlms, tower = _split_models(ap, args.vision_model)
    args.vision_model = tower
    args.out.mkdir(parents=True, exist_ok=True)
    if vlms or args.tiny_families:
        from bench import _encoder_vlm as vlm
        from bench._encoder_vlm_report import plot_vlm
        from gateway.telemetry import configure_logging

        configure_logging("warning")
        try:
            results = run_vlm(args, vlms)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        doc = {
            "machine": {
                "device": results[0]["device"],
                "threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
            },
            "configs": {k: {"pruning": p, "visual_tokens": v} for k, (p, v) in vlm.CONFIGS.items()},
            "families": results,
        }
        (args.out / "encoder_vlm.json").write_text(json.dumps(doc, indent=2))
        plot_vlm(results, args.out / "encoder_vlm.png")
        print(f"\nwrote {args.out / 'encoder_vlm.json'} and {args.out / 'encoder_vlm.png'}")
        if tower is None:
            return 0
    res = run(args)
    print_table(res)
    (args.out / "encoder.json").write_text(json.dumps(res, indent=2))
    plot(res, args.out / "encoder.png")
    print(f"\nwrote {args.out / 'encoder.json'} and {args.out / 'encoder.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
