"""The `cocodiff` command: a thin layer over `GenerateSpec`, the launcher and the rank jobs.

    cocodiff generate [--model tiny-shapes] [--nproc 4] ...   sequence-parallel generation, PNG + table
    cocodiff verify   [--model tiny-shapes] [--nproc 4] ...   parallel vs one process, exit 1 if they differ
    cocodiff serve    [--model tiny-shapes] [--port 8000] ... an OpenAI-compatible image (or video) service
    cocodiff footprint --model flux1-dev --nproc 8 ...        memory per rank, part by part, without loading
    cocodiff train-tiny --out DIR                             train tiny-shapes from scratch (2 CPU cores)

Without torchrun the command spawns `--nproc` local ranks itself; under torchrun it uses the
launcher's ranks (any number of nodes). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from importlib import import_module
from typing import Any, Callable, NoReturn

from .config.flags import (
    add_offload_argument,
    add_parallel_vae_argument,
    add_shard_weights_argument,
    ascii_int,
)
from .output.tables import print_table, write_json

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(parser: argparse.ArgumentParser, serve: bool = False) -> None:
    """The model, generation and parallel flags; `serve` leaves out the one-image ones (prompt, batch, JSON)."""
    from .config.parallel import COMM_CHOICES, DEFAULT_PROMPT, DTYPE_NAMES, PATCH_TEXT
    from .models.presets import PRESETS
    from .models.quantize import MODES as QUANTIZE_MODES
    from .run.lifetime import add_timeout_argument

    parser.add_argument("--model", default="tiny-shapes", help=f"preset ({', '.join(PRESETS)}) or a local directory / hub id")
    if not serve:
        parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt")
    parser.add_argument("--steps", type=ascii_int, default=None, help="denoising steps (default: the preset's; 4 otherwise)")
    parser.add_argument("--height", type=ascii_int, default=None, help="image height in pixels (default: the preset's; 256 otherwise)")
    parser.add_argument("--width", type=ascii_int, default=None, help="image width in pixels (default: the preset's; 256 otherwise)")
    parser.add_argument("--seed", type=ascii_int, default=0, help="seed of the initial noise (and of preset weights)")
    parser.add_argument("--frames", type=ascii_int, default=None, metavar="N",
                        help="video models: frames of the clip (default: the preset's; the pipeline's otherwise)"
                             + ("; serve: of a request that gives none" if serve else ""))
    if not serve:
        parser.add_argument("--batch", type=ascii_int, default=1, help="images per prompt")
        parser.add_argument("--image", type=Path, action="append", default=None, metavar="PATH",
                            help="start from this image (image-to-image; its size is the output's); with an edit model "
                                 "(FLUX.2, FLUX.1 Kontext, Qwen-Image-Edit, Z-Image-Omni): a reference image, repeat for several")
        parser.add_argument("--last-frame", type=Path, default=None, metavar="PATH",
                            help="image-to-video with Wan (2.1 FLF2V, 2.2 A14B I2V): the clip's last frame, --image its first")
        parser.add_argument("--mask", type=Path, default=None, metavar="PATH",
                            help="with --image: inpaint where the mask is white, keep the rest")
        parser.add_argument("--strength", type=float, default=None, metavar="S",
                            help="with --image: how far it is noised, in (0, 1] (default: 0.6 image-to-image, 1 inpainting)")
    if not serve:
        parser.add_argument("--lora", action="append", default=None, metavar="PATH[:SCALE]",
                            help="a LoRA adapter in diffusers' format (a .safetensors file or a folder holding one), "
                                 "fused into the weights at SCALE (default 1); repeat for several")
    parser.add_argument("--quantize", default=None, choices=list(QUANTIZE_MODES), metavar="MODE",
                        help="LOSSY: the transformer's linear weights quantized through torchao: int8wo (int8 weights), "
                             "int8dq (int8 weights and activations), float8wo (fp8 weights), float8dq (fp8 weights and "
                             "matmuls: GPUs of compute capability 8.9 or more); or float8storage (fp8 storage of the "
                             "linear and convolution weights, each layer cast to the run's dtype as it runs: diffusers' "
                             "layerwise casting); default: as loaded")
    parser.add_argument("--quantize-text-encoders", action="store_true",
                        help="with --quantize: the text encoders' weights quantized in the same mode (LOSSY)")
    parser.add_argument("--attention-backend", default=None, metavar="NAME",
                        help="the attention kernel, a backend of diffusers' dispatcher: native, flash, _flash_3, "
                             "_native_cudnn, sage, xformers, flex, ... (auto: native, torch's SDPA, which picks a fused "
                             "kernel per call on GPUs); default: torch's SDPA as the processors call it")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                        help="compute dtype; auto: a checkpoint's bfloat16 on GPUs, float32 for presets and on the CPU")
    parser.add_argument("--nproc", type=ascii_int, default=4, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--ranks-per-node", type=ascii_int, default=None, help="ranks sharing a node (default: the launcher's)")
    parser.add_argument("--levels", default=None, metavar="NAME=SIZE,...",
                        help="the hierarchy, outermost (nodes) first, e.g. node=2,card=2,tile=2 (sizes multiply to the "
                             "ranks; --ranks-per-node N is node=ranks/N,rank=N); --comm tapa-full runs one phase per level")
    parser.add_argument("--comm", default="flat", choices=list(COMM_CHOICES), help="all-to-all mechanism")
    parser.add_argument("--plan", default=None, metavar="PLAN",
                        help="how the ranks share the work: u4r2, ring=2,ulysses=4, ... (axes outermost first) or auto "
                             "(default: Ulysses over every rank, ring past the head count)")
    parser.add_argument("--v-first", action=argparse.BooleanOptionalAction, default=None,
                        help="start V's all-to-all before Q/K norm and RoPE (lossless; default on, "
                             "with --comm auto decided by timing)")
    parser.add_argument("--fuse-qk", action=argparse.BooleanOptionalAction, default=True,
                        help="send Q and K as one message")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the transformer's repeated blocks, exchanges included (fixed --comm and --plan)")
    add_shard_weights_argument(parser)
    add_offload_argument(parser)
    parser.add_argument("--v-major", default="off", metavar="SCHEDULE",
                        help="LOSSY: reuse cached projections on inter-node links; off|linear|constant:R|warmup:N,linear|adaptive:EPS (needs --comm tapa or flat)")
    parser.add_argument("--v-major-tensors", default="v", choices=["v", "vqk"], help="V-Major: skip V only, or V, Q and K")
    parser.add_argument("--v-major-max-memory", type=ascii_int, default=None, metavar="BYTES", help="V-Major: cache bytes per rank")
    parser.add_argument("--wire", default=None, metavar="LEVEL=FORMAT[,...]",
                        help="LOSSY: messages over a level travel packed, e.g. node=fp8 or node=fp8,card=bf16 (formats "
                             "bf16, fp8, int8; levels as --levels names them, node and rank with --ranks-per-node); "
                             "the other levels stay exact, K at bf16 at least")
    if not serve:
        parser.add_argument("--pipe-patches", default=None, metavar="M",
                            help="LOSSY: with p in --plan, one image's step in M patches that follow each other through "
                                 "the stages, each attending to the last step's keys and values where this step's are not "
                                 "there yet (displaced, as PipeFusion); auto: twice the stages (default: whole images, exact)")
        parser.add_argument("--pipe-warmup", type=ascii_int, default=None, metavar="K",
                            help="with --pipe-patches: the first K steps run whole and exactly, filling the buffers (default 1)")
        parser.add_argument("--pipe-text", default=None, choices=list(PATCH_TEXT),
                            help="with --pipe-patches: the whole text recomputed by every patch (closer to the exact "
                                 "run), or cut into the patches like the image (no token computed twice; default whole)")
    else:
        parser.set_defaults(pipe_patches=None, pipe_warmup=None, pipe_text=None)
    add_parallel_vae_argument(parser)
    parser.add_argument("--lossy-budget", default=None, metavar="DB",
                        help="LOSSY, with --comm auto: also try a wire format on the nodes whose measured PSNR on this "
                             "model meets the budget, e.g. 40dB (default: auto is never lossy)")
    parser.add_argument("--cache", default=None, metavar="SPEC",
                        help="LOSSY: skip a step's middle blocks when the last step did their work, decided by all "
                             "ranks together: fbcache[:THRESH] (F1B0,0.05), dbcache[:F<n>B<n>W<n>MC<n>O<n>][,THRESH] "
                             "(F8B0W8,0.08), taylorseer[:F<n>B<n>N<n>O<n>W<n>] (F0B0N2O1W2), "
                             "teacache[:W<n>MC<n>O<n>][,THRESH] (0.25), magcache[:W<n>MC<n>O<n>][,THRESH] (MC3,0.06; "
                             "the first run calibrates); O<n> extrapolates the reused residual (TaylorSeer, order n)"
                             + ("; serve: the cache of every request that names none in its `cache` field (a request's "
                                "own, or null / 'off' for none, overrides it; each request keeps its own cache state "
                                "through the step-level batch; magcache uses the curve a generate run stored)" if serve else ""))
    if not serve:
        parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    else:
        parser.set_defaults(prompt=DEFAULT_PROMPT, batch=1, json=None, image=None, mask=None, strength=None, last_frame=None)
    add_timeout_argument(parser)


LIGHT_COMMANDS = ("cluster", "simulate")
"""Commands whose flags and work need neither torch nor diffusers: a call of one builds its own
parser only (`cocodiff cluster status` in a fraction of a second, not after the presets load)."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or with `only` (one of LIGHT_COMMANDS) that command's alone."""
    from .cluster import cli as cluster_cli
    from .simulate import cli as simulate_cli

    parser = _Parser(prog="cocodiff", description="Distributed inference for Diffusion Transformers (Ulysses sequence parallelism).")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if only is not None:
        {"cluster": cluster_cli, "simulate": simulate_cli}[only].add_parser(commands)
        return parser
    from .bench import cli as bench_cli
    from .footprint import cli as footprint_cli
    from .matrix import cli as matrix_cli

    generate = commands.add_parser("generate", help="generate an image sequence-parallel and report per-step figures")
    _common(generate)
    generate.add_argument("--out", type=Path, default=None,
                          help="where rank 0 writes the image, in the format its extension names (default cocodiff.png); "
                               "with --batch N above 1: NAME-0.png ... NAME-{N-1}.png; a video model writes an MP4 "
                               "(default cocodiff.mp4) and the PNG of its first frame beside it")
    verify = commands.add_parser("verify", help="check that the parallel run equals one process")
    _common(verify)
    serve = commands.add_parser("serve", help="serve images (OpenAI images API) or videos (its videos API) over HTTP from every rank")
    _common(serve, serve=True)
    serve.add_argument("--host", default="127.0.0.1", help="address rank 0 listens on")
    serve.add_argument("--port", type=int, default=8000, help="port rank 0 listens on")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get 429")
    serve.add_argument("--max-batch", type=int, default=4, help="images per pipeline call at most (also n's limit)")
    serve.add_argument("--batch-window-ms", type=float, default=20.0,
                       help="how long a batch waits for compatible requests to join it")
    serve.add_argument("--max-pixels", type=int, default=None, metavar="N",
                       help="width x height of a request at most; larger ones get 400 (default: 1048576 for presets; "
                            "for checkpoints the largest size whose activations fit in memory)")
    serve.add_argument("--max-steps", type=int, default=100, help="denoising steps of a request at most; more get 400")
    serve.add_argument("--max-body-bytes", type=ascii_int, default=1 << 20, metavar="BYTES",
                       help="a request body's size at most; larger ones get 413 before they are read (default 1 MiB)")
    serve.add_argument("--max-upload-bytes", type=ascii_int, default=32 << 20, metavar="BYTES",
                       help="an image edit's body (its reference images) at most; larger ones get 413 (default 32 MiB)")
    serve.add_argument("--lora-dir", type=Path, default=None, metavar="DIR",
                       help="LoRA adapters a request may name in its `lora` field: each subfolder holding "
                            "pytorch_lora_weights.safetensors (named by the subfolder) or .safetensors file (by its "
                            "stem), each checked at start, kept unfused on every rank (--max-loras at a time)")
    serve.add_argument("--max-loras", type=ascii_int, default=8, metavar="N",
                       help="LoRA adapters of --lora-dir loaded at a time on every rank: one a request names that is "
                            "not loaded takes the place of the least recently used (default 8; a request names at most N)")
    serve.add_argument("--max-frames", type=int, default=129, metavar="N",
                       help="video models: frames of a request at most; more get 400")
    serve.add_argument("--max-request-seconds", type=float, default=600.0, metavar="SECONDS",
                       help="refuse (400) a request estimated to compute longer, at the speed of the server's recent "
                            "steps (no estimate before the first step); 0: no limit")
    serve.add_argument("--drain-seconds", type=float, default=30.0, metavar="SECONDS",
                       help="after SIGTERM, how long the running batch may take before its requests get 503 "
                            "and the server leaves")
    cluster_cli.add_parser(commands)
    bench_cli.add_parser(commands)
    simulate_cli.add_parser(commands)
    footprint_cli.add_parser(commands)
    matrix_cli.add_parser(commands)
    report = commands.add_parser("report", help="regenerate the results page (docs/results/README.md) from benchmark JSON")
    report.add_argument("--results", type=Path, default=Path("docs/results"), help="folder of bench --json files")
    report.add_argument("--readme", type=Path, default=Path("docs/results/README.md"),
                        help="page whose generated section to replace (created if missing)")
    from .models.shapes.cli import add_train_arguments

    train = commands.add_parser("train-tiny", help="train the tiny-shapes preset from scratch (~45 min on 2 CPU cores)")
    add_train_arguments(train)
    return parser


