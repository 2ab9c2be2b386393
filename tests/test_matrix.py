"""The model x feature matrix (cocodiff/matrix): its declarations against the engine, a family that
enters it by its declaration alone, and the image rows of CI's matrix (slow; the video rows are in
test_matrix_video.py)."""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path

import pytest
from conftest import RANK_TIMEOUT_S, patience

from cocodiff.cli import build_parser, main
from cocodiff.config.env import PLUGINS_ENV
from cocodiff.engine.families import FAMILIES
from cocodiff.matrix.cells import FEATURES
from cocodiff.matrix.run import NA, REFUSED, Cell, _resolve, _verdict, plan_cells, run_matrix
from cocodiff.models.presets import PRESETS

PRESET_NAMES = list(PRESETS)
LEFT_OUT = {
    "tiny-qwen-image-edit-v1": "tiny-qwen-image-edit without its modulation index, taking a batch: test_edit.py runs it "
                               "exact on b2u2, test_serve_edits.py serves n=2 in one call, the stand-in every rank on b2u2 and u2r2",
    "tiny-qwen-image-edit": "tiny-qwen-image's transformer with a reference (4 minutes a row: a megapixel reference per "
                            "cell): test_edit.py runs it exact on c2u2 with two references and with a mask, the stand-in on four plans",
    "tiny-wan22-i2v": "tiny-wan22's experts, tiny-wan21-i2v's first-frame channels: test_i2v.py runs it exact on c2u2, "
                      "the stand-in on c2u2 and p2u2",
    "tiny-wan21-i2v": "tiny-wan21-flf2v without the last frame: test_i2v.py runs it exact on u2r2, the stand-in on u4 and c2p2",
    "tiny-hunyuanvideo15-i2v": "tiny-hunyuanvideo15's plan, mask and refiner, SigLIP tokens joined to the text: test_i2v.py "
                               "runs it exact on c2u2",
    "tiny-flux2-klein": "tiny-flux2's transformer under another pipeline and text encoder: test_edit.py runs its edits",
    "tiny-wan": "tiny-wan21-flf2v's transformer class and VAE without its image inputs (about 130 s a row here): "
                "test_families.py runs it, test_vae_parallel_video.py its VAE in bands, the stand-in every plan",
    "tiny-wan22": "tiny-wan's transformer, a second expert from its boundary step: test_families.py holds the switch, "
                  "test_quantize.py and test_cache_families.py run it",
    "tiny-cogview4": "a plan inferred as tiny-qwen-image21's is, without a mask: test_plan_inference.py runs its class "
                     "exact, the stand-in on six plans",
    "tiny-chroma": "a plan inferred, with Chroma's m_i * m_j mask (about 400 s a row here, ten times another image "
                   "row's: the bias is rebuilt whole at each layer): test_plan_inference.py runs its class exact on 2 "
                   "and 4 ranks, the stand-in on u2, u2r2 and c2u2",
    "tiny-flux-kontext": "reference tokens as tiny-flux2's: test_edit.py runs its edit exact, test_shard.py its sharded "
                         "weights, the stand-in on five plans",
    # Rows whose family or input no CI row has: under every feature in docs/matrix.md only.
    "tiny-wan-ti2v": "a per-token timestep on tiny-wan's transformer: test_i2v.py runs it exact, the stand-in on five plans",
    "tiny-ltx-i2v": "LTX-Video with a per-token timestep and a first frame: test_i2v.py runs it exact, the stand-in on four plans",
    "tiny-ltx": "LTX-Video: test_families_more.py and test_cache_families.py run it, the stand-in on seven plans",
    "tiny-ltx2-i2v": "tiny-ltx2 with a per-token timestep: test_ltx2.py runs it exact, the stand-in on three plans",
    "tiny-zimage": "Z-Image's lists of latents and text: test_families_more.py and test_plan_inference.py run it, the "
                   "stand-in on the five plans it takes",
    "tiny-zimage-omni": "tiny-zimage with references: test_edit.py runs it exact, the stand-in on five plans",
    "tiny-minimax-h3": "tiny-minimax-h3-i2v's transformer, VAEs and loop without its keyframes: test_minimax_h3.py runs "
                       "it exact on u2r2 and p2u2 with its soundtrack, the stand-in on six plans",
}
"""The rows CI's matrix leaves out (docs/matrix.md has every preset: `cocodiff matrix` with no
--models), each with where its family or input runs instead."""
VIDEO_ROWS = [name for name in PRESET_NAMES if name not in LEFT_OUT and PRESETS[name].frames]
IMAGE_ROWS = [name for name in PRESET_NAMES if name not in LEFT_OUT and not PRESETS[name].frames]
"""The image rows run here, the video rows in test_matrix_video.py: a test each, so that CI's two
workers share the matrix."""
RUNS_LONG = 10  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


