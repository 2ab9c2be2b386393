"""The variant names of `bench e2e`, `simulate` and the report: one grammar, parsed once.

    VARIANT = [PLAN ":"] COMM ["+vfirst"] ["+vmajor" | "+vmajorqk"] ["+compile"] ["+dbcache" | "+cache=SPEC"] ["+fp8"]
              ["+shard"] ["+patches=M"] ["+quantize=MODE"] ["+attn=NAME"]
            | "diffusers-ulysses"            diffusers' own Ulysses, a measured baseline
            | "xdit-ulysses"                 xDiT's own Ulysses (FLUX.1), a measured baseline
            | "cocodiff"                     = tapa+vfirst+vmajor, the paper's full method
    COMM    = flat | tapa | auto

`+vfirst` is V-First (lossless); `+compile` compiles the transformer's repeated blocks
(`ParallelConfig.compile`; with `flat` or `tapa` only); `+vmajor` is V-Major (LOSSY) on V with the linear schedule,
`+vmajorqk` on V, Q and K; V-Major needs `flat` or `tapa` (which pieces cross nodes must be known
in advance, not chosen per message as `auto` does). Options may come in any order. `PLAN:` runs
the variant under a parallel plan (config/plan.py: `u4r2:tapa+vfirst`, `r2u4:flat`, `auto:auto`); without
it (or with an empty one) the engine's default plan runs. `+dbcache` adds a step cache (LOSSY) with
DBCache's default settings, `+cache=SPEC` one of `--cache`'s specs (config/cache.py); a SPEC's own
`:` and `,` stay in it (`tapa+cache=dbcache:F8B0,0.08,flat` is two variants). `+fp8` (LOSSY) sends
the messages that cross the slowest level (the nodes) in fp8 (`--wire`'s formats, config/wire.py; K
at bf16), everything inside a node exactly: `tapa+vfirst+fp8`. `+shard` runs on a second copy of the
pipeline whose transformer weights are sharded over each node's ranks (`--shard-weights on`, FSDP2;
exact), so that sharded and whole weights are timed in one run: `tapa+vfirst,tapa+vfirst+shard`.
`+patches=M` (LOSSY) runs one image's step in M displaced patches through the plan's pipeline
stages (`--pipe-patches M`, engine/patches.py): `p2u2:tapa+vfirst+patches=4`. `+quantize=MODE`
(LOSSY) runs on a copy of the pipeline whose transformer weights are quantized (`--quantize MODE`,
models/quantize.py), so that quantized and full weights are timed in one run:
`flat,flat+quantize=int8wo`. `+attn=NAME` runs attention with one of diffusers' dispatcher backends
(`--attention-backend NAME`): `flat,flat+attn=flash,flat+attn=_flash_3`.

A `Variant` keeps the text it was parsed from as its `name`, so reports and JSON keys are the
names the user wrote (`cocodiff`, `tapa+vmajor+vfirst`); two names that mean the same variant
compare equal. What a command can run is its own check on top (`simulate` models `flat` and
`tapa` only); the grammar and its errors are the same everywhere. No torch: `simulate` uses it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UsageError
from .cache import parse_cache
from .parallel import COMM_CHOICES
from .plan import parse_plan
from .sizes import digits
from .wire import parse_wire

__all__ = ["ALIASES", "BASELINES", "DIFFUSERS_ULYSSES", "FP8_WIRE", "OPTIONS", "Variant", "XDIT_ULYSSES", "parse_variant",
           "parse_variants"]

DIFFUSERS_ULYSSES = "diffusers-ulysses"
"""diffusers' own `ContextParallelConfig(ulysses_degree=P)` (bench/diffusers_cp.py): a baseline, no options."""
XDIT_ULYSSES = "xdit-ulysses"
"""xDiT's own FLUX.1 Ulysses (`USP`; bench/xdit.py, xfuser installed beside): a baseline, no options."""
BASELINES = {DIFFUSERS_ULYSSES: "diffusers", XDIT_ULYSSES: "xdit"}
"""The baselines, each to the name its figures go by (`speedup_vs_diffusers`, `speedup_vs_xdit`)."""
ALIASES = {"cocodiff": "tapa+vfirst+vmajor"}
"""Names that stand for another: `cocodiff` = TAPA + V-First + V-Major on V (the paper's full method)."""
OPTIONS = ("vfirst", "vmajor", "vmajorqk", "compile", "dbcache", "cache=SPEC", "fp8", "shard", "patches=M", "quantize=MODE",
           "attn=NAME")
_VALUED = {"cache=": "cache=SPEC", "patches=": "patches=M", "quantize=": "quantize=MODE", "attn=": "attn=NAME"}
"""Options that carry a value, by their prefix -> their name in OPTIONS."""
FP8_WIRE = "slowest=fp8"
"""What `+fp8` stands for, as `ParallelConfig.wire` takes it: fp8 on the outermost level."""
_V_MAJOR = {"vmajor": "v", "vmajorqk": "vqk"}
_BASES = (*COMM_CHOICES, *BASELINES, *ALIASES)


