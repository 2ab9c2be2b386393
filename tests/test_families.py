"""The generic family layer: stock diffusers processors through the dispatcher, plans read from `_cp_plan`.

tiny-wan (video, 6 heads, CFG as two calls per step, cross-attention kept local) and tiny-flux2
(joint attention, fused QKV+MLP single-stream blocks) equal one process on 2, 4 and 8 gloo ranks;
an LTX-Video transformer, for which the project has no entry at all, equals one process on 4
ranks with its text split (cross-attention with S_q != S_kv) and a padded text mask.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff import ParallelConfig, parallelize
from cocodiff.errors import UsageError
from cocodiff.engine.families import FAMILIES, Gather, Split, family_of, from_cp_plan
from cocodiff.run.launch import spawn

GENERIC = ["tiny-wan", "tiny-flux2"]
RTOL_OF_SCALE = 1e-4  # as tests/test_models.py
HEIGHT, WIDTH, FRAMES = 48, 80, 5  # 3 x 5 latent tokens per frame (odd on purpose), 2 latent frames


def run_generic(model: str, config: ParallelConfig | None) -> dict:
    """A 2-step pipeline run (its latents after each step, its output); under `config`, the same
    again with V-First off, and how each attention module's V was found to be built."""
    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)

    def one_run() -> dict:
        steps = []

        def keep(_pipe, _step, _t, tensors):
            steps.append(tensors["latents"].clone())
            return tensors

        extra = {"num_frames": FRAMES} if model == "tiny-wan" else {}
        out = pipe("a small green star", height=HEIGHT, width=WIDTH, num_inference_steps=2, output_type="pt",
                   generator=torch.Generator().manual_seed(0), callback_on_step_end=keep, **extra)
        return {"latents": torch.stack(steps), "output": out.frames if model == "tiny-wan" else out.images}

    if config is None:
        return one_run()
    parallel = parallelize(pipe, config)
    result = one_run()
    result["construction"] = dict(parallel.dispatched.construction)
    parallel.undo()
    plain = parallelize(pipe, ParallelConfig(comm=config.comm, ranks_per_node=config.ranks_per_node, plan=config.plan, v_first=False))
    result["plain"] = one_run()
    plain.undo()
    return result


def all_generic(nproc_config: ParallelConfig) -> dict:
    return {model: run_generic(model, nproc_config) for model in GENERIC}


@pytest.fixture(scope="module")
def references():
    return {model: run_generic(model, None) for model in GENERIC}


SETUPS = {
    "2ranks-flat": (2, ParallelConfig()),
    "4ranks-2x2-tapa": (4, ParallelConfig(comm="tapa", ranks_per_node=2)),
    # 8 ranks, more than the 6 heads: Ulysses x ring.
    "8ranks-2x4-tapa": (8, ParallelConfig(comm="tapa", ranks_per_node=4)),
}
_runs: dict[str, list] = {}


@pytest.fixture(scope="module", params=[pytest.param(s, marks=[pytest.mark.slow] if not s.startswith("2") else [])
                                        for s in SETUPS])
