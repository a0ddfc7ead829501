"""Device profiles: what one rank can do, as data (JSON files).

Built-in profiles live in ``planner/profiles/*.json`` (h100-sxm, h200, a100, cpu-generic);
``stagewise bench profile`` writes one measured on this machine. Fields:

- ``memory_bytes``: memory of one device (a rank);
- ``peak_flops``: matmul FLOP/s by dtype name (float32, bfloat16, float16, float8);
- ``memory_bandwidth``: bytes/s of device memory;
- ``efficiency``: fractions of those peaks reached by ``matmul``, ``attention`` and ``memory``-bound
  ops (1.0 in a measured profile: its peaks are already achieved rates);
- ``op_overhead_s``: fixed cost of each operator (kernel launch, dispatch);
- ``links``: ``{"tp"|"pp"|"ep": {"latency_s", "bandwidth"}}`` used for TP all-reduces, PP hops and
  expert all-to-alls (measured on a CPU: ``tp`` and ``ep`` the collectives of a stage of two rank
  processes of the host, fitted to the planner's ring formulas, ``pp`` the pipeline's shm link);
- ``transports``: measured ``{"tcp"|"shm"|...: {"latency_s", "bandwidth"}}``; ``--transport``
  makes one of them the PP link.

Optional, measured by ``stagewise bench profile`` on a CPU (:mod:`stagewise.measure.primitives`,
:mod:`stagewise.bench.profile`):

- ``quant``: ``{"q4_0"|"q4_1"|"q8_0": {"s_per_weight", "flops", "rows_s_per_weight"}}``: a
  block-quantised linear costs ``weights * s_per_weight + flops / flops`` (decode each weight
  once, then the FMAs), measured with weights far beyond the caches; where the optional
  ``rows_s_per_weight`` (``{"1": s, "2": s, ...}``, the kernel's time per weight at those rows of
  x) and ``rows_s_per_output`` (per output row, at the same counts) are given, ``weights`` and
  output rows times them, linear between the measured row counts and beyond the largest at the
  FMA rate (the kernel's register tiles make the first few rows cost other than the asymptotic
  rate says, and each output row ends in reductions and stores);
- ``framework``: the runtime's Python/dispatch cost per decode step: ``layer_s`` per decoder layer
  (``python_layer_s`` through the Python layer loop, which the ranks of a TP/CP stage run)
  and the fixed part by role (``engine_s``, ``head_s``, ``middle_s``, ``last_s``) plus
  ``tokens_s`` (stage 0 taking sampled tokens back). With it, compute ops pay no ``op_overhead_s``
  (the framework figures already hold every op's dispatch);
- ``attention_decode``: ``{"flops", "bandwidth", "call_s"}``: the runtime's decode attention (one
  new token per row over the paged cache, the cache beyond the core's caches as a model's layers
  leave it) costs ``call_s + flops / flops + cached K/V bytes / bandwidth`` a layer, in place of
  the attention roofline (prefill keeps it);
- ``cores``: CPU cores the stages share (stage processes beyond it take turns; a stage of several
  ranks, each a process, counts as that many: :meth:`DeviceProfile.for_ranks`);
- ``concurrency``: ``{"1": s, "2": s, ...}`` seconds of one reference pass with 1, 2, ... busy
  single-thread processes side by side: ``concurrency[n] / concurrency["1"]`` is how much ``n``
  busy stage processes slow each other (without it: ``max(1, n / cores)``); an optional ``"ref"``
  (default ``"1"``) is the one-process pass taken with the profile's rates, so that figures
  measured later, under other conditions, compare with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).resolve().parent / "profiles"
LINK_KINDS = ("tp", "pp", "ep")
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16", "half": "float16", "fp8": "float8", "float8": "float8",
               "int8": "float8"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
QUANT_BITS = {"q4_0": 4.5, "q4_1": 5.0, "q8_0": 8.5}
"""Bits per weight of the GGUF block types (32 weights a block: 18, 20 and 34 bytes)."""
FRAMEWORK_KEYS = ("layer_s", "python_layer_s", "cp_layer_s", "engine_s", "head_s", "middle_s", "last_s", "tokens_s")
OPTIONAL_FRAMEWORK_KEYS = ("python_layer_s", "cp_layer_s")
"""Measured by later versions of `bench profile`: a profile without them is still read."""


def dtype_name(value: str) -> str:
    """Canonical dtype name (``bf16`` -> ``bfloat16``); ValueError for anything else."""
    key = str(value).lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPE_NAMES)}, got {value!r}")
    return DTYPE_NAMES[key]


@dataclass(frozen=True, slots=True)
class Link:
    latency_s: float
    bandwidth: float
    """bytes/s, one direction."""
    collectives: dict[str, dict[int, float]] = field(default_factory=dict)
    """Measured seconds of each collective (``all_reduce``, ``all_gather``) of a group of
    ``ranks`` processes by the bytes each rank hands it (a TP link measured on this host); the
    ring formulas stand in for other group sizes and for a link without them."""
    ranks: int = 0

    def one_way_s(self, nbytes: float) -> float:
        """One message one way: ``latency + message_bytes / bandwidth`` (0 for an empty message)."""
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth

    def measured_s(self, collective: str, group: int, nbytes: float) -> float | None:
        """The measured time of ``collective`` over ``group`` ranks with ``nbytes`` per rank: linear
        between the measured sizes, the smallest's time below them, the last slope above them
        (None: not measured for this group size)."""
        table = self.collectives.get(collective)
        if not table or group != self.ranks:
            return None
        pts = sorted(table.items())
        if nbytes <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        seg = next(((a, b) for a, b in zip(pts, pts[1:]) if nbytes <= b[0]), (pts[-2], pts[-1]))
        (x0, t0), (x1, t1) = seg
        return t0 + (t1 - t0) * (nbytes - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    efficiency: dict[str, float]
    op_overhead_s: float
    links: dict[str, Link]
    transports: dict[str, Link] = field(default_factory=dict)
    kind: str = "gpu"
    description: str = ""
    source: str = "built-in"
    measured: dict[str, Any] = field(default_factory=dict)
    quant: dict[str, dict[str, float]] = field(default_factory=dict)
    framework: dict[str, float] = field(default_factory=dict)
    cores: int | None = None
    concurrency: dict[str, float] = field(default_factory=dict)
    attention_decode: dict[str, float] = field(default_factory=dict)
    ranks_per_stage: int = 1
    """The processes per stage its ``concurrency`` counts each busy stage as (:meth:`for_ranks`)."""

    def flops(self, dtype: str) -> float:
        """Achievable matmul FLOP/s in ``dtype`` (peak times efficiency)."""
        name = dtype_name(dtype)
        peak = self.peak_flops.get(name)
        if peak is None:  # e.g. fp8 on an A100: computed in the next wider type
            peak = self.peak_flops.get("bfloat16") or self.peak_flops["float32"]
        return peak * self.efficiency.get("matmul", 1.0)

    def attention_flops(self, dtype: str) -> float:
        return self.flops(dtype) / self.efficiency.get("matmul", 1.0) * self.efficiency.get("attention", 1.0)

    @property
    def bandwidth(self) -> float:
        """Achievable memory bytes/s."""
        return self.memory_bandwidth * self.efficiency.get("memory", 1.0)

    def with_transport(self, transport: str | None) -> DeviceProfile:
        """This profile with the measured ``transport`` as its PP link."""
        if transport is None:
            return self
        if transport not in self.transports:
            raise ValueError(f"device profile {self.name!r}: transport {transport!r} was not measured; "
                             f"it has {sorted(self.transports) or 'none'}")
        links = {**self.links, "pp": self.transports[transport]}
        return DeviceProfile(**{**_fields(self), "links": links})

    def for_ranks(self, ranks: int) -> DeviceProfile:
        """This profile for stages of ``ranks`` processes each (``tp * pcp``; a CPU profile): a
        stage's ranks compute at once, in lockstep, so ``n`` busy stages are ``n * ranks`` busy
        single-thread processes, which take turns on the cores as pipeline stages do. The
        returned profile's ``concurrency`` gives at ``n`` busy stages the slowdown of
        ``n * ranks`` processes in this one's (read as :func:`stagewise.planner.estimate.slowdown`
        reads it: measured paces, linear between counts and proportional beyond; without them
        ``max(1, n * ranks / cores)``), relative to one process alone (``ref``). The same profile
        for ``ranks`` 1, or on a GPU (one device a rank), and for the ``ranks`` it was made for
        (applying it twice counts the ranks once)."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"DeviceProfile.for_ranks: ranks must be an int >= 1, got {ranks!r}")
        if ranks == self.ranks_per_stage or self.kind != "cpu" or not (self.concurrency or self.cores):
            return self
        if self.ranks_per_stage != 1:
            raise ValueError(f"DeviceProfile.for_ranks: this profile already counts {self.ranks_per_stage} "
                             f"processes a stage; make the one for {ranks} from the original")
        counts = [int(k) for k in self.concurrency if k != "ref"] or [self.cores or 1]
        top = max(1, -(-max(counts) // ranks))  # beyond it the slowdown is proportional either way
        conc = {"ref": 1.0, **{str(n): process_slowdown(self, float(n * ranks)) for n in range(1, top + 1)}}
        return DeviceProfile(**{**_fields(self), "concurrency": conc, "ranks_per_stage": ranks})

    def to_dict(self) -> dict[str, Any]:
        d = _fields(self)
        if d["ranks_per_stage"] == 1:  # a profile as measured; else the rescaled one, as such
            d.pop("ranks_per_stage")
        d["links"] = {k: {"latency_s": v.latency_s, "bandwidth": v.bandwidth} for k, v in self.links.items()}
        d["transports"] = {k: {"latency_s": v.latency_s, "bandwidth": v.bandwidth} for k, v in self.transports.items()}
        return d


def process_slowdown(p: DeviceProfile, busy: float) -> float:
    """``busy`` single-thread processes' pace against one alone on CPU profile ``p``: its measured
    ``concurrency`` (ratio to ``ref``, never below 1 past one process), linear between the counts,
    proportional beyond the largest; without measurements ``max(1, busy / cores)``."""
    busy = max(busy, 1.0)
    counts = sorted(int(k) for k in p.concurrency if k != "ref")
    if not counts:
        return max(1.0, busy / p.cores) if p.cores else 1.0
    ref = p.concurrency.get("ref", p.concurrency.get("1"))
    g = {n: max(p.concurrency[str(n)] / ref, 1.0 if n > 1 else 0.0) for n in counts}
    if busy <= counts[0]:
        return g[counts[0]]
    if busy >= counts[-1]:
        return g[counts[-1]] * busy / counts[-1]
    lo, hi = max(n for n in counts if n <= busy), min(n for n in counts if n >= busy)
    return g[lo] if hi == lo else g[lo] + (g[hi] - g[lo]) * (busy - lo) / (hi - lo)


def _fields(p: DeviceProfile) -> dict[str, Any]:
    return {f: getattr(p, f) for f in DeviceProfile.__slots__}


def _number(where: str, d: dict, key: str, positive: bool = True) -> float:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{where}: field {key!r} must be a {'positive' if positive else 'non-negative'} number, "
                         f"got {value!r}")
    return float(value)


def _link(where: str, d: Any) -> Link:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object with latency_s and bandwidth, got {d!r}")
    measured = d.get("collectives", {})
    if not isinstance(measured, dict):
        raise ValueError(f"{where}: field 'collectives' must be an object, got {measured!r}")
    tables: dict[str, dict[int, float]] = {}
    for name in ("all_reduce", "all_gather"):
        table = measured.get(f"{name}_s")
        if table is None:
            continue
        try:
            tables[name] = {int(k): float(v) for k, v in table.items()}
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"{where}: collectives.{name}_s must map bytes to seconds, got {table!r}") from None
    ranks = measured.get("ranks", 0)
    if tables and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2):
        raise ValueError(f"{where}: collectives.ranks must be the measured group's size (>= 2), got {ranks!r}")
    return Link(_number(where, d, "latency_s", positive=False), _number(where, d, "bandwidth"), tables,
                ranks if tables else 0)