@pytest.fixture
def toy_family(monkeypatch):
    """tests/toy_family.py imported here and in every rank; its preset and family gone afterwards."""
    monkeypatch.setenv(PLUGINS_ENV, "toy_family")
    module = importlib.import_module("toy_family")
    yield module
    PRESETS.pop(module.NAME, None)
    FAMILIES.pop("ToyTransformer2DModel", None)
    sys.modules.pop("toy_family", None)


def test_every_declared_refusal_is_the_engines_and_the_engine_refuses_nothing_else(tmp_path):
    """Before any rank starts: a cell refuses (one line, as `verify` parses and resolves it) exactly
    when its feature or its family declares so, with the declared reason (an n/a cell runs nothing:
    one --image on tiny-cogview4, which edits none, is the img2img its row refuses)."""
    cells = [c for c in plan_cells(PRESET_NAMES, list(FEATURES), tmp_path) if c.expected != NA]
    parse = build_parser().parse_args
    for cell in cells:
        _resolve(cell, parse)
    wrong = [(c.model, c.feature.name, c.expected, c.outcome, c.message) for c in cells
             if (c.outcome == REFUSED) != (c.expected == REFUSED) or (c.outcome == REFUSED and not c.passed)]
    assert wrong == []
    refused = {(c.model, c.feature.name) for c in cells if c.outcome == REFUSED}
    assert ("tiny-zimage", "cfg groups") in refused and ("tiny-wan", "img2img") in refused
    assert ("tiny-flux", "batch groups") not in refused and ("tiny-shapes", "cfg groups") not in refused
    assert ("tiny-flux", "cfg groups") in refused  # its call has no CFG: the groups would repeat each other
    assert {("tiny-flux2", "edit 2 refs"), ("tiny-flux-kontext", "edit 1 ref")}.isdisjoint(refused)
    assert {("tiny-flux", "edit 2 refs"), ("tiny-flux-kontext", "edit 2 refs"), ("tiny-flux2", "img2img"),
            ("tiny-flux-kontext", "img2img"), ("tiny-wan", "edit 1 ref")} <= refused
    assert ("tiny-flux-kontext", "inpaint") not in refused  # FluxKontextInpaintPipeline repaints where the mask is white
    # One --image on a model that edits none is its img2img (or, image-to-video, its first frame): n/a, nothing runs
    skipped = {(c.model, c.feature.name) for c in plan_cells(PRESET_NAMES, list(FEATURES), tmp_path) if c.expected == NA}
    assert skipped >= {("tiny-flux", "edit 1 ref"), ("tiny-wan-ti2v", "edit 1 ref")}