def generic_runs(request):
    if request.param not in _runs:
        nproc, config = SETUPS[request.param]
        _runs[request.param] = spawn(all_generic, nproc, config, timeout_s=RANK_TIMEOUT_S * nproc // 2)
    return _runs[request.param]


@pytest.mark.parametrize("model", GENERIC)
def test_generic_families_equal_one_process(generic_runs, references, model):
    ref = references[model]
    for rank, runs in enumerate(generic_runs):
        for key in ("latents", "output"):
            got = runs[model][key]
            scale = ref[key].abs().max().item()
            diff = (got - ref[key]).abs().max().item()
            assert diff <= RTOL_OF_SCALE * scale, f"{model} rank {rank} {key}: max diff {diff:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("model", GENERIC)
def test_v_first_sends_the_v_the_stock_processor_builds(generic_runs, model):
    """Every self- and joint attention module has its V found on its first call, and the run with
    V sent early is bitwise the run in the plain order (only the schedule differs)."""
    expected = {
        "tiny-wan": {"blocks.0.attn1": "self", "blocks.1.attn1": "self", "blocks.0.attn2": None, "blocks.1.attn2": None},
        "tiny-flux2": {"transformer_blocks.0.attn": "txt_img", "single_transformer_blocks.0.attn": "fused",
                       "single_transformer_blocks.1.attn": "fused"},
    }[model]
    for runs in generic_runs:
        run = runs[model]
        found = {path: how[0] if how else None for path, how in run["construction"].items()}
        assert found == expected
        for key in ("latents", "output"):
            assert torch.equal(run[key], run["plain"][key]), f"{model} {key}: V-First changed the numbers"


def fused_v_construction_as_cublas_rounds_it() -> dict:
    """tiny-flux2 on this rank under `u2`, one step, with V's rows of the fused projection computed
    as another GEMM kernel would round them (1e-3 of V's scale off the fused GEMM's numbers): how
    each attention module's V was found to be built."""
    from cocodiff import ParallelConfig, parallelize
    from cocodiff.engine.attention import dispatch
    from cocodiff.models.presets import load_pipeline

    real = dispatch._fused_v

    def rounded_otherwise(module, states):
        v = real(module, states)
        return v + 1e-3 * v.abs().amax() * torch.sin(v)

    dispatch._fused_v = rounded_otherwise
    pipe, _ = load_pipeline("tiny-flux2", seed=0)
    pipe.set_progress_bar_config(disable=True)
    parallel = parallelize(pipe, ParallelConfig(plan="u2"))
    pipe("a small green star", height=HEIGHT, width=WIDTH, num_inference_steps=1, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    return {path: how[0] if how else None for path, how in parallel.dispatched.construction.items()}


def test_v_first_finds_its_v_where_another_gemm_rounds_it_otherwise():
    """On a GPU V's rows alone (V-First's early projection) and the fused projection's are two GEMMs
    whose bf16 results differ in the last bits: V is found within `V_MATCH` of V's scale, not by
    bitwise equality (which turned V-First off on FLUX.2's single-stream blocks)."""
    found = spawn(fused_v_construction_as_cublas_rounds_it, 2, timeout_s=RANK_TIMEOUT_S)
    assert found[0] == found[1] == {"transformer_blocks.0.attn": "txt_img", "single_transformer_blocks.0.attn": "fused",
                                    "single_transformer_blocks.1.attn": "fused"}


# -- a _cp_plan model the project has no line for ----------------------------------------------
def ltx_forward(config: ParallelConfig | None) -> torch.Tensor:
    from diffusers import LTXVideoTransformer3DModel

    from cocodiff import parallelize

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
                                       cross_attention_dim=32, num_layers=2, caption_channels=16)
    if config is not None:
        parallelize(model, config)
    g = torch.Generator().manual_seed(1)
    frames, h, w, text = 2, 3, 5, 7
    mask = torch.ones(2, text)
    mask[0, 5:] = 0
    mask[1, 2] = 0  # padding, not only at the end
    with torch.no_grad():
        return model(hidden_states=torch.randn(2, frames * h * w, 8, generator=g),
                     encoder_hidden_states=torch.randn(2, text, 16, generator=g), timestep=torch.tensor([700, 300]),
                     encoder_attention_mask=mask, num_frames=frames, height=h, width=w, return_dict=False)[0]


def test_a_cp_plan_class_through_its_own_plan_equals_one_process_on_4_ranks():
    """LTX-Video's record adds only its image-to-video timestep's split: its `_cp_plan` and its
    stock processors run it (text-to-video's (batch,) timestep stays whole)."""
    record = FAMILIES["LTXVideoTransformer3DModel"]
    assert record.plan is None and record.processor is None and set(record.inputs) == {""}
    ref = ltx_forward(None)
    outs = spawn(ltx_forward, 4, ParallelConfig(), timeout_s=RANK_TIMEOUT_S)
    for rank, out in enumerate(outs):
        diff = (out - ref).abs().max().item()
        assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}: max diff {diff:.3g}"


# -- the _cp_plan reader and the refusals (one process) ----------------------------------------
def _cp_plan_classes() -> dict[str, type]:
    import diffusers.models.transformers as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and getattr(cls, "_cp_plan", None):
                found[name] = cls
    return found


