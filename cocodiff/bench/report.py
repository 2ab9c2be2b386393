"""`cocodiff report`: the results page, regenerated from benchmark JSON files.

Every table comes from a `cocodiff bench ... --json` file under `docs/results/` and names its
fabric, ranks, preset and date; nothing is typed by hand. The section sits between two markers
in docs/results/README.md (the project's README links to it) and is replaced whole.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..config.variants import DIFFUSERS_ULYSSES, parse_variant

KIND_LABELS = {"a2a_in": "projections in", "a2a_out": "output back", "gather": "gather", "ring": "ring K/V", "data": "CFG/batch gather",
               "stage": "stage boundary"}
"""The kinds of collective CommStats records (projections' all-to-all, the output's, the exit gather, ring's K/V blocks, the data groups' output gather), as tables name them."""

__all__ = ["KIND_LABELS", "auto_versus_fixed", "lossy_subject", "render", "saved_cell", "skipped_cell", "update_readme"]

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _date(result: dict[str, Any], path: Path) -> str:
    return result.get("date") or datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()


def _transport(result: dict[str, Any]) -> str:
    """The exchanges' transport, where the file records it."""
    return f"; exchanges: {result['transport']}" if "transport" in result else ""


def _a2a(result: dict[str, Any], path: Path) -> list[str]:
    lines = [
        f"**bench a2a** - {result['fabric']}; {result['nproc']} ranks = {result['nodes']} nodes x "
        f"{result['ranks_per_node']}; median of {result['repeat']}{_transport(result)}; {_date(result, path)} (`{path.name}`)",
        "",
        "| per rank | flat ms | TAPA ms | TAPA speedup |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['bytes_per_rank'] // 1024} KiB | {r['flat_ms']:.2f} | {r['tapa_ms']:.2f} | {r['speedup']:.2f}x |"
        for r in result["results"]
    ]
    buckets = result["auto_choice"]["buckets"]
    choices = ", ".join(f"{b['bytes_per_rank'] // 1024}K {b['choice']}" for b in buckets)
    unlisted = sorted({b["bytes_per_rank"] for b in buckets} - {r["bytes_per_rank"] for r in result["results"]})
    note = f" ({', '.join(f'{n // 1024}K' for n in unlisted)}: timed by its own calibration, not in the table)" if unlisted else ""
    return lines + ["", f"`auto` chose, from its own calibration run before the table's timings: {choices}{note}."]


def _baseline(names: list[str]) -> str | None:
    """The variant that is diffusers' own Ulysses, if a bench e2e file ran it."""
    for name in names:
        try:
            if parse_variant(name).comm == DIFFUSERS_ULYSSES:
                return name
        except UsageError:  # a name of an older grammar: not the baseline
            continue
    return None


def auto_versus_fixed(variant: dict[str, Any], variants: dict[str, dict[str, Any]]) -> str:
    """How an `auto` variant of a bench e2e run did against the fastest variant fixing its choices."""
    against = variant["vs_fastest_fixed"]
    best, ratio = against["variant"], against["ratio"]
    ms = f"{variant['step_ms']:.1f} vs {variants[best]['step_ms']:.1f} ms/step"
    if ratio <= 1:
        return f"the fastest: {100 * (1 - ratio):.1f}% ahead of the fastest fixed variant, {best} ({ms})"
    return f"missed the fastest fixed variant, {best}, by {100 * (ratio - 1):.1f}% ({ms})"


def _overlap(v_first: dict[str, Any]) -> tuple[float, float]:
    """(overlap ms, hidden / overlap) of a V-First entry; files before the rename call them bound."""
    if "overlap_ms" in v_first:
        return v_first["overlap_ms"], v_first["hidden_over_overlap"]
    return v_first["bound_ms"], v_first["hidden_over_bound"]


