"""``stagewise bench e2e``: whole-model generation, timed end to end. One mode per run:

- default (:mod:`~stagewise.bench.e2e.compare`): stagewise.Pipeline in this process against its
  baselines (:mod:`~stagewise.bench.e2e.baselines`: transformers, llama.cpp) at each batch size,
  with ``--startup`` fresh processes to their first token (:mod:`~stagewise.bench.e2e.startup`);
- ``--stages 1,2,3`` (:mod:`~stagewise.bench.e2e.stages`): the pipeline's stage processes by count;
- ``--tp 1,3 [--dcp ...]`` (:mod:`~stagewise.bench.e2e.parallel`): one stage over tensor-parallel ranks;
- ``--launcher ray`` (:mod:`~stagewise.bench.e2e.launchers`): the Ray launcher beside the local one;
- ``--recovery`` (:mod:`~stagewise.bench.e2e.recovery`): a stage killed or hung mid-generation;
- ``--speculative ngram`` (:mod:`~stagewise.bench.e2e.speculative`): decode with drafts against
  without, on a rewriting task and an open one, beside llama.cpp's prompt lookup;
- ``--cuda-graphs`` (:mod:`~stagewise.bench.e2e.graphs`): the batch-1 decode step on a GPU, eager
  against replayed from a CUDA graph, beside the memory floor.

Every mode's prompts are :mod:`~stagewise.bench.e2e.prompts`'.
"""

from __future__ import annotations

import argparse
import sys

from stagewise.bench.e2e import random_models
from stagewise.bench.options import add_common
from stagewise.transport.registry import TRANSPORTS

SIZES = {"batch_sizes": ("1,16", "1"), "prompt_len": (128, 8), "new_tokens": (64, 4), "repeats": (3, 1)}
"""The sizes when not given: (full, --tiny)."""
DTYPES = ("float32", "bfloat16", "float16")
"""--dtype's choices: :data:`stagewise.model.loader.stage_weights.DTYPES`' names (without importing torch)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "e2e", device=True)
    parser.add_argument("--model", default="smollm2-135m",
                        help="folder, .gguf file, smollm2-135m, or a random model built once in the temp folder on "
                             "first use: random-qwen3-vl (a Qwen3-VL of hidden 2048, 8 layers, ViT depth 8, float32), "
                             "random-llama3-8b (Llama-3-8B's shape, bfloat16)")
    parser.add_argument("--random-layers", type=int, default=None, metavar="N",
                        help="a random model's decoder layers (default: its own, 32 for random-llama3-8b)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the dtype ours and transformers compute in, weights and activations (default: float32; "
                             "int8 linears run in float32 only)")
    parser.add_argument("--image", default=None, metavar="WxH",
                        help="a vision model: every prompt starts with an image of this size, e.g. 448x448")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 1,16; --tiny: 1)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per row (default: 128; --tiny: 8)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="generated tokens per row (default: 64; --tiny: 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per batch size (default 3; --tiny: 1)")
    parser.add_argument("--linear-precision", default="exact,int8", metavar="exact,int8",
                        help="ours' linear precisions, a row each (default: exact,int8; int8 over GGUF blocks, or Q8_0 "
                             "blocks quantised at load from float32 weights)")
    parser.add_argument("--baseline", default="transformers", metavar="transformers,llama.cpp",
                        help="what ours runs beside, a column group each (default: transformers; llama.cpp: the same "
                             "GGUF through llama-cpp-python, an optional dependency)")
    parser.add_argument("--install-baseline", action="store_true",
                        help="--baseline llama.cpp: pip install llama-cpp-python (a native source build) when it is "
                             "missing")
    parser.add_argument("--startup", action="store_true",
                        help="also time fresh processes to their first token (generate, a 3-stage pipeline and, with "
                             "that baseline, llama.cpp)")
    modes = parser.add_argument_group("modes (instead of ours against the baselines)")
    modes.add_argument("--stages", default=None, metavar="1,2,3",
                       help="run the pipeline with these stage counts (batch 1 and S x 4 requests)")
    modes.add_argument("--launcher", default=None, choices=["ray"],
                       help="a pipeline of --stages S (default 3) started by this launcher and by the local one, side "
                            "by side (start-up, TPOT at batch 1 and 8)")
    modes.add_argument("--recovery", action="store_true",
                       help="a pipeline of --stages S (default 2) whose last stage dies or hangs mid-generation: the "
                            "delay with only that stage started again, beside every stage started again")
    modes.add_argument("--speculative", default=None, metavar="ngram,draft",
                       help="decode with drafts (prompt lookup, a draft model) against without, on a rewriting task "
                            "and an open chat "
                            "task, at each --stages count (default 1); with --baseline llama.cpp beside its "
                            "LlamaPromptLookupDecoding")
    modes.add_argument("--num-speculative-tokens", default="3,5", metavar="3,5",
                       help="--speculative: the draft lengths K to run, a row each (default 3,5)")
    modes.add_argument("--draft-model", default=None, metavar="PATH",
                       help="--speculative draft: the draft model (default: --model itself, its linears in the int8 "
                            "mode)")
    modes.add_argument("--tp", default=None, metavar="1,3",
                       help="one stage split over these tensor-parallel sizes, beside tp=1 (batch 1 and the largest "
                            "batch size)")
    modes.add_argument("--dcp", default=None, metavar="1,3",
                       help="--tp: also these decode-context-parallel sizes (each dividing its tp)")
    modes.add_argument("--heads", default=None, metavar="Q/KV",
                       help="--tp: run the GGUF model regrouped into Q query and KV key-value heads, every other "
                            "tensor as it is (SmolLM2's 9/3 allow tp 3 only; 8/1 allows tp 2 and dcp 2)")
    modes.add_argument("--cuda-graphs", action="store_true",
                       help="--device cuda: the batch-1 decode step eager and replayed from a CUDA graph, checked "
                            "equal, each beside the memory floor (--prompt-len, --new-tokens - 1 steps, --dtype)")
    modes.add_argument("--pipeline-partition", dest="partition", default="balanced",
                       help="--stages: the partition policy (default: balanced)")
    modes.add_argument("--pipeline-transport", dest="transport", default="auto", choices=TRANSPORTS,
                       help="--stages: the transport between stages (default: auto)")


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill in the sizes not given: toy ones with ``--tiny``, the full ones otherwise."""
    for name, (full, tiny) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)


def run(args: argparse.Namespace, log) -> int:
    resolve_sizes(args)
    if args.cuda_graphs:  # it refuses without a GPU before a random model is built
        from stagewise.bench.e2e import graphs

        return graphs.run(args, log=log)
    try:
        args.model = random_models.resolve(args.model, args.random_layers, log)
    except ValueError as err:
        print(f"stagewise bench e2e: {err}", file=sys.stderr)
        return 2
    if args.speculative:
        from stagewise.bench.e2e import speculative as mode
    elif args.tp or args.dcp:
        from stagewise.bench.e2e import parallel as mode
    elif args.recovery:
        from stagewise.bench.e2e import recovery as mode
    elif args.launcher:
        from stagewise.bench.e2e import launchers as mode
    elif args.stages:
        from stagewise.bench.e2e import stages as mode
    else:
        from stagewise.bench.e2e import compare as mode
    return mode.run(args, log=log)
