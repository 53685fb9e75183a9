"""Pipeline-parallel jobs (2 stages x replicas, torchrun, gloo, CPU) save, restore and reshard exactly.

The trainer is tests/pp_trainer.py: ``torch.distributed.pipelining`` (``PipelineStage`` with static shapes +
``ScheduleGPipe``, 2 microbatches) on a 2-D mesh ``("pp", "dp")``, gradients averaged within each stage's
replicas. Each stage keeps the model's own names, so its tensors are found by name at another world size.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.e2e


def test_values_of_a_resharded_restore_come_from_a_rank_of_the_same_stage():
    """The bug this pins down: at a new world size a rank took its JSON values from the same rank's shard (or
    rank 0's), which in a pipeline-parallel job is another stage's: stage 1's new rank 1 got stage 0's step
    counter and optimizer parameter groups from saved rank 1."""
    from ckpt._load import values_rank

    def chunk(name: str) -> object:
        from tiers.manifest import TensorChunk

        return TensorChunk(name, "float32", (4,), (0,), (4,), 0, 16)

    def plan(names_by_rank: list[list[str]]):
        return types.SimpleNamespace(manifest=types.SimpleNamespace(world=len(names_by_rank)),
                                     entries=lambda r: tuple(chunk(n) for n in names_by_rank[r]))

    stage0, stage1 = ["inp.weight", "layers.0.fc.weight"], ["layers.3.fc.weight", "head.weight"]
    saved_2x2 = plan([stage0, stage0, stage1, stage1])
    assert [values_rank(saved_2x2, r, names) for r, names in enumerate([stage0, stage1])] == [0, 2]
    saved_2x1 = plan([stage0, stage1])
    assert [values_rank(saved_2x1, r, names) for r, names in enumerate([stage0, stage0, stage1, stage1])] == \
        [0, 0, 1, 1]
    # data parallel / FSDP: every shard holds every name, so the same rank's values, or rank 0's
    fsdp = plan([stage0 + stage1] * 2)
    assert [values_rank(fsdp, r, stage0 + stage1) for r in range(4)] == [0, 1, 0, 0]
    assert values_rank(fsdp, 1, []) == 1