def _cache_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    cache = result.get("cache")
    if not cache:
        return []
    return [("step cache (LOSSY)", f"{cache['spec']}: {cache['computed_steps']} steps computed, {cache['skipped_steps']} skipped")]


def _inferred_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Where a plan inferred from the model (no plan written for its class) splits and gathers."""
    plan = result.get("inferred_plan")
    if not plan:
        return []
    return [("split plan (inferred)", "; ".join(f"{path}: {', '.join(what)}" for path, what in plan.items()))]


def _layers_of(mode: str) -> str:
    """What a `--quantize` mode's layer count counts."""
    from .models.quantize import MODES as QUANTIZE_MODES

    return "layers stored in float8" if QUANTIZE_MODES[mode].layerwise else "linear layers"


def _quantize_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    quantized = result.get("quantize")
    if not quantized:
        return []
    rows = [("quantized weights (LOSSY)", f"{quantized['mode']}: {quantized['layers']} {_layers_of(quantized['mode'])}, transformer weights "
                                          f"{_mb(quantized['weight_bytes'])} -> {_mb(quantized['quantized_bytes'])}")]
    rows += [(f"quantized {name} (LOSSY)", f"{encoder['layers']} {_layers_of(quantized['mode'])}, weights "
                                           f"{_mb(encoder['weight_bytes'])} -> {_mb(encoder['quantized_bytes'])}")
             for name, encoder in (quantized.get("text_encoders") or {}).items()]
    held = result.get("same_weights")
    if held:  # verify: against one process on the same quantized weights
        verdict = (f"PSNR {held['psnr']:.1f} dB, floor {held['psnr_floor']:g} dB" if held["psnr_floor"] is not None and held["psnr"]
                   else f"max rel diff {held['max_rel_diff']:.3e}")
        rows.append(("vs one process, same quantized weights", f"{verdict}: {'OK' if held['ok'] else 'FAILED'}"))
    return rows