@dataclass(frozen=True, slots=True)
class Variant:
    """One run configuration of a benchmark or a prediction."""

    comm: str
    """`flat`, `tapa` or `auto` (ParallelConfig.comm), or a baseline's name (`BASELINES`)."""
    v_first: bool = False
    """V-First (lossless)."""
    v_major_tensors: str | None = None
    """V-Major (LOSSY, linear schedule) on `v` or on `vqk`; None: exact."""
    plan: str | None = None
    """A parallel plan (config/plan.py) as written (`u4r2`, `auto`); None: the engine's default plan."""
    compile: bool = False
    """The repeated blocks compiled (`ParallelConfig.compile`)."""
    cache: str | None = None
    """A step cache (LOSSY) as `--cache` takes it (`ParallelConfig.cache`); None: none."""
    wire: str | None = None
    """Wire formats per level (LOSSY) as `--wire` takes them (`+fp8`: `FP8_WIRE`); None: exact messages."""
    shard: bool = False
    """The transformer's weights sharded over each node's ranks (`+shard`; `--shard-weights on`)."""
    patches: int | None = None
    """Displaced patches per step (LOSSY, `+patches=M`; `--pipe-patches M`); None: whole images."""
    quantize: str | None = None
    """The transformer's weights quantized in this mode (LOSSY, `+quantize=MODE`; `--quantize MODE`,
    checked where torchao is known: the commands' own checks); None: as loaded."""
    attention: str | None = None
    """The attention kernel, a backend of diffusers' dispatcher (`+attn=NAME`; `--attention-backend
    NAME`, checked as the commands check it); None: the engine's default."""
    text: str | None = field(default=None, compare=False)
    """The name as written, when parsed (None: `canonical`)."""

    def __post_init__(self) -> None:
        name = self.name
        if self.plan is not None and self.plan != "auto":
            try:
                parse_plan(self.plan)
            except UsageError as error:
                raise UsageError(f"variant {name!r}: {error}") from None
        if self.comm not in (*COMM_CHOICES, *BASELINES):
            raise UsageError(f"variant {name!r}: {self.comm!r} is not one of {', '.join(_BASES)}")
        if self.v_major_tensors not in (None, "v", "vqk"):
            raise UsageError(f"variant {name!r}: V-Major tensors {self.v_major_tensors!r} are not v or vqk")
        if self.baseline and (self.v_first or self.lossy):
            raise UsageError(f"variant {name!r}: {self.comm} is a baseline and takes no options")
        if self.lossy and self.comm == "auto":
            raise UsageError(f"variant {name!r}: V-Major needs tapa or flat as the base, not auto")
        if self.compile and (self.comm == "auto" or self.plan == "auto" or self.lossy or self.baseline):
            raise UsageError(f"variant {name!r}: +compile runs fixed exchanges and plans, exact (not auto, V-Major or a baseline)")
        if self.cache is not None:
            try:
                parse_cache(self.cache)
            except UsageError as error:
                raise UsageError(f"variant {name!r}: {error}") from None
            if self.baseline:
                raise UsageError(f"variant {name!r}: a step cache does not combine with {self.comm}")
        if self.wire is not None:
            try:
                parse_wire(self.wire)
            except UsageError as error:
                raise UsageError(f"variant {name!r}: {error}") from None
            if self.baseline or self.compile:
                raise UsageError(f"variant {name!r}: a wire format does not combine with "
                                 f"{self.comm if self.baseline else '+compile'}")
        if self.patches is not None and (self.patches < 2 or self.baseline):
            raise UsageError(f"variant {name!r}: +patches=M takes M of 2 or more, with one of cocodiff's exchanges")
        if (self.quantize or self.attention) and self.baseline:
            raise UsageError(f"variant {name!r}: {self.comm} is a baseline and takes no options")
        if self.quantize and self.shard:
            raise UsageError(f"variant {name!r}: +quantize does not combine with +shard (quantized weights are not "
                             f"sharded here)")
        if self.shard and (self.baseline or self.compile):
            raise UsageError(f"variant {name!r}: +shard does not combine with "
                             f"{self.comm if self.baseline else '+compile'}")

    @property
    def baseline(self) -> bool:
        """A peer's own Ulysses (diffusers', xDiT's) rather than one of cocodiff's exchanges."""
        return self.comm in BASELINES

    @property
    def lossy(self) -> bool:
        """V-Major runs (what `simulate` models); a step cache is `cached`."""
        return self.v_major_tensors is not None

    @property
    def cached(self) -> bool:
        """A step cache runs (LOSSY, like V-Major)."""
        return self.cache is not None

    @property
    def packed(self) -> bool:
        """Messages over some level travel in a wire format (LOSSY, like V-Major)."""
        return self.wire is not None

    @property
    def displaced(self) -> bool:
        """One image's step runs in displaced patches (LOSSY, like V-Major)."""
        return self.patches is not None

    @property
    def inexact(self) -> bool:
        """Not exact against one process: V-Major, a step cache, a wire format, displaced patches or
        quantized weights (each LOSSY)."""
        return self.lossy or self.cached or self.packed or self.displaced or self.quantize is not None

    @property
    def v_major(self) -> str:
        """The V-Major schedule this variant runs, as `ParallelConfig.v_major` takes it."""
        return "linear" if self.lossy else "off"

    @property
    def canonical(self) -> str:
        """The name in the grammar's order, without alias: `tapa+vfirst+vmajor`."""
        options = ["vfirst"] * self.v_first + [o for o, t in _V_MAJOR.items() if t == self.v_major_tensors]
        options += ["compile"] * self.compile
        options += [] if self.cache is None else ["dbcache"] if self.cache == "dbcache" else [f"cache={self.cache}"]
        options += ["fp8"] if self.wire == FP8_WIRE else []
        options += ["shard"] * self.shard
        options += [f"patches={self.patches}"] if self.patches is not None else []
        options += [f"quantize={self.quantize}"] if self.quantize is not None else []
        options += [f"attn={self.attention}"] if self.attention is not None else []
        prefix = f"{self.plan}:" if self.plan is not None else ""
        return prefix + "+".join([self.comm, *options])

    @property
    def name(self) -> str:
        """The name as written (the JSON key and the label of every report)."""
        return self.text if self.text is not None else self.canonical


