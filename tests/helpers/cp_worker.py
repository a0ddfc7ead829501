"""One rank of the context-parallel test world: ``python cp_worker.py '<json>'`` with ``rank``,
``world``, ``store`` ([host, port]), ``out_dir``, ``cases`` ({name: case}, see cp_scenario.py).

For each case the world is cut into replicas of ``pcp * tp`` ranks (one stage each, laid out by
:class:`StageRanks`); replica ``i`` uses the case's ``interleave[i]``. Every rank writes each step's
output and its KV usage to ``<out_dir>/rank<r>.safetensors`` (no pickle between processes).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from safetensors.torch import save_file

import cp_scenario  # beside this script
from stagewise.model.collectives import StageGroups
from stagewise.parallel import comm
from stagewise.parallel.ranks import StageRanks

TIMEOUT_S = 30.0


def _groups(case: dict, rank: int, world: int) -> tuple[StageGroups, int, int]:
    """This rank's groups for ``case``, its replica and its TP rank. Every rank creates every
    group of every replica, in the same order (torch.distributed's rule)."""
    size = case["tp"] * case["pcp"]
    mine = {}
    for replica in range(world // size):
        stage = StageRanks(tp=case["tp"], pcp=case["pcp"], dcp=case["dcp"], first=replica * size)
        for kind in ("tp", "dcp", "pcp"):
            for members in stage.groups(kind):
                group = comm.Group.new(list(members))
                if rank in members:
                    mine[kind] = group
    coords = StageRanks(tp=case["tp"], pcp=case["pcp"], dcp=case["dcp"]).coordinates(rank % size)
    return StageGroups(**mine), rank // size, coords["tp"]


def main(args: dict) -> None:
    rank, world = args["rank"], args["world"]
    comm.init_world(rank=rank, world_size=world, store=tuple(args["store"]), timeout_s=TIMEOUT_S)
    torch.set_num_threads(1)
    tensors = {}
    if args.get("fail_rank") == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    for name, case in args["cases"].items():
        groups, replica, tp_rank = _groups(case, rank, world)
        layers = cp_scenario.build_layers(case, tp_rank, case["tp"], groups)
        outputs, usage, kv = cp_scenario.run(case, layers, groups, case["interleave"][replica])
        for step, out in enumerate(outputs):
            tensors[f"{name}/{step}"] = out.contiguous()
        tensors[f"{name}/usage"] = torch.tensor(usage, dtype=torch.int64)
        tensors.update({f"{name}/kv/{key}": t for key, t in kv.items()})
        tensors[f"{name}/cp_rank"] = torch.tensor(groups.cp_rank)
    comm.destroy_world()
    save_file(tensors, f"{args['out_dir']}/rank{rank}.safetensors")


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except BaseException:
        # Exit at once: tearing the process group down would wait on ranks still in a collective.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