def test_a_new_family_enters_the_matrix_by_its_declaration(tmp_path, toy_family):
    """A preset and a family record (tests/toy_family.py) and nothing else: its cells run exact (or
    lossy within the floor) on 2 ranks, and what its record refuses is refused in one line with its reason."""
    features = [f for f in FEATURES if f.name in ("ring", "batch 2", "cfg groups", "fbcache")]
    cells = plan_cells([toy_family.NAME], features, tmp_path)
    run_matrix(cells, build_parser().parse_args, timeout_s=RANK_TIMEOUT_S, report=lambda line: None)
    outcome = {c.feature.name: (c.outcome, c.passed) for c in cells}
    assert outcome == {"ring": ("exact", True), "batch 2": ("exact", True), "cfg groups": ("refused", True),
                       "fbcache": ("lossy", True)}
    refused = next(c for c in cells if c.feature.name == "cfg groups")
    assert toy_family.REASON in refused.message and "ToyTransformer2DModel" in refused.message


def run_rows(rows: list[str], tmp_path: Path) -> None:
    """The matrix of `rows`: no cell crashes, hangs, differs beyond its bound without saying LOSSY,
    or refuses where nothing declares it; it writes the table users read."""
    table, figures = tmp_path / "matrix.md", tmp_path / "matrix.json"
    code = main(["matrix", "--models", ",".join(rows), "--markdown", str(table), "--json", str(figures), "--timeout", str(RANK_TIMEOUT_S)])
    cells = json.loads(figures.read_text())["cells"]
    failed = [(c["model"], c["feature"], c["expected"], c["outcome"], c["message"]) for c in cells if not c["passed"]]
    assert failed == [] and code == 0
    # Each row's blocks compile whole: a graph break (a collective or a dict write traced in a block) is
    # a slower cell and a slower run, though its output matches.
    breaks = [(c["model"], c["feature"], c["graph_breaks"]) for c in cells if c.get("compiled_graphs") and c.get("graph_breaks")]
    assert breaks == []
    assert len(cells) == len(rows) * len(FEATURES)
    assert table.read_text().count("\n| ") == len(FEATURES) + 1


@pytest.mark.slow
@pytest.mark.timeout(patience(600))  # about 10 minutes on CI's machine; a hung cell fails at its peers' --timeout, and the rest run
def test_every_image_preset_with_every_feature(tmp_path):
    run_rows(IMAGE_ROWS, tmp_path)


RECORDS = Path(__file__).parent / "data" / "matrix-records-tiny-shapes.json"
"""Every column's record of a real matrix run of tiny-shapes (`cocodiff matrix --models tiny-shapes
--json`, the keys the verdict reads); the edit columns', which tiny-shapes refuses, of tiny-flux2, and
the last frame column's of tiny-wan21-flf2v; the fp8 storage column's of `cocodiff matrix --features
"fp8 storage"`."""