def _wire_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    wire = result.get("wire")
    return [("wire formats (LOSSY)", f"{wire} (other levels exact)")] if wire else []


def _comm_line(result: dict[str, Any]) -> str:
    if result.get("lossy") and result.get("v_major", "off") != "off":
        return f"{result['comm']} + V-Major {result['v_major']} (LOSSY: cached projections reused)"
    if not result.get("auto_choice"):
        return result["comm"]
    from .distributed.comm.auto import trials_summary

    auto = result["auto_choice"]
    tried = trials_summary(auto)
    if auto["chosen"] is None:
        return f"auto: undecided after {auto['trial_steps']} trial step(s) ({tried or 'none timed'}); more steps decide"
    return f"auto: {auto['chosen']} (median trial step: {tried})"


def _ring_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    ring = result.get("ring")
    if not ring:
        return []
    return [
        ("ring K/V blocks / step (all ranks)", f"{_mb(ring['same_node_bytes'])} same node, {_mb(ring['other_node_bytes'])} other nodes"),
        ("ring traffic hidden behind attention", f"{100 * ring['hidden_share']:.0f} % (exposed {ring['exposed_ms']:.1f} ms / step)"),
    ]


def _input_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    source = result.get("image_input")
    if not source:
        return []
    if source["task"] == "edit":
        return [("reference images", ", ".join(source["references"]))]
    if source["task"] == "i2v":
        last = [("last frame", source["last_frame"])] if source.get("last_frame") else []
        return [("first frame", f"{source['image']} (image-to-video)"), *last]
    task = "inpainting, mask " + source["mask"] if source["task"] == "inpaint" else "image-to-image"
    return [("input image", f"{source['image']} ({task}, strength {source['strength']:g})")]