def profile_from_dict(d: Any, source: str = "built-in") -> DeviceProfile:
    """A validated profile; ValueError names the field."""
    where = f"device profile {source}"
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    peaks = d.get("peak_flops")
    if not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"{where}: field 'peak_flops' must map dtype names to FLOP/s, got {peaks!r}")
    peak_flops = {dtype_name(k): _number(f"{where} peak_flops", peaks, k) for k in peaks}
    if "float32" not in peak_flops and "bfloat16" not in peak_flops:
        raise ValueError(f"{where}: peak_flops needs float32 or bfloat16, got {sorted(peak_flops)}")
    eff = d.get("efficiency", {})
    if not isinstance(eff, dict):
        raise ValueError(f"{where}: field 'efficiency' must be an object, got {eff!r}")
    for k, v in eff.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"{where}: efficiency.{k} must be in (0, 1], got {v!r}")
    links_in = d.get("links")
    if not isinstance(links_in, dict) or any(k not in links_in for k in LINK_KINDS):
        raise ValueError(f"{where}: field 'links' must give {list(LINK_KINDS)}, got {links_in!r}")
    links = {k: _link(f"{where} links.{k}", links_in[k]) for k in LINK_KINDS}
    transports_in = d.get("transports") or {}
    if not isinstance(transports_in, dict):
        raise ValueError(f"{where}: field 'transports' must be an object, got {transports_in!r}")
    transports = {k: _link(f"{where} transports.{k}", v) for k, v in transports_in.items()}
    quant_in = d.get("quant") or {}
    if not isinstance(quant_in, dict):
        raise ValueError(f"{where}: field 'quant' must be an object, got {quant_in!r}")
    quant = {}
    for k, v in quant_in.items():
        if k not in QUANT_BITS or not isinstance(v, dict):
            raise ValueError(f"{where}: quant.{k}: expected one of {sorted(QUANT_BITS)} mapping to "
                             f"{{s_per_weight, flops}}, got {k!r}: {v!r}")
        quant[k] = {"s_per_weight": _number(f"{where} quant.{k}", v, "s_per_weight", positive=False),
                    "flops": _number(f"{where} quant.{k}", v, "flops")}
        rows_in = v.get("rows_s_per_weight")
        if rows_in is not None:
            if not isinstance(rows_in, dict) or not rows_in or \
                    any(not str(r).isdigit() or int(r) < 1 for r in rows_in):
                raise ValueError(f"{where}: quant.{k}.rows_s_per_weight must map row counts '1', '2', ... to "
                                 f"seconds per weight, got {rows_in!r}")
            quant[k]["rows_s_per_weight"] = {str(r): _number(f"{where} quant.{k}.rows_s_per_weight", rows_in, r)
                                             for r in rows_in}
            out_in = v.get("rows_s_per_output") or {}
            if not isinstance(out_in, dict) or any(str(r) not in quant[k]["rows_s_per_weight"] for r in out_in):
                raise ValueError(f"{where}: quant.{k}.rows_s_per_output must map row counts of rows_s_per_weight "
                                 f"to seconds per output row, got {out_in!r}")
            quant[k]["rows_s_per_output"] = {str(r): _number(f"{where} quant.{k}.rows_s_per_output", out_in, r,
                                                             positive=False) for r in out_in}
    fw_in = d.get("framework") or {}
    if not isinstance(fw_in, dict):
        raise ValueError(f"{where}: field 'framework' must be an object, got {fw_in!r}")
    framework = {}
    for k in FRAMEWORK_KEYS:
        if fw_in and (k in fw_in or k not in OPTIONAL_FRAMEWORK_KEYS):
            framework[k] = _number(f"{where} framework", fw_in, k, positive=False)
    cores = d.get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ValueError(f"{where}: field 'cores' must be an int >= 1, got {cores!r}")
    conc_in = d.get("concurrency") or {}
    if not isinstance(conc_in, dict) or (conc_in and "1" not in conc_in and "ref" not in conc_in) or \
            any(k != "ref" and (not str(k).isdigit() or int(k) < 1) for k in conc_in):
        raise ValueError(f"{where}: field 'concurrency' must map '1', '2', ... (and optionally 'ref') to seconds, "
                         f"got {conc_in!r}")
    concurrency = {str(k): _number(f"{where} concurrency", conc_in, k) for k in conc_in}
    attn_in = d.get("attention_decode") or {}
    if not isinstance(attn_in, dict):
        raise ValueError(f"{where}: field 'attention_decode' must be an object with flops and call_s, got {attn_in!r}")
    attention_decode = ({"flops": _number(f"{where} attention_decode", attn_in, "flops"),
                         "call_s": _number(f"{where} attention_decode", attn_in, "call_s", positive=False)}
                        if attn_in else {})
    if attn_in and "bandwidth" in attn_in:
        attention_decode["bandwidth"] = _number(f"{where} attention_decode", attn_in, "bandwidth")
    return DeviceProfile(name=name, memory_bytes=int(_number(where, d, "memory_bytes")), peak_flops=peak_flops,
                         memory_bandwidth=_number(where, d, "memory_bandwidth"), efficiency=dict(eff),
                         op_overhead_s=_number(where, d, "op_overhead_s", positive=False), links=links,
                         transports=transports, kind=str(d.get("kind", "gpu")),
                         description=str(d.get("description", "")), source=source,
                         measured=dict(d.get("measured") or {}), quant=quant, framework=framework, cores=cores,
                         concurrency=concurrency, attention_decode=attention_decode)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


ALIASES = {"h100": "h100-sxm", "cpu": "cpu-generic"}


def load_profile(name_or_file: str | Path) -> DeviceProfile:
    """A built-in profile by name (``h100-sxm``, ``h200``, ``a100``, ``cpu-generic``) or a JSON file."""
    text = str(name_or_file)
    name = ALIASES.get(text.lower(), text.lower())
    path = BUILTIN_DIR / f"{name}.json"
    source = f"built-in {name!r}"
    if not path.is_file():
        path, source = Path(text), repr(text)
        if not path.is_file():
            raise ValueError(f"device profile: {text!r} is neither a built-in profile ({', '.join(builtin_profiles())}) "
                             "nor a JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"device profile {source}: not valid JSON: {err}") from None
    return profile_from_dict(data, source)