def _no_op(feature: str, record: dict, records: dict) -> dict:
    """What `record` would say had `feature` (the last of a combined column's) done nothing."""
    off = copy.deepcopy(record)
    axes = off["bytes_by_axis"]
    untimed = lambda trials: {**trials, "candidates": [dict(c, step_ms=None) for c in trials["candidates"]]}  # noqa: E731
    changes = {  # each a function: only the feature's own is built
        "ulysses": lambda: {"plan": "u2"}, "ring": lambda: {"ring": None}, "ulysses x ring": lambda: {"ring": None},
        "cfg groups": lambda: {"bytes_by_axis": {k: v for k, v in axes.items() if k != "cfg/batch"}},
        "batch groups": lambda: {"bytes_by_axis": {k: v for k, v in axes.items() if k != "cfg/batch"}},
        "batch 2": lambda: {"pictures": 1},
        "stages": lambda: {"rank_param_bytes": [records["ulysses"]["transformer_param_bytes"]] * 2},
        "stages x ulysses": lambda: {"bytes_by_axis": {k: v for k, v in axes.items() if k != "stage"}},
        "stages x cfg": lambda: {"bytes_by_axis": {k: v for k, v in axes.items() if k != "cfg/batch"}},
        "stages x shard": lambda: {"rank_param_bytes": records["stages x ulysses"]["rank_param_bytes"]},
        "stages x compile": lambda: {"compiled_graphs": 0},
        "displaced patches": lambda: {"patch_buffer_bytes": None},
        "tapa": lambda: {"exchange": {"name": "flat"}}, "tapa+vfirst": lambda: {"exchange": {"name": "flat"}},
        "tapa-full": lambda: {"exchange": {**off["exchange"], "name": "flat", "hops": [4]}},
        "8 ranks": lambda: {"bytes_by_level": {**off["bytes_by_level"], "node": 0}},
        "comm auto": lambda: {"exchange": untimed(off["exchange"])},
        "plan auto": lambda: {"plan_trials": untimed(off["plan_trials"])},
        "shard weights": lambda: {"rank_param_bytes": records["ulysses"]["rank_param_bytes"][:2]},
        "offload encoders": lambda: {"resident_text_encoders": ["prompt_encoder"]},
        "parallel vae": lambda: {"parallel_vae": False}, "compile": lambda: {"compiled_graphs": 0},
        "lora": lambda: {"lora": None},
        "quantize int8": lambda: {"quantize": None}, "fp8 storage": lambda: {"quantize": None},
        "attention native": lambda: {"attention_backend": {"name": "native", "kernels": ["scaled_dot_product_attention"]}},
        "attention math": lambda: {"attention_backend": {"name": "_native_math", "kernels": ["scaled_dot_product_attention"]}},
        "img2img": lambda: {"parallel_vae_encodes": 0}, "inpaint": lambda: {"parallel_vae_encodes": 1},
        "last frame": lambda: {"conditioned_frames": [0]}, "edit 1 ref": lambda: {"reference_tokens": 0},
        "edit 2 refs": lambda: {"reference_tokens": 0},
    }
    if record["psnr_floor"] is not None and feature != "displaced patches":  # LOSSY: the exact run's latents
        off["latent_rel_diff"] = records["tapa+vfirst"]["latent_rel_diff"]
    off.update(changes.get(feature, dict)())
    return off


def test_every_column_fails_when_its_feature_does_nothing():
    """Each column's evidence, read by the verdict: a real record of each passes, and the same
    record as it would be had the feature done nothing fails, naming what is missing."""
    records = json.loads(RECORDS.read_text())
    features = {f.name: f for f in FEATURES}
    assert set(records) == set(features)

    def verdict(feature: str, record: dict) -> Cell:
        cells = [Cell("tiny-shapes", f, [], f.kind, record=copy.deepcopy(records[name])) for name, f in features.items()]
        cell = next(c for c in cells if c.feature.name == feature)
        cell.record = record
        _verdict(cell, record, cells)
        return cell

    for name, record in records.items():
        cell = verdict(name, copy.deepcopy(record))
        assert cell.passed, (name, cell.outcome, cell.message)
        off = verdict(name, _no_op(name, record, records))
        assert off.outcome == "failed" and "not in effect" in off.message, (name, off.message)


@pytest.mark.parametrize(("args", "message"), [
    (["--json", "/dev/null"], "--json /dev/null is a character device, not a regular file"),
    (["--markdown", "{tmp}"], "is a folder; give a file name"),
    (["--timeout", "-5"], "--timeout -5 must be a positive number of seconds"),
    (["--timeout", "nan"], "--timeout nan must be a positive number of seconds"),
    (["--compile-backend", "bogus"], "--compile-backend 'bogus' is not one of eager"),
    (["--features", " , "], "--features ' , ' names nothing; give one or more of ulysses"),
])
def test_bad_matrix_options_are_refused_before_any_cell(tmp_path, capsys, no_ranks, args, message):
    """A device, a pipe or a folder is never renamed over, after every cell ran or before."""
    argv = ["matrix", "--models", "tiny-flux", *(a.format(tmp=tmp_path) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cocodiff: error: ") and message in err and err.count("\n") == 1, err