def _ranks_text(result: dict[str, Any]) -> str:
    """'8 (2 node(s) x 4)', with the levels where there are more than two."""
    text = f"{result['nproc']} ({result['nodes']} node(s) x {result['ranks_per_node']})"
    levels = result.get("levels", "")
    return f"{text}, levels {levels}" if levels.count("=") > 2 else text


def _level_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """With more than two levels: bytes per step (all ranks) over each level's links, outermost first."""
    levels = result.get("bytes_by_level") or {}
    if len(levels) <= 2:
        return []
    return [("bytes / step over each level (all ranks)", ", ".join(f"{name} {_mb(n)}" for name, n in levels.items()))]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _axis_rows(result: dict) -> list[tuple[str, str]]:
    """One row per plan axis that sent anything: its bytes per step between nodes and within one."""
    return [
        (f"{axis} / step (all ranks)", f"{_mb(links['inter_node'])} between nodes, {_mb(links['intra_node'])} within")
        for axis, links in result["bytes_by_axis"].items()
        if links["inter_node"] or links["intra_node"]
    ]


def cmd_generate(args: argparse.Namespace) -> int:
    from .errors import RunFailed
    from .models.presets import makes_video
    from .output.files import (
        batch_paths,
        check_file,
        check_image,
        check_video,
        lost,
        save_images,
        save_videos,
    )
    from .output.video import DEFAULT_FPS, Audio
    from .run.jobs import generate_job
    from .run.launch import run_ranks
    from .run.spec import resolve_spec

    video = makes_video(args.model)
    out = args.out or Path("cocodiff.mp4" if video else "cocodiff.png")
    paths = batch_paths(out, max(args.batch, 1))
    for path in paths:
        (check_video if video else check_image)("--out", path)
    check_file("--json", args.json)
    spec = resolve_spec(args)
    result = run_ranks(generate_job, args.nproc, spec, timeout_s=args.timeout)
    if result is None:  # a torchrun rank other than 0
        return 0
    images, videos, _, _ = result.pop("images"), result.pop("videos"), result.pop("image"), result.pop("latents")
    audios, rate = result.pop("audios", None), result.pop("sample_rate", None)
    if audios:  # what the MP4s carry beside their frames
        result["audio"] = {"sample_rate": rate, "channels": int(audios[0].shape[0]),
                           "seconds": round(audios[0].shape[1] / rate, 3)}
    if video:
        written, image_problem = save_videos("--out", paths, videos, fps=result.get("fps") or DEFAULT_FPS,
                                             audios=[Audio(a, rate) for a in audios] if audios else None)
    else:
        written, image_problem = save_images("--out", paths, images)
    result["out"], result["outs"], result["prompt"] = str(written[0]), [str(p) for p in written], spec.prompt
    print_table(
        f"cocodiff generate: {spec.model}, {spec.height}x{spec.width}{f'x{spec.frames}' if video else ''}"
        f"{' (LOSSY)' if result['lossy'] else ''}",
        None,
        [
            ("ranks", _ranks_text(result)),
            ("plan", result["plan_description"]),
            *_inferred_rows(result),
            ("comm", _comm_line(result)),
            ("steps", str(result["steps"])),
            *_cache_rows(result),
            *_wire_rows(result),
            *_quantize_rows(result),
            ("prompt", spec.prompt),
            *_input_rows(result),
            ("seed (noise, preset weights)", str(result["seed"])),
            ("latency / step (median)", f"{result['step_ms_median']:.1f} ms"),
            ("peak memory / rank (measured vs estimate)", f"{_mb(result['peak_bytes'])} vs {_mb(result['estimated_bytes'])}"),
            ("transformer weights / rank", f"{_mb(result['transformer_param_bytes'])}"
                                           + (" (sharded over each node's ranks)" if result["shard_weights"] else "")),
            *_axis_rows(result),
            *_level_rows(result),
            ("time waiting on communication", f"{100 * result['comm_wait_share']:.1f} %"),
            *_ring_rows(result),
            *([("frames", str(result["frames"]))] if video else []),
            (("video" if video else "image") if len(written) == 1 else f"{'videos' if video else 'images'} ({len(written)})",
             ", ".join(result["outs"])),
        ],
    )
    problems = [image_problem] if image_problem else []
    try:
        write_json(args.json, result)
    except RunFailed as error:
        problems.append(str(error))
    lost(problems)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .output.files import check_file
    from .run.jobs import verify_job
    from .run.launch import run_ranks
    from .run.spec import resolve_spec

    check_file("--json", args.json)
    spec = resolve_spec(args)
    result = run_ranks(verify_job, args.nproc, spec, timeout_s=args.timeout)
    if result is None:
        return 0
    verdict = "OK" if result["ok"] else "FAILED"
    print_table(
        f"cocodiff verify: {spec.model} on {result['nproc']} ranks vs one process: {verdict}"
        + (" (LOSSY mode: differences are expected, within its floor)" if result["lossy"] else ""),
        None,
        [
            ("ranks", _ranks_text(result)),
            ("plan", result["plan_description"]),
            *_inferred_rows(result),
            ("comm", _comm_line(result)),
            *_cache_rows(result),
            *_wire_rows(result),
            *_quantize_rows(result),
            *_input_rows(result),
            ("final latents: max abs / rel diff", f"{result['latent']['max_abs_diff']:.3e} / {result['latent']['max_rel_diff']:.3e}"),
            (f"{'every frame' if result.get('frames') else 'image'}: max abs / rel diff", f"{result['image']['max_abs_diff']:.3e} / {result['image']['max_rel_diff']:.3e}"),
            *([("soundtrack: max abs / rel diff", f"{result['audio']['max_abs_diff']:.3e} / {result['audio']['max_rel_diff']:.3e}")]
              if result.get("audio") else []),
            ("tolerance (relative)", f"{result['tolerance']:.0e}"),
            *([("image PSNR vs one process" + (" (unquantized)" if result.get("quantize") else ""), _psnr_text(result))]
              if result["lossy"] else []),
        ],
    )
    write_json(args.json, result)
    return 0 if result["ok"] else 1


