"""``stagewise bench serve``: ``stagewise serve`` (with its prefix cache and without) against
llama.cpp's OpenAI server (and vLLM's CPU server) on the same GGUF and cores, each under the same
Poisson load of a workload's requests (:mod:`~stagewise.bench.serve.workloads`: ShareGPT-like, a shared system prompt,
multi-turn chats, questions about documents) at each rate, compared at equal p99 TPOT
(:mod:`~stagewise.bench.serve.compare`)."""

from __future__ import annotations

import argparse

from stagewise.bench.options import add_common
from stagewise.bench.serve.workloads import WORKLOADS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "serve")
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file or smollm2-135m (default)")
    parser.add_argument("--linear-precision", default="exact,int8", metavar="exact,int8",
                        help="ours' linear precisions, a row group each with the TPOT target (default: exact,int8)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="auto,int8",
                        help="ours' KV cache: auto (the activations' dtype), int8, fp8_e4m3 (serve "
                             "--kv-cache-dtype); several: the TPOT target's row groups once each (default auto)")
    parser.add_argument("--stages", default=None, metavar="S",
                        help="ours as a pipeline of S stage processes (default 1)")
    parser.add_argument("--rates", default=None, metavar="0.5,1,2,4",
                        help="offered loads, requests per second (default 0.5,1,2,4)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="requests per rate (a conversation's every turn counted; default 40; --tiny: 4)")
    parser.add_argument("--workload", default="sharegpt", choices=WORKLOADS,
                        help="sharegpt (default: independent requests of log-normal lengths), system-prompt (a "
                             "1,024-token system prompt before short questions), multi-turn (chats of 4 turns that "
                             "resend the conversation), documents (8 questions about each 2,000-token document)")
    parser.add_argument("--prefix-cache", default="on,off", metavar="on,off",
                        help="ours with its prefix cache (on) and, as it starts without any TPOT target, without "
                             "it (off; serve --no-prefix-cache); default on,off")
    parser.add_argument("--server-baseline", dest="baseline_server", default="llama.cpp", metavar="llama.cpp,vllm",
                        help="the servers run beside stagewise serve: llama.cpp (default: llama-cpp-python's "
                             "llama_cpp.server, an optional dependency), vllm (vLLM's CPU backend, in its own "
                             "environment: --vllm-python), both, or none")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="the python of the environment vLLM's CPU build is installed in (default: "
                             "$STAGEWISE_VLLM_PYTHON)")
    parser.add_argument("--install-baseline", action="store_true",
                        help="pip install llama-cpp-python (a native source build) when it is missing")
    parser.add_argument("--tpot-target", default="auto", metavar="auto|none|MS",
                        help="ours also runs with this TPOT target, each --linear-precision (default auto: 0.8 of "
                             "llama.cpp's measured p99 TPOT; none: only ours as it starts by default)")


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench.serve import compare

    return compare.run(args, log)