def _e2e(result: dict[str, Any], path: Path) -> list[str]:
    baseline = result.get("baseline", "flat")
    source = result.get("image_input") or {}
    task = (f", an edit with {len(source['references'])} reference image(s)" if source.get("task") == "edit"
            else f", {source['task']}" if source else "")
    lines = [
        f"**bench e2e** - {result['model']} {result['height']}x{result['width']}{task}, batch {result['batch']}, "
        f"{result['steps']} steps x {result['repeat']}; {result['fabric']}; {result['nproc']} ranks = "
        f"{result['nodes']} nodes x {result['ranks_per_node']}{_transport(result)}; {_date(result, path)} (`{path.name}`)",
        "",
    ]
    theirs = _baseline(list(result["variants"]))
    extra = " vs diffusers' Ulysses | max abs diff vs it |" if theirs else ""
    lines += [
        f"| variant | ms / step | vs {baseline} | inter-node MiB/step | exposed comm |{extra}",
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if theirs else ""),
    ]
    base_ms = result["variants"][baseline]["step_ms"]
    for name, v in result["variants"].items():
        label = f"{name} (lossy)" if v.get("lossy") else name
        untimed = "+compile" in name  # waits inside compiled blocks are not timed (a clock read would break the graph)
        exposed = "not timed" if untimed else f"{100 * v['exposed_comm_ms'] / v['step_ms']:.0f}%"
        row = (
            f"| {label} | {v['step_ms']:.1f} | {base_ms / v['step_ms']:.2f}x | {v['inter_node_bytes'] / 2**20:.2f} | "
            f"{exposed} |"
        )
        if theirs:
            row += f" {v['speedup_vs_diffusers']:.2f}x | {v['max_abs_diff_vs_diffusers']:.1e} |"
        lines.append(row)
    split = {name: v for name, v in result["variants"].items() if "exposed_comm_ms_by_kind" in v and "+compile" not in name}
    if split:
        kinds = [k for k in KIND_LABELS if any(k in v["exposed_comm_ms_by_kind"] for v in split.values())]
        parts = [
            f"{name} " + " / ".join(f"{x:.0f}" for x in [v.get("step_ms_mean", v["step_ms"]) - v["exposed_comm_ms"],
                                                       *(v["exposed_comm_ms_by_kind"].get(k, 0.0) for k in kinds)])
            for name, v in split.items()
        ]
        lines.append(f"\nWhere a step goes (ms/step; compute = mean step (median where a file has no mean) - exposed communication, then the waits for "
                     f"{' / '.join(KIND_LABELS[k] for k in kinds)}): " + "; ".join(parts) + ".")
    plans = [f"{name}: {v['plan_description']}" + (f", ring hidden {100 * v['ring_hidden_share']:.0f}%" if "ring_hidden_share" in v else "")
             for name, v in result["variants"].items() if "plan_description" in v]
    if any("ring" in p for p in plans):
        lines.append("\nPlans (axes outermost first; ring hidden = share of K/V blocks' time in flight no rank waited for): "
                     + "; ".join(plans) + ".")
    for name, v in result["variants"].items():
        if v.get("auto_choice", {}).get("candidates"):  # `auto`: its trial steps (slowest rank, medians)
            from ..distributed.comm.auto import trials_summary

            auto = v["auto_choice"]
            lines.append(f"\n`{name}` timed its candidates on its first steps ({trials_summary(auto)}) and chose {auto['chosen']}.")
    for name, v in result["variants"].items():
        if "vs_fastest_fixed" in v:
            lines.append(f"\n`{name}` {auto_versus_fixed(v, result['variants'])}.")
    axes = {name: v["bytes_by_axis"] for name, v in result["variants"].items() if v.get("bytes_by_axis")}
    if axes:
        parts = [f"{name} " + ", ".join(f"{axis} {links['inter_node'] / 2**20:.2f}" for axis, links in a.items())
                 for name, a in axes.items()]
        lines.append("\nInter-node MiB per step by plan axis (all ranks): " + "; ".join(parts) + ".")
    for name, vf in result.get("v_first", {}).items():
        overlap, share = _overlap(vf)
        per_layer = ", ".join(f"{100 * _overlap(layer)[1]:.0f}%" for layer in vf["layers"])
        lines.append(
            f"\nV-First ({name} against {vf['against']}): hidden {vf['hidden_ms']:.1f} ms per step, {100 * share:.0f}% of "
            f"the {overlap:.1f} ms overlap min(T_comm(V), T_compute(Q,K)) the paper's model expects (per layer {per_layer})."
        )
    return lines