def _psnr_text(result: dict) -> str:
    psnr = "equal (no difference)" if result["psnr"] is None else f"{result['psnr']:.1f} dB"
    return f"{psnr}, floor {result['psnr_floor']:g} dB"


def cmd_serve(args: argparse.Namespace) -> int:
    from .errors import UsageError
    from .engine.families.pipelines import EDIT_PIPELINES
    from .models.lora import adapter_folder
    from .models.presets import PRESETS, makes_video, pipeline_class, refusal
    from .run.launch import run_ranks, under_launcher
    from .run.spec import resolve_spec
    from .serve.api import check_port
    from .serve.ranks import ServeOptions, forward_signals, serve_job
    from .serve.watchdog import group_timeout_s

    if args.max_queue < 1 or args.max_batch < 1 or not 0 <= args.batch_window_ms < math.inf:  # nan: neither
        raise UsageError(f"--max-queue {args.max_queue} and --max-batch {args.max_batch} must be at least 1, "
                         f"--batch-window-ms {args.batch_window_ms:g} a finite number at least 0")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port number")
    if args.max_pixels is not None and args.max_pixels < 1:
        raise UsageError(f"--max-pixels {args.max_pixels} must be at least 1")
    if args.max_frames < 1:
        raise UsageError(f"--max-frames {args.max_frames} must be at least 1")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-upload-bytes", args.max_upload_bytes)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be at least 1")
    if not 0 <= args.max_request_seconds < 1e9 or not 0 < args.drain_seconds < 1e9:
        raise UsageError(f"--max-request-seconds {args.max_request_seconds:g} must be at least 0 and "
                         f"--drain-seconds {args.drain_seconds:g} positive")
    if args.compile and args.cache is not None and args.cache.strip().lower() not in ("off", "none", ""):
        raise UsageError(f"--cache {args.cache} does not combine with --compile in serve: every request that names "
                         f"no cache would run it, and a compiled server runs none; leave out one of them")
    if not under_launcher() or os.environ.get("RANK") == "0":
        check_port(args.host, args.port)  # before any rank loads the model
    spec = resolve_spec(args)
    loras = adapter_folder(args.lora_dir) if args.lora_dir is not None else {}
    if loras and (spec.parallel.shard_weights is True or spec.parallel.compile):
        clash = "--compile" if spec.parallel.compile else "--shard-weights on"
        raise UsageError(f"--lora-dir does not combine with {clash} yet (adapters switched per request: unfused LoRA "
                         f"layers under FSDP, or recompiles)")
    if loras and (reason := refusal(spec.model, {"lora"})) is not None:
        raise UsageError(f"--lora-dir: {reason}")
    if not 1 <= args.max_loras <= 1000:
        raise UsageError(f"--max-loras {args.max_loras} must be from 1 to 1000")
    if not 1 <= spec.steps <= args.max_steps:
        raise UsageError(f"--max-steps {args.max_steps} must be at least 1 and at least the default steps {spec.steps}")
    if spec.frames is not None and spec.frames > args.max_frames:
        raise UsageError(f"--max-frames {args.max_frames} must be at least the default frames {spec.frames}")
    options = ServeOptions(
        host=args.host, port=args.port, max_queue=args.max_queue, max_batch=args.max_batch,
        batch_window_ms=args.batch_window_ms, idle_s=min(5.0, args.timeout / 4),
        max_pixels=args.max_pixels if args.max_pixels is not None else 1024 * 1024 if args.model in PRESETS else None,
        max_steps=args.max_steps, max_frames=args.max_frames, max_request_s=args.max_request_seconds or None,
        drain_s=args.drain_seconds, max_body_bytes=args.max_body_bytes, max_upload_bytes=args.max_upload_bytes,
        loras=loras, lora_dir=args.lora_dir, max_loras=args.max_loras, timeout_s=args.timeout,
    )
    route = "POST /v1/videos" if makes_video(spec.model) else "POST /v1/images/generations"
    if pipeline_class(spec.model) in EDIT_PIPELINES:
        route += ", POST /v1/images/edits"
    print(f"cocodiff serve: {spec.model} on http://{args.host}:{args.port} ({route}, GET /health, GET /metrics)"
          f"{f'; LOSSY wire formats {spec.parallel.wire}' if spec.parallel.wire else ''}"
          f"{f'; LOSSY step cache {spec.parallel.cache} for requests that name none' if spec.parallel.cache else ''}",
          file=sys.stderr, flush=True)
    # rank 0's watchdog answers a stalled step at --timeout; the ranks' own timeout comes after it
    if under_launcher():
        run_ranks(serve_job, args.nproc, spec, options, timeout_s=group_timeout_s(args.timeout))
        return 0
    with forward_signals():
        run_ranks(serve_job, args.nproc, spec, options, timeout_s=group_timeout_s(args.timeout))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .bench.report import update_readme
    from .errors import UsageError
    from .output.files import check_file

    if not args.results.is_dir():
        raise UsageError(f"--results {args.results} is not a folder of bench --json files")
    check_file("--readme", args.readme)
    update_readme(args.readme, args.results)
    print(f"{args.readme}: results regenerated from {args.results}")
    return 0


