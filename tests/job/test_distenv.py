import pytest

from hpc_ddp.common.errors import EnvError
from hpc_ddp.job.distenv import PORT_BASE, PORT_SPAN, from_environ, port_for_job

SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NODELIST": "gpu[001-002],gpu[010-011]", "SLURM_JOB_NODELIST": "gpu[001-002,010-011]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_RESTART_COUNT": "2",
}


def test_slurm_step():
    d = from_environ(SLURM_STEP)
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size) == (5, 1, 8, 2)
    assert (d.node_rank, d.num_nodes, d.source) == (1, 4, "slurm")
    assert d.hosts == ("gpu001", "gpu002", "gpu010", "gpu011")
    assert d.master_addr == "gpu001"
    assert d.master_port == port_for_job("4242")
    assert (d.job_id, d.restart_count) == ("4242", 2)


def test_slurm_uneven_tasks_per_node():
    env = {**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "3,1(x2),3", "SLURM_NODEID": "3", "SLURM_LOCALID": "2",
           "SLURM_PROCID": "7"}
    d = from_environ(env)
    assert (d.local_world_size, d.node_rank) == (3, 3)


def test_slurm_falls_back_to_job_nodelist_and_ntasks():
    env = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS",
                                                            "SLURM_STEP_NUM_NODES")}
    d = from_environ(env)
    assert d.hosts == ("gpu001", "gpu002", "gpu010", "gpu011") and d.world_size == 8 and d.num_nodes == 4


def test_master_addr_and_port_can_be_overridden():
    d = from_environ({**SLURM_STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29999"})
    assert (d.master_addr, d.master_port) == ("10.0.0.1", 29999)


def test_batch_shell_of_multi_task_job_says_use_srun():
    env = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(EnvError, match="srun"):
        from_environ(env)


def test_batch_shell_of_single_task_job_is_a_single_process():
    d = from_environ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n5"})
    assert (d.source, d.world_size, d.job_id, d.hosts) == ("single", 1, "77", ("n5",))


def test_torchrun_variables_win():
    env = {**SLURM_STEP, "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
           "GROUP_RANK": "0", "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    d = from_environ(env)
    assert (d.source, d.rank, d.world_size, d.num_nodes, d.node_rank) == ("torchrun", 3, 16, 2, 0)
    assert (d.master_addr, d.master_port, d.job_id) == ("head", 29500, "4242")


def test_torchrun_without_slurm():
    d = from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": "1234"})
    assert (d.local_world_size, d.num_nodes, d.hosts) == (2, 1, ("127.0.0.1",))


def test_submitit_local():
    env = {"SUBMITIT_LOCAL_JOB_ID": "999", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}
    d = from_environ(env)
    assert (d.source, d.rank, d.world_size, d.local_world_size, d.job_id) == ("submitit", 1, 2, 2, "999")


def test_single_process():
    d = from_environ({}, pid=123)
    assert (d.source, d.rank, d.world_size, d.master_addr) == ("single", 0, 1, "127.0.0.1")
    assert d.to_json()["hosts"] == ["127.0.0.1"]


def test_to_json_has_exactly_the_documented_keys():
    assert set(from_environ(SLURM_STEP).to_json()) == {
        "rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes", "master_addr",
        "master_port", "hosts", "job_id", "restart_count", "source"}


@pytest.mark.parametrize("change,message", [
    ({"SLURM_PROCID": "8"}, "outside world size"),
    ({"SLURM_PROCID": "x"}, "not an integer"),
    ({"SLURM_NODEID": "9"}, "SLURM_NODEID=9"),
    ({"SLURM_STEP_NODELIST": "n[1-2"}, "invalid hostlist"),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "tasks per node"),
    ({"MASTER_PORT": "70000"}, "not a valid port"),
])
def test_inconsistent_environments_are_named(change, message):
    with pytest.raises(EnvError, match=message):
        from_environ({**SLURM_STEP, **change})


def test_port_is_deterministic_and_below_the_ephemeral_range():
    ports = {port_for_job(str(i)) for i in range(100000, 100000 + PORT_SPAN)}
    assert len(ports) == PORT_SPAN  # consecutive job ids never share a port
    assert min(ports) == PORT_BASE and max(ports) < 32768
    assert port_for_job("local-1-2") == port_for_job("local-1-2")
    assert PORT_BASE <= port_for_job("local-1-2") < 32768
