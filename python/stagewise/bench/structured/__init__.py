"""``stagewise bench structured``: what structured output costs.

- **The grammar engines** side by side (:mod:`~stagewise.bench.structured.engines`): llguidance
  (the runtime's) and, when importable, xgrammar: the vocabulary's set-up, compiling a 20-field
  schema, the per-token mask at batch 1 and 16 along a valid answer, and how many of a set of
  schemas each compiles.
- **The runtime** (:mod:`~stagewise.bench.structured.decode`): SmolLM2's decode time per token at
  batch 1 and 16, the same requests with and without a JSON schema that never completes within the
  measured tokens, alternating runs; the ratio is what the mask costs.
- **The servers** (:mod:`~stagewise.bench.structured.servers`): the same requests, free and held to
  a schema, through ``stagewise serve``, llama.cpp's server and vLLM's CPU backend.
"""

from __future__ import annotations

import argparse

from stagewise.bench.options import add_common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "structured")
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file, an HF folder or smollm2-135m (default)")
    parser.add_argument("--batch-sizes", default="1,16", metavar="1,16", help="decode batch sizes (default 1,16)")
    parser.add_argument("--tokens", type=int, default=None, metavar="N",
                        help="tokens generated per request (default 64; --tiny: 8)")
    parser.add_argument("--repeats", type=int, default=None, metavar="R",
                        help="runs of each, alternating, the median kept (default 9; --tiny: 1)")
    parser.add_argument("--linear-precision", default="int8", choices=("exact", "int8"),
                        help="the model's linears (default int8)")
    parser.add_argument("--servers", default="stagewise,llama.cpp", metavar="stagewise,llama.cpp,vllm",
                        help="the servers the same structured requests go through (default stagewise,llama.cpp; "
                             "vllm: vLLM's CPU backend, see --vllm-python; none: no server runs)")
    parser.add_argument("--server-requests", type=int, default=None, metavar="N",
                        help="prompts per server, each free and held (default 8; --tiny: 2)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="the python of the environment vLLM's CPU build is installed in (default: "
                             "$STAGEWISE_VLLM_PYTHON)")
    parser.add_argument("--install-baseline", action="store_true",
                        help="pip install llama-cpp-python (a native source build) when it is missing")


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench import report
    from stagewise.bench.structured import decode, engines
    from stagewise.bench.structured.servers import SERVERS, markdown

    info = report.machine_info("cpu")
    info.update(model=args.model, threads=args.threads)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        log(f"stagewise bench: --batch-sizes takes batch sizes >= 1 such as 1,16, got {args.batch_sizes!r}")
        return 2
    servers = [s.strip() for s in args.servers.split(",") if s.strip() and s.strip() != "none"]
    if any(s not in SERVERS for s in servers):
        log(f"stagewise bench: --servers takes some of {', '.join(SERVERS)} or none, got {args.servers!r}")
        return 2
    if servers:
        try:
            server_check(args, servers)
        except ValueError as err:
            log(f"stagewise {err}")
            return 2
    tokens = args.tokens or (8 if args.tiny else 64)
    repeats = args.repeats or (1 if args.tiny else 9)
    engine_rows = engines.measure(args.model, sizes, tiny=args.tiny, log=log)
    decode_rows = decode.measure(args.model, sizes, tokens, repeats, args.linear_precision, log=log)
    data = {"machine": info, "engines": engine_rows, "decode": decode_rows}
    lines = engines.markdown(info, engine_rows) + [""] + decode.markdown(decode_rows, tokens, repeats)
    if servers:
        n, max_tokens = args.server_requests or (2 if args.tiny else 8), 128
        data["servers"] = rows = run_servers(args, servers, n, max_tokens, info, log)
        lines += [""] + markdown(rows, n, max_tokens)
    report.write_results(args.out, f"{info['device']}-structured", data, lines, log=log)
    return 0


def server_check(args, servers: list[str]) -> None:
    """ValueError naming what keeps the servers from running: baselines need a GGUF model, vLLM its
    environment."""
    from stagewise.model.loader import open_checkpoint

    path = open_checkpoint(args.model).path
    if any(s != "stagewise" for s in servers) and path.suffix != ".gguf":
        raise ValueError(f"bench structured: the baseline servers need a GGUF model, got {str(path)!r}")
    if "vllm" in servers:
        from stagewise.bench import vllm_cpu

        vllm_cpu.find_python(args.vllm_python)


def run_servers(args, servers: list[str], n: int, max_tokens: int, info: dict, log) -> list[dict]:
    """Each server started, measured (:func:`~stagewise.bench.structured.servers.measure_server`)
    and stopped, one after the other."""
    import os

    from stagewise.bench.serve.compare import _free_port, _llama_cpp, _ours, Server
    from stagewise.bench.structured.servers import measure_server
    from stagewise.launch.local import usable_cores
    from stagewise.model.loader import open_checkpoint

    ckpt = open_checkpoint(args.model)
    env, threads = dict(os.environ), args.threads or usable_cores()
    eos = {"logit_bias": {str(t): -100.0 for t in ckpt.config.eos_token_ids}}
    rows = []
    for name in servers:
        if name == "stagewise":
            server, model, free = _ours(args.model, args.threads, env, args.linear_precision, None), args.model, \
                {"ignore_eos": True}
        elif name == "llama.cpp":
            server = _llama_cpp(ckpt.path, threads, env, args.install_baseline, log)
            model, free, info["llama_cpp_python"] = str(ckpt.path), eos, server.version
        else:
            from stagewise.bench import vllm_cpu

            python = vllm_cpu.find_python(args.vllm_python)
            argv, extra_env = vllm_cpu.server_argv(python, vllm_cpu.hf_folder(ckpt.path, log=log), args.model,
                                                   _free_port(), threads)
            argv += ["--structured-outputs-config", '{"backend": "xgrammar"}']
            server = Server("vLLM", argv, "/health", {**env, **extra_env})
            model, free = args.model, {"ignore_eos": True}
            info["vllm"] = vllm_cpu.version(python)
        try:
            row = measure_server(name, server.url, model, n, max_tokens, free)
        finally:
            server.stop()
        row["ready_s"] = round(server.ready_s, 2)
        rows.append(row)
        log(f"  {name}: {row['valid']}/{n} valid, TPOT free {1e3 * (row['tpot_free_s'] or 0):.1f} ms, held "
            f"{1e3 * (row['tpot_held_s'] or 0):.1f} ms, first held TTFT {1e3 * (row['first_held_ttft_s'] or 0):.0f} ms")
    return rows