def cmd_train_tiny(args: argparse.Namespace) -> int:
    from functools import partial

    from .models.shapes.cli import train_from_args
    from .run.lifetime import start_rank

    # The training child dies with this command, and leaves Ctrl-C to it (run/lifetime.py).
    return train_from_args(args, child_prologue=partial(start_rank, os.getpid(), False))


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    if command in ("cluster", "bench", "simulate", "footprint"):
        return import_module(f".{command}.cli", __package__).main
    if command == "matrix":
        from .matrix import cli as matrix_cli

        return lambda args: matrix_cli.main(args, build_parser().parse_args)
    return {"generate": cmd_generate, "verify": cmd_verify, "report": cmd_report, "serve": cmd_serve,
            "train-tiny": cmd_train_tiny}[command]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    from .run import quiet  # noqa: F401  (before anything imports torchao)
    from .run import rank_server

    from .errors import RankError, RunFailed, UsageError
    from .run.lifetime import launcher_signals, quiet_foreign_warnings

    quiet_foreign_warnings()  # the launcher builds models too (a preset checked against one rank's memory)
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        with launcher_signals():  # a signal ends every rank, then this command, in one line (run/lifetime.py)
            args = build_parser(words[0] if words and words[0] in LIGHT_COMMANDS else None).parse_args(words)
            rank_server.fork_ready(args.command, own_process=argv is None)  # libraries imported, nothing computed
            return _handler(args.command)(args)
    except UsageError as error:
        print(f"cocodiff: error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:  # a peer that stopped answering, a rank that died: one line
        print(f"cocodiff: error: {error}", file=sys.stderr)
        return 1
    except RankError as error:
        print(f"cocodiff: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