def parse_variant(text: str) -> Variant:
    """'tapa+vfirst+vmajor' -> Variant; a bad name is a one-line UsageError naming it."""
    name = text.strip()
    head, plus, tail = name.partition("+")  # a cache SPEC's own ":" comes after the first "+"
    plan, colon, rest = head.rpartition(":")
    if not colon:
        plan, rest = "", head
    plan = plan.strip().lower() or None
    base, *options = ALIASES.get(rest + plus + tail, rest + plus + tail).split("+")
    caches = [o for o in options if o == "dbcache" or o.startswith("cache=")]
    patches = [o.removeprefix("patches=") for o in options if o.startswith("patches=")]
    valued = {prefix: [o.removeprefix(prefix) for o in options if o.startswith(prefix)] for prefix in ("quantize=", "attn=")}
    for prefix, values in valued.items():
        if values and not values[0]:
            raise UsageError(f"variant {name!r}: +{prefix} names no {_VALUED[prefix].partition('=')[2].lower()}")
    options = [next((n for p, n in _VALUED.items() if o.startswith(p)), o) for o in options]
    if patches and not digits(patches[0]):
        raise UsageError(f"variant {name!r}: +patches={patches[0]} is not a count of patches")
    if base in ALIASES:
        raise UsageError(f"variant {name!r}: {base} stands for {ALIASES[base]} and takes no options")
    if base not in (*COMM_CHOICES, *BASELINES):
        raise UsageError(f"variant {name!r}: {base!r} is not one of {', '.join(_BASES)}")
    for option in options:
        if option not in OPTIONS:
            raise UsageError(f"variant {name!r}: option {option!r} is not one of {', '.join(OPTIONS)}")
        if options.count(option) > 1:
            raise UsageError(f"variant {name!r}: option {option!r} is given twice")
    majors = [o for o in options if o in _V_MAJOR]
    if len(majors) > 1:
        raise UsageError(f"variant {name!r}: +vmajor and +vmajorqk exclude each other")
    if len(caches) > 1:
        raise UsageError(f"variant {name!r}: one step cache at most (+dbcache or +cache=SPEC)")
    cache = caches[0].removeprefix("cache=") if caches else None
    return Variant(comm=base, v_first="vfirst" in options, v_major_tensors=_V_MAJOR[majors[0]] if majors else None,
                   plan=plan, compile="compile" in options, cache=cache, wire=FP8_WIRE if "fp8" in options else None,
                   shard="shard" in options, patches=int(patches[0]) if patches else None,
                   quantize=(valued["quantize="] or [None])[0], attention=(valued["attn="] or [None])[0], text=name)


def parse_variants(text: str) -> list[Variant]:
    """'flat, tapa+vfirst,cocodiff' -> variants, in order; none twice (under any name)."""
    names: list[str] = []
    for piece in text.split(","):  # a piece that cannot start a variant (`0.08`) ends the last one's cache SPEC
        if names and "+cache=" in names[-1] and re.match(r"\s*([\d.]|[A-Z]+\d)", piece):
            names[-1] += "," + piece
        else:
            names.append(piece)
    variants = [parse_variant(name) for name in names if name.strip()]
    if not variants:
        raise UsageError(f"--variants {text!r} is empty; give names like flat,tapa,tapa+vfirst,cocodiff")
    for i, variant in enumerate(variants):
        if variant in variants[:i]:
            first = variants[variants.index(variant)].name
            same = "" if first == variant.name else f" ({first!r} and {variant.name!r} are the same)"
            raise UsageError(f"--variants {text!r} names a variant twice{same}")
    return variants