def _quality(result: dict[str, Any], path: Path) -> list[str]:
    task = f"inpainting, {result['cases']} held-out cases, " if "cases" in result else ""
    truth = "exact" in result and "psnr_gt" in result["exact"]  # --task inpaint: also against the ground truth
    lines = [
        f"**bench quality** - {result['model']} {result['height']}x{result['width']}, {result['steps']} steps, {task}"
        f"{lossy_subject(result)}; {result['nproc']} ranks = {result['nodes']} nodes x "
        f"{result['ranks_per_node']}; against the exact flat run{' and the ground truth' if truth else ''}; "
        f"{_date(result, path)} (`{path.name}`)",
        "",
    ]
    cached = any("skipped_share" in s for s in result["schedules"].values())  # step caches (`--cache`): calls skipped
    if truth:
        exact = result["exact"]
        lines += [
            "| schedule | PSNR dB vs exact | PSNR dB vs truth | SSIM vs truth | inter-node projection bytes saved |"
            + (" calls skipped |" if cached else ""),
            "|---|---:|---:|---:|---:|" + ("---:|" if cached else ""),
            f"| exact run | - | {exact['psnr_gt']:.2f} | {exact['ssim_gt']:.4f} | - |" + (" - |" if cached else ""),
        ]
        for name, s in result["schedules"].items():
            label = f"{name} (lossy)" if s["lossy"] else f"{name} (exact)"
            lines.append(f"| {label} | {s['psnr']:.1f} | {s['psnr_gt']:.2f} | {s['ssim_gt']:.4f} | "
                         f"{saved_cell(s)} |" + (f" {skipped_cell(s)} |" if cached else ""))
        return lines
    lines += [
        "| schedule | PSNR dB | SSIM | inter-node projection bytes saved | cache MiB/rank |" + (" calls skipped |" if cached else ""),
        "|---|---:|---:|---:|---:|" + ("---:|" if cached else ""),
    ]
    for name, s in result["schedules"].items():
        label = f"{name} (lossy)" if s["lossy"] else f"{name} (exact)"
        lines.append(
            f"| {label} | {s['psnr']:.1f} | {s['ssim']:.4f} | {saved_cell(s)} | "
            f"{s['cache_bytes'] / 2**20:.2f} |" + (f" {skipped_cell(s)} |" if cached else "")
        )
    return lines


def lossy_subject(result: dict[str, Any]) -> str:
    """What a quality run compared: 'V-Major on v', 'step caches', displaced patches or several, and the
    wire formats if any."""
    entries = result["schedules"]
    wired = [name for name in entries if name.startswith("wire=")]
    patched = any(name.startswith("patches=") for name in entries)
    vmajor = any("skipped_share" not in s and s["lossy"] for name, s in entries.items()
                 if name not in wired and not name.startswith("patches="))
    cached = any("skipped_share" in s for s in entries.values())
    parts = [f"V-Major on {result['tensors']}"] if vmajor or not (cached or patched) else []
    parts += ["step caches (TAPA)"] if cached else []
    parts += [f"displaced patches ({result['patch_plan']})"] if patched else []
    subject = " and ".join(parts)
    return f"{subject}, LOSSY wire formats ({', '.join(n.removeprefix('wire=') for n in wired)})" if wired else subject


def saved_cell(entry: dict[str, Any]) -> str:
    """The share of the exact TAPA run's inter-node projection bytes an entry saved; '-' for displaced
    patches (their plan sends other projections)."""
    saved = entry["inter_node_bytes_saved"]
    return "-" if saved is None else f"{100 * saved:.1f}%"


def skipped_cell(entry: dict[str, Any]) -> str:
    """A step cache's share of the transformer calls it skipped, with the counts; '-' for a schedule."""
    if "skipped_share" not in entry:
        return "-"
    calls = entry["computed_steps"] + entry["skipped_steps"]
    return f"{100 * entry['skipped_share']:.0f}% ({entry['skipped_steps']}/{calls})"


def _serve(result: dict[str, Any], path: Path) -> list[str]:
    lines = [f"**bench serve** - {result.get('url', '?')}, {result.get('duration_s', '?')} s per level (`{path.name}`)", "",
             "| clients | images/s | p50 ms | p99 ms | errors | lost | per steps class: p50 ms |", "|---:|---:|---:|---:|---:|---:|---|"]
    for level in result["levels"]:
        by_steps = ", ".join(f"{steps} steps {c['p50_ms']:.0f}" for steps, c in level.get("by_steps", {}).items())
        lines.append(f"| {level['concurrency']} | {level['images_per_s']:.2f} | {level['p50_ms']:.0f} | {level['p99_ms']:.0f} | "
                     f"{level['errors']} | {level['lost']} | {by_steps or '-'} |")
    return lines