def test_every_shipped_cp_plan_is_read():
    classes = _cp_plan_classes()
    assert {"FluxTransformer2DModel", "Flux2Transformer2DModel", "WanTransformer3DModel",
            "LTXVideoTransformer3DModel", "QwenImageTransformer2DModel"} <= set(classes)
    for name, cls in classes.items():
        plans = from_cp_plan(cls._cp_plan, FAMILIES[name].streams if name in FAMILIES else {}, name)
        assert any(isinstance(p.output, Gather) for p in plans.values()), f"{name}: no gather of the output"
    flux2 = from_cp_plan(classes["Flux2Transformer2DModel"]._cp_plan)[""].inputs
    assert flux2["encoder_hidden_states"] == Split(-2, "txt", 3) and flux2["txt_ids"].stream == "txt"
    assert flux2["hidden_states"] == Split(-2, "img", 3) and flux2["img_ids"] == Split(-2, "img", 3)
    wan = from_cp_plan(classes["WanTransformer3DModel"]._cp_plan)
    assert wan[""].inputs["timestep"] == Split(-1, "img", 2)  # per-token timesteps only (Wan 2.2 TI2V)
    assert wan["rope"].output == {0: Split(-3, "img", 4), 1: Split(-3, "img", 4)}
    ltx = from_cp_plan(classes["LTXVideoTransformer3DModel"]._cp_plan)[""].inputs
    assert ltx["encoder_attention_mask"] == Split(-1, "txt", 2)
    qwen = from_cp_plan(classes["QwenImageTransformer2DModel"]._cp_plan, FAMILIES["QwenImageTransformer2DModel"].streams)
    assert qwen["pos_embed"].output == {0: Split(-2, "img", 2), 1: Split(-2, "txt", 2)}


def _tiny_wan(processor: object) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                  text_dim=8, freq_dim=8, ffn_dim=16, num_layers=1)
    model.set_attn_processor(processor)
    return model


def test_a_processor_that_calls_neither_the_dispatcher_nor_sdpa_is_refused_in_one_line():
    from cocodiff.engine.attention.dispatch import check_backends

    class OwnKernel:  # no `_parallel_config`, no SDPA: it would attend locally, on a shard
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return hidden_states

    with pytest.raises(UsageError, match=r"OwnKernel calls neither the attention dispatcher nor SDPA"):
        check_backends(_tiny_wan(OwnKernel()), ())


def test_a_processor_that_calls_sdpa_itself_yet_skips_it_on_split_tokens_fails_on_every_rank():
    """A processor whose source calls SDPA is routed to the exchange (`dispatch._route_sdpa`); a call
    over split tokens that made no SDPA call (here: a branch never taken) would have attended on a
    shard alone: every rank fails, naming the module, before anything is returned."""
    from every_rank import simulate

    from cocodiff.config.levels import parse_levels
    from cocodiff.distributed.topology import Topology

    class Sometimes:
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
            if encoder_hidden_states is hidden_states:  # never
                return torch.nn.functional.scaled_dot_product_attention(hidden_states, hidden_states, hidden_states)
            return hidden_states

    meta = torch.device("meta")

    def run(_rank: int) -> None:
        model = _tiny_wan(Sometimes()).to(meta)
        topology = Topology.from_env(levels=parse_levels("node=1,rank=2"), device=meta)
        parallelize(model, ParallelConfig(comm="flat"), topology)
        with torch.no_grad():
            model(torch.zeros(1, 4, 1, 6, 14, device=meta), torch.tensor([1], device=meta),
                  torch.zeros(1, 9, 8, device=meta))

    records = simulate(2, run)
    for record in records:
        assert record.error and "blocks.0.attn1: its Sometimes made no SDPA call on split tokens" in record.error, record


