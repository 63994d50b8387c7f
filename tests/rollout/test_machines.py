"""Which trainer rank shares a machine with which server (rollout/weight_sync/machines.py), and the
in-memory push's choice of disk when a server is on no trainer rank's machine."""

import socket

from megatron_klear.rollout.weight_sync.machines import machine_addresses, place_workers


def test_servers_go_to_the_lowest_rank_of_their_machine_by_address_or_name():
    ranks = [{"10.0.0.1", "node-a"}, {"10.0.0.1", "node-a"}, {"10.0.0.2"}, {"10.0.0.2"}]
    workers = ["http://10.0.0.2:30000", "http://10.0.0.1:30001", "http://10.0.0.2:30001", "http://10.0.0.9:30000"]
    placed, unplaced = place_workers(workers, ranks)
    assert placed == {"http://10.0.0.2:30000": 2, "http://10.0.0.1:30001": 0, "http://10.0.0.2:30001": 2}
    assert unplaced == ["http://10.0.0.9:30000"]
    # a server named by a host name that resolves to one of a rank's addresses
    placed, unplaced = place_workers(["http://localhost:30000"], [{"10.0.0.3"}, {"127.0.0.1"}])
    assert placed == {"http://localhost:30000": 1} and unplaced == []


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
    engine = SimpleNamespace(wire=SimpleNamespace(tensor_refusal=lambda: None), workers=lambda: [far])
    pushed = []
    disk = SimpleNamespace(sync_dir="/runs/x/weights", push=lambda v: pushed.append(v) or {"weights/version": v})
    push = InMemoryPush(SimpleNamespace(model=[]), engine, placement=None, bucket_mb=1, fallback=disk)
    assert push.push(3) == {"weights/version": 3, "weights/in_memory": 0}
    assert push.push(4)["weights/in_memory"] == 0 and pushed == [3, 4]
    err = capsys.readouterr().err
    assert err.count(f"{far} on no trainer rank's machine") == 1, err  # said once
    assert "the weights go through disk (/runs/x/weights)" in err