def _simulate(result: dict[str, Any], path: Path) -> list[str]:
    """A `cocodiff simulate --json` file: predictions (not measurements) and their validation."""
    sources, rows = result.get("sources", {}), result.get("rows", [])
    compute = sources.get("compute" if rows else "validation_compute", "?")
    lines = [
        f"**simulate** (predicted, not measured) - {result['system']}, {result.get('workload') or result['model']}; "
        f"links {sources.get('links', '?')}, compute {compute} (`{path.name}`)",
        "",
    ]
    rows = result.get("settings") or rows  # --paper files keep their settings apart from the figure rows
    if rows and "model" in rows[0]:  # --paper: one line per setting, the variants' speedups side by side
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        settings: dict[tuple, dict[str, Any]] = {}
        for r in rows:
            settings.setdefault((r["model"], r["resolution"], r["nodes"]), {})[r["variant"]] = r
        lines += [
            "| model | res | nodes | flat ms / step | flat comm share | " + " | ".join(f"{v} vs flat" for v in variants) + " |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(variants),
        ]
        for (model, res, nodes), by in settings.items():
            flat = by.get("flat", {})
            lines.append(
                f"| {model} | {res} | {nodes} | {flat.get('step_ms', float('nan')):.1f} | {100 * flat.get('comm_share', 0):.0f}% | "
                + " | ".join(f"{by[v]['speedup_vs_flat']:.2f}x" if v in by else "-" for v in variants) + " |"
            )
    elif rows:
        lines += ["| nodes | variant | ms / step | vs flat | comm share |", "|---:|---|---:|---:|---:|"]
        for r in rows:
            label = f"{r['variant']} (lossy)" if r.get("lossy") else r["variant"]
            lines.append(f"| {r['nodes']} | {label} | {r['step_ms']:.1f} | {r['speedup_vs_flat']:.2f}x | "
                         f"{100 * r.get('comm_share', 0):.0f}% |")
    checks = [v for v in result.get("validation", []) if "error" in v]
    if checks:
        lines += ["| file | variant | measured ms | predicted ms | error |", "|---|---|---:|---:|---:|"]
        lines += [f"| `{v['file']}` | {v['variant']} | {v['measured_ms']:.1f} | {v['predicted_ms']:.1f} | "
                  f"{100 * v['error']:+.0f}% |" for v in checks]
    return lines


def _read(path: Path) -> dict[str, Any]:
    """One bench --json file; a one-line UsageError naming it when it is unreadable, truncated or not an object."""
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:  # RecursionError: nested past the parser's depth
        raise UsageError(f"--results: {path} is not a readable JSON file ({type(error).__name__}: {error}); "
                         f"rewrite it or move it out") from None
    if not isinstance(result, dict):
        raise UsageError(f"--results: {path} holds a JSON {type(result).__name__}, not a bench --json object; "
                         f"move it out") from None
    return result


def _section(result: dict[str, Any], path: Path) -> tuple[str | None, list[str]]:
    """Which section a result belongs to, and its lines (None: a JSON of no kind here, skipped)."""
    if "system" in result and "rows" in result:
        return "simulate", _simulate(result, path)
    if "results" in result and "auto_choice" in result:
        return "a2a", _a2a(result, path)
    if "variants" in result:
        return "e2e", _e2e(result, path)
    if "schedules" in result:
        return "quality", _quality(result, path)
    if "levels" in result and result["levels"] and "images_per_s" in result["levels"][0]:
        return "serve", _serve(result, path)
    return None, []


def render(results_dir: Path) -> str:
    """Markdown for every JSON result in `results_dir`, by kind then name."""
    sections: dict[str, list[str]] = {"a2a": [], "e2e": [], "quality": [], "serve": [], "simulate": []}
    for path in sorted(results_dir.glob("*.json")):
        result = _read(path)
        try:
            kind, lines = _section(result, path)
        except UsageError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:  # fields not of their kinds
            raise UsageError(f"--results: {path} is not a bench --json file of its kind ({type(error).__name__}: "
                             f"{error}); rewrite it or move it out") from None
        if kind is not None:
            sections[kind] += lines + [""]
    titles = {"a2a": "All-to-all: flat vs TAPA", "e2e": "End to end", "quality": "V-Major quality (lossy)",
              "serve": "Serving (bench serve: closed-loop clients)",
              "simulate": "Simulated (cost model)"}
    out = [
        BEGIN,
        "<!-- generated by `cocodiff report`; edit the JSON, not this section -->",
        "",
        "Measured with gloo on 2 CPU cores and the emulated clusters of `cocodiff cluster` (presets with "
        "random weights). Variants and sizes alternate within one run, so ratios hold; absolute times "
        "depend on the machine's load.",
        "",
    ]
    for kind, lines in sections.items():
        if lines:
            out += [f"### {titles[kind]}", "", *lines]
    return "\n".join(out + [END])


def update_readme(readme: Path, results_dir: Path) -> None:
    """Replace the generated section of `readme` (by default docs/results/README.md), or append one."""
    text = readme.read_text() if readme.exists() else "# Results\n"
    section = render(results_dir)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Results\n\n" + section + "\n"
    readme.write_text(text)
