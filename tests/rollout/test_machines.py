"""Which trainer rank holds the copy each server rank maps (rollout/weight_sync/machines.py), and the
in-memory push's choice of disk when a server rank is on no trainer rank's GPU."""

import socket

from megatron_klear.rollout.weight_sync.machines import machine_addresses, place_server_ranks


def test_each_server_rank_maps_the_copy_of_the_trainer_rank_on_its_machine_and_gpu():
    # two nodes of two GPUs, a trainer rank per GPU (node-b's ranks report node-b's two GPUs)
    ranks = [({"10.0.0.1", "node-a"}, 0), ({"10.0.0.1", "node-a"}, 1), ({"10.0.0.2"}, 0), ({"10.0.0.2"}, 1)]
    gpus = {
        "http://10.0.0.2:30000": [1],  # a TP=1 server on node-b's GPU 1
        "http://node-a:30000": [0, 1],  # a TP=2 server over node-a's two GPUs
        "http://10.0.0.2:30001": [0],
    }
    placed, refusals = place_server_ranks(gpus, ranks)
    assert refusals == []
    assert placed == {"http://10.0.0.2:30000": [3], "http://node-a:30000": [0, 1], "http://10.0.0.2:30001": [2]}
    # a host name that resolves to one of a rank's addresses; DP replicas on one GPU: the lowest rank
    placed, _ = place_server_ranks(
        {"http://localhost:30000": [0]}, [({"10.0.0.3"}, 0), ({"127.0.0.1"}, 0), ({"127.0.0.1"}, 0)]
    )
    assert placed == {"http://localhost:30000": [1]}


def test_a_server_rank_without_a_trainer_rank_on_its_gpu_or_two_on_one_gpu_are_refused_by_name():
    ranks = [({"10.0.0.1"}, 0), ({"10.0.0.1"}, 1)]
    placed, refusals = place_server_ranks({"http://10.0.0.1:30000": [2], "http://10.0.0.9:30000": [0]}, ranks)
    assert placed == {}
    assert refusals == [
        "http://10.0.0.1:30000: its rank 0 runs on GPU 2, where no trainer rank of its machine runs",
        "http://10.0.0.9:30000 is on no trainer rank's machine "
        "(handles to memory reach servers of the same machine only)",
    ]
    # the launch of one server per GPU with CUDA_VISIBLE_DEVICES=$GPU: every server reports GPU 0
    placed, refusals = place_server_ranks({"http://10.0.0.1:30000": [0], "http://10.0.0.1:30001": [0]}, ranks)
    assert len(refusals) == 1 and "both report GPU 0 of one machine" in refusals[0], refusals
    assert "--base-gpu-id" in refusals[0] and "http://10.0.0.1:30001" not in placed


def test_this_machine_is_known_by_its_names_and_its_interfaces_addresses():
    addresses = machine_addresses()
    assert {"127.0.0.1", "localhost", socket.gethostname()} <= addresses
    # an interface address the host name need not resolve to: the loopback interface's, read by ioctl
    from megatron_klear.rollout.weight_sync.machines import _interface_ipv4s

    assert "127.0.0.1" in _interface_ipv4s()


def test_a_server_on_no_trainer_ranks_machine_sends_the_push_through_disk_naming_it(capsys):
    from types import SimpleNamespace

    from megatron_klear.rollout.weight_sync.in_memory import InMemoryPush

    far = "http://192.0.2.7:30000"  # TEST-NET-1: nobody's address
    wire = SimpleNamespace(tensor_refusal=lambda: None, tensor_gpus=lambda: {far: [0]})
    engine = SimpleNamespace(wire=wire, workers=lambda: [far])
    pushed = []
    disk = SimpleNamespace(sync_dir="/runs/x/weights", push=lambda v: pushed.append(v) or {"weights/version": v})
    push = InMemoryPush(SimpleNamespace(model=[]), engine, placement=None, bucket_mb=1, fallback=disk)
    assert push.push(3) == {"weights/version": 3, "weights/in_memory": 0}
    assert push.push(4)["weights/in_memory"] == 0 and pushed == [3, 4]
    err = capsys.readouterr().err
    assert err.count(f"{far} is on no trainer rank's machine") == 1, err  # said once
    assert "the weights go through disk (/runs/x/weights)" in err
