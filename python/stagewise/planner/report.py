"""What `stagewise plan MODEL ...` prints: the table of layouts (text) or the same as JSON, each
layout with its own confidence: the errors measured where the latest validation covers its case,
"not validated" and why elsewhere."""

from __future__ import annotations

from stagewise.planner.validate import NO_RECORD, Confidence, Validation


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def confidence(est, workload, profile, config, validation: Validation | None) -> Confidence:
    if validation is None:
        return NO_RECORD
    return validation.confidence(tp=est.layout.tp, pp=est.layout.pp, pcp=est.layout.pcp, dcp=est.layout.dcp,
                                 batch=workload.batch,
                                 input_length=workload.input_length, output_length=workload.output_length,
                                 architecture=config.architecture, profile_name=profile.name,
                                 profile_kind=profile.kind, weight_quant=workload.weight_quant,
                                 embed_quant=workload.embed_quant, weight_dtype=workload.weight_dtype,
                                 prefix_share=workload.prefix_share, kv_cache_dtype=workload.kv_cache_dtype)


def _shared(reasons: list[tuple[str, ...]]) -> list[str]:
    """The reasons every row gives (in the first row's order): said once, above the table."""
    if not reasons or any(not r for r in reasons):
        return []
    return [r for r in reasons[0] if all(r in other for other in reasons[1:])]


def format_search(results, rejected, *, name, config, workload, profile, validation, num_devices, top) -> str:
    shown = results[:top] if top else results
    conf = [confidence(r, workload, profile, config, validation) for r in shown]
    shared = _shared([c.not_validated_because for c in conf])
    lines = [f"model {name} ({config.architecture}, {config.num_layers} layers), {num_devices} x {profile.name}, "
             f"input {workload.input_length}"
             + (f" ({workload.prefix_share:.0%} found in the prefix cache)" if workload.prefix_share else "")
             + (f", {workload.speculative_tokens} drafts a step at {workload.acceptance:.0%} acceptance "
                f"({workload.tokens_per_step:.2f} tokens a step)" if workload.speculative_tokens else "")
             + f", output {workload.output_length}, batch {workload.batch} per replica, "
             f"weights {workload.weight_dtype}, KV {workload.kv_label}",
             validation.describe() if validation else "no validation on record: no prediction has been checked"]
    if shared:
        lines.append(f"{'Every layout below' if len(shown) > 1 else 'This layout'} is not validated: "
                     + "; ".join(shared))
    lines.append("")
    header = ["#", "parallel", "stages", "weights/rank", "KV/rank", "fits", "max batch", "TTFT ms", "TPOT ms",
              "tok/s", "expected error", "why not validated"]
    table: list[list[str]] = []
    breakdowns = []
    for i, (r, c) in enumerate(zip(shown, conf), 1):
        own = [w for w in c.not_validated_because if w not in shared]
        why = "; ".join(own) if own else ("as above" if shared else "-")
        table.append([str(i), r.layout.label(), str(r.plan), _gib(r.weight_bytes_per_rank), _gib(r.kv_bytes_per_rank),
                      "yes" if r.fits else "NO", str(r.max_batch), f"{1e3 * r.ttft_s:.2f}", f"{1e3 * r.tpot_s:.3f}",
                      f"{r.tokens_per_s:.1f}", c.label(), why])
        breakdowns.append(f"{i}. {r.layout.label()}  prefill: {r.prefill.breakdown_line()}")
        breakdowns.append(f"{' ' * len(str(i))}  {' ' * len(r.layout.label())}  decode:  {r.decode.breakdown_line()}")
    widths = [max(len(row[k]) for row in [header, *table]) for k in range(len(header))]
    right = {0, 3, 4, 6, 7, 8, 9}
    for row in [header, *table]:
        lines.append("  ".join(c.rjust(w) if k in right else c.ljust(w)
                               for k, (c, w) in enumerate(zip(row, widths))).rstrip())
    if len(shown) < len(results):
        lines.append(f"({len(results) - len(shown)} more layouts not shown)")
    lines.append(f"max batch: the most sequences per replica whose KV ({workload.kv_label}, "
                 f"{workload.input_length + workload.output_length} tokens each) fits beside the weights in "
                 f"{workload.memory_fraction:.0%} of a device")
    froms = sorted({c.error_from for c in conf if c.validated})
    if froms:
        lines.append(f"expected error: the largest error the validation measured ({'; '.join(froms)})")
    lines += ["", "Breakdown (% of op time | % of pipeline latency):", *breakdowns]
    if rejected:
        lines += ["", f"{len(rejected)} combinations rejected:"]
        lines += [f"  {r.label()}: {r.reason}" for r in rejected[:10]]
        if len(rejected) > 10:
            lines.append(f"  ... and {len(rejected) - 10} more (see --json)")
    return "\n".join(lines)


def search_json(results, rejected, *, name, config, workload, profile, validation, num_devices, top,
                files: list[str]) -> dict:
    layouts = []
    for r in results[:top] if top else results:
        d = r.to_dict()
        d["confidence"] = confidence(r, workload, profile, config, validation).to_dict()
        layouts.append(d)
    return {"model": name, "architecture": config.architecture, "num_devices": num_devices, "profile": profile.name,
            "workload": {"input_length": workload.input_length, "output_length": workload.output_length,
                         "batch": workload.batch, "microbatches": workload.microbatches,
                         "weight_dtype": workload.weight_dtype, "kv_dtype": workload.kv_dtype,
                         "kv_cache_dtype": workload.kv_cache_dtype,
                         "weight_quant": workload.weight_quant or None, "embed_quant": workload.embed_quant or None,
                         "prefix_share": workload.prefix_share,
                         "speculative_tokens": workload.speculative_tokens, "acceptance": workload.acceptance},
            "validation": validation.describe() if validation else None,
            "layouts": layouts,
            "rejected": [{"tp": r.tp, "pp": r.pp, "pcp": r.pcp, "dcp": r.dcp, "ep": r.ep, "moe_dp": r.moe_dp,
                          "reason": r.reason}
                         for r in rejected],
            "files": files}
