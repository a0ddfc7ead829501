"""The model of a benchmark run (`plan validate`, `bench e2e --tp`): its shapes as the results
state them, and a GGUF model regrouped into other attention heads (``--heads Q/KV``) for TP/DCP
sizes its own heads do not allow (:func:`regrouped_model`)."""

from __future__ import annotations

from pathlib import Path


def model_shapes(config) -> dict:
    return {"hidden_size": config.hidden_size, "num_layers": config.num_layers, "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}


def describe_shapes(config) -> str:
    return (f"{config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} query / "
            f"{config.num_kv_heads} KV heads of {config.head_dim}, MLP {config.intermediate_size}, "
            f"vocabulary {config.vocab_size}")


def parse_heads(text: str) -> tuple[int, int]:
    try:
        q, kv = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"--heads takes Q/KV such as 8/1, got {text!r}") from None
    if q < 1 or kv < 1 or q % kv:
        raise ValueError(f"--heads {text}: Q and KV must be >= 1 and KV must divide Q")
    return q, kv


def regrouped_model(model: str, heads: str, *, cache_dir: Path | None = None, log=print) -> tuple[str, str]:
    """``model`` (a GGUF file or an embedded name) with its attention regrouped into ``heads`` (``Q/KV``):
    written once to ``cache_dir`` (default: the temporary directory), returned with a line saying
    what it is. Every tensor is the original's (same types, same bytes) except K and V, cut to
    their first ``KV * hidden / Q`` rows; the metadata gives the new head counts and head size. The
    weights' arrangement no longer means anything (the tokens are noise), while every linear but
    K/V keeps its shape and block type, so the timings are those of the original's layers with the
    new heads' attention and KV cache."""
    import tempfile

    import gguf

    from stagewise.model.loader.sources import EMBEDDED, embedded_path

    q, kv = parse_heads(heads)
    src = embedded_path(model) if model in EMBEDDED else Path(model)
    if not src.is_file():
        raise ValueError(f"--heads regroups a GGUF file or an embedded model ({sorted(EMBEDDED)}), got {model!r}")
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    hidden = int(reader.fields[f"{arch}.embedding_length"].contents())
    if hidden % q or (hidden // q) % 2:
        raise ValueError(f"--heads {heads}: hidden size {hidden} must split into {q} heads of an even size")
    head_dim = hidden // q
    was = (reader.fields[f"{arch}.attention.head_count"].contents(),
           reader.fields[f"{arch}.attention.head_count_kv"].contents())
    label = Path(src).stem.split(".")[0].lower()
    dst = (cache_dir or Path(tempfile.gettempdir()) / "stagewise-plan-validate") / f"{label}-h{q}kv{kv}.gguf"
    note = (f"{label} ({src.name}) regrouped from {was[0]} query / {was[1]} KV heads into {q} / {kv} of {head_dim} "
            f"dims: its tensors, K/V cut to their first {kv * head_dim} rows; tokens meaningless")
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return str(dst), note
    log(f"writing {dst}: {note}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    override = {f"{arch}.attention.head_count": q, f"{arch}.attention.head_count_kv": kv,
                f"{arch}.rope.dimension_count": head_dim, f"{arch}.attention.key_length": head_dim,
                f"{arch}.attention.value_length": head_dim}
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, override.get(name, field.contents()), kind)
    for t in reader.tensors:
        data = t.data
        if t.name.rsplit(".", 2)[-2] in ("attn_k", "attn_v"):  # rows are output features: blocks run along them
            data = data[:kv * head_dim]
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return str(dst), note