def test_generate_on_a_video_model_writes_a_playable_mp4(tmp_path):
    from test_cli import cocodiff

    from cocodiff.output.video import count_frames

    out, figures = tmp_path / "clip.mp4", tmp_path / "g.json"
    run = cocodiff("generate", "--model", "tiny-wan", "--nproc", "4", "--steps", "2", "--frames", "5",
                   "--height", "48", "--width", "80", "--out", str(out), "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert count_frames(out) == 5
    assert (tmp_path / "clip.png").stat().st_size > 0  # the first frame beside it
    assert "frames" in run.stdout and "clip.mp4" in run.stdout


def test_a_video_model_refuses_an_image_name_before_any_rank_starts(tmp_path):
    from test_cli import cocodiff

    run = cocodiff("generate", "--model", "tiny-wan", "--out", str(tmp_path / "clip.png"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "the model makes videos and '.png' names no video format" in run.stderr


def run_experts(config: ParallelConfig | None) -> tuple[torch.Tensor, dict[str, int]]:
    """tiny-wan22 (Wan 2.2 A14B's two experts): its frames and whether each expert's attention reached the exchange."""
    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline("tiny-wan22", seed=0)
    pipe.set_progress_bar_config(disable=True)
    reached = {}
    if config is not None:
        parallel = parallelize(pipe, config)
        experts = {"transformer": parallel.dispatched, "transformer_2": parallel.experts[0].dispatched}
    out = pipe("a small green star", height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=4,
               output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    if config is not None:
        reached = {name: d._reached for name, d in experts.items()}
    return out, reached


def test_both_experts_run_parallel_with_cfg_across_the_ranks():
    """CFG's two calls per step on two groups (c2), each expert with its own pairing: equal to one process."""
    ref, _ = run_experts(None)
    for rank, (out, reached) in enumerate(spawn(run_experts, 2, ParallelConfig(plan="c2"), timeout_s=RANK_TIMEOUT_S)):
        diff = (out - ref).abs().max().item()
        assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}: max diff {diff:.3g}"
        assert reached["transformer"] is True and reached["transformer_2"] is True, reached


def on_the_generic_layer(model: str, config: ParallelConfig | None) -> tuple[dict, dict]:
    """A model of a hand-written family run as it is, then through the generic layer instead (its
    stock processors and the class's own `_cp_plan`): FLUX.1, Qwen-Image."""
    import dataclasses

    from model_cases import run_case

    from cocodiff.engine import families
    from cocodiff.models.presets import load_pipeline

    hand = run_case(model, config)
    name = type(load_pipeline(model, seed=0)[0].transformer).__name__
    families.FAMILIES[name] = dataclasses.replace(families.FAMILIES[name], plan=None, processor=None, overlapped_forwards={})
    return hand, run_case(model, config)


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-qwen-image"])
def test_hand_written_families_on_the_generic_layer_are_bitwise_the_same(model):
    """Same numbers as the hand-written processors (and so within tolerance of one process)."""
    from model_cases import run_case

    ref = run_case(model, None)
    for rank, (hand, generic) in enumerate(spawn(on_the_generic_layer, 2, model, ParallelConfig(), timeout_s=RANK_TIMEOUT_S)):
        for key in ("forward", "latents", "image"):
            assert torch.equal(generic[key], hand[key]), f"{model} rank {rank} {key}: the generic layer differs"
            diff = (generic[key] - ref[key]).abs().max().item()
            assert diff <= RTOL_OF_SCALE * ref[key].abs().max().item(), f"{model} rank {rank} {key}: max diff {diff:.3g}"


def wan_per_token_timesteps(config: ParallelConfig | None) -> torch.Tensor:
    """Wan 2.2 TI2V's call: one timestep per token (split with the tokens by Wan's `_cp_plan`)."""
    from diffusers import WanTransformer3DModel

    from cocodiff import parallelize

    torch.manual_seed(0)
    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                  text_dim=8, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    if config is not None:
        parallelize(model, config)
    g = torch.Generator().manual_seed(1)
    tokens = 2 * 3 * 5  # 2 latent frames of 6 x 10, patched 1 x 2 x 2
    timestep = torch.rand(2, tokens, generator=g) * 1000
    timestep[:, :15] = 0.0  # TI2V: the first frame (the image) is clean
    with torch.no_grad():
        return model(hidden_states=torch.randn(2, 4, 2, 6, 10, generator=g), timestep=timestep,
                     encoder_hidden_states=torch.randn(2, 7, 8, generator=g), return_dict=False)[0]


def test_wan_per_token_timesteps_are_split_with_the_tokens():
    ref = wan_per_token_timesteps(None)
    for rank, out in enumerate(spawn(wan_per_token_timesteps, 4, ParallelConfig(plan="u2r2"), timeout_s=RANK_TIMEOUT_S)):
        diff = (out - ref).abs().max().item()
        assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}: max diff {diff:.3g}"


def test_a_diffusers_without_the_dispatcher_entry_point_is_refused_in_one_line(monkeypatch):
    """The generic layer relies on a private diffusers function: if it moves or changes, the
    refusal names it instead of running attention locally on a shard."""
    from diffusers.models import attention_dispatch

    from cocodiff.engine.attention import dispatch

    monkeypatch.setattr(dispatch, "_original", None)
    monkeypatch.setattr(attention_dispatch, "_templated_context_parallel_attention", lambda query, key, value: None)
    with pytest.raises(UsageError, match=r"has no attention_dispatch._templated_context_parallel_attention\(query, key"):
        dispatch.install_exchange()
    monkeypatch.delattr(attention_dispatch, "_templated_context_parallel_attention")
    with pytest.raises(UsageError, match="install a diffusers in pyproject.toml's range"):
        dispatch.install_exchange()
