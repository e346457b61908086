"""Hardening round 4 (issue 43), rerun of an attempt of a node range's job: the attempt is replayed on the
ranks it ran on (its node list), not the range's fewest; a checkpoint saved on another size is what a node
range's resume takes; the refusal's hint names the ranks it asks for; and the rerun is one fixed size."""

from __future__ import annotations

import dataclasses

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.debug import rerun as rr
from hpc_ddp.spec.jobspec import Layer, Target, build_spec


def spec(**values):
    return build_spec([Layer("t", values)], target=Target("script", "/w/train.py"), workdir="/w", python="/py")


def record(nodes):
    return rr.AttemptRecord(job_id="9", number=1, cause="failed", exit_code=1, start_step=8, resumed_from=None,
                            nodes=nodes)


@pytest.mark.parametrize(("nodes", "count"), [("hpcn[1-4]", 4), ("hpcn[3-4]", 2), ("hpcn1", 1), (None, None),
                                               ("hpcn[1-9]", None), ("bad[", None)])
def test_the_attempt_ran_on_its_node_lists_count(nodes, count):
    assert rr.attempt_nodes(spec(nodes="1-4"), record(nodes)) == count


def test_a_resized_attempt_is_replayed_on_the_ranks_it_ran_on():
    sizes = rr.plan_sizes(spec(nodes="1-4"), 4, "step-000000008", nodes=None, tasks_per_node=None, cpus=2,
                          gpus_here=0, ran_nodes=4)
    assert (sizes.nodes, sizes.tasks_per_node) == (4, 1)
    assert sizes.notes[0].startswith("world size: 4 rank(s), as the attempt (4 simulated node(s) x 1)")


def test_an_attempt_that_resumed_on_another_size_is_replayed_on_its_own():
    sizes = rr.plan_sizes(spec(nodes="1-4"), 4, "step-000000008", nodes=None, tasks_per_node=None, cpus=2,
                          gpus_here=0, ran_nodes=2)
    assert (sizes.nodes, sizes.tasks_per_node) == (2, 1)
    assert "the job's node range resumes on another size" in sizes.notes[0]


def test_a_fixed_jobs_refusal_names_the_ranks_it_keeps():
    with pytest.raises(UserError) as err:
        rr.plan_sizes(spec(nodes=1, tasks_per_node=2), 4, "step-000000008", nodes=None, tasks_per_node=None, cpus=8,
                      gpus_here=0)
    assert "2 = 2 rank(s)" in str(err.value) and "keep 4 ranks (--nodes 2 --tasks-per-node 2)" in str(err.value)
    with pytest.raises(UserError, match=r"keep 3 ranks \(--nodes 1 --tasks-per-node 3\)"):
        rr.plan_sizes(spec(nodes=1, tasks_per_node=2), 3, "step-000000008", nodes=None, tasks_per_node=None,
                      cpus=8, gpus_here=0)


def test_the_rerun_is_one_size_not_a_range():
    sizes = rr.Sizes(4, 1, 0, ())
    new = rr.rerun_spec(spec(nodes="1-4"), sizes, "/r")
    assert (new.nodes, new.nodes_max, new.most_nodes) == (4, None, 4)
    assert dataclasses.replace(new).world_size == 4


@pytest.mark.parametrize(("key", "value"), [("nodes", "2"), ("tasks_per_node", 2.0), ("gpus", True),
                                            ("python", 5), ("nodes_max", "4"), ("snapshot", "yes")])
def test_a_spec_json_of_the_wrong_types_is_one_line_not_22_ranks(tmp_path, key, value):
    import json

    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.spec.jobspec import load_spec

    data = {**spec(nodes=2, tasks_per_node=2).to_dict(), key: value}
    (tmp_path / "spec.json").write_text(json.dumps(data))
    with pytest.raises(HpcDdpError) as err:
        load_spec(tmp_path / "spec.json")
    assert f"{key} is {value!r}, not of the type hpc-ddp writes" in str(err.value) and "\n" not in str(err.value)
