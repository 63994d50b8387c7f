"""training/offload.py HostStash: the colocated trainer's optimizer state to host buffers kept for
the run and back. Its logic on the CPU with the device fact injected (every tensor counted as on a
device; pinning off); the GPU path itself: tests/gpu (the offloaded update equals the plain one)."""

from types import SimpleNamespace

import torch

from megatron_klear.training.offload import HostStash


def _adam(seed: int):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    adam = torch.optim.Adam(params, lr=0.1)
    return params, adam


def _step(params, adam, seed: int) -> None:
    torch.manual_seed(seed)
    loss = sum((p * torch.randn_like(p)).sum() for p in params)
    adam.zero_grad()
    loss.backward()
    adam.step()


def test_every_optimizer_tensor_leaves_and_comes_back_through_buffers_kept_for_the_run():
    params, adam = _adam(0)
    twin_params, twin = _adam(0)
    _step(params, adam, 1)
    _step(twin_params, twin, 1)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])  # Megatron's shape
    stash = HostStash(pin=False, on_device=lambda t: True)  # the CPU stands for the device
    tensors = [p.data for p in params] + [v for p in params for v in adam.state[p].values() if torch.is_tensor(v)]
    moved = stash.offload(chained)
    assert moved == sum(t.numel() * t.element_size() for t in tensors)
    # every slot (the parameters' data, Adam's step and moments) now holds its stash buffer
    held = {id(h) for h in stash.host.values()}
    assert all(id(p.data) in held or p.data.data_ptr() in {h.data_ptr() for h in stash.host.values()} for p in params)
    assert all(
        v.data_ptr() in {h.data_ptr() for h in stash.host.values()} for p in params for v in adam.state[p].values()
    )
    buffers = {k: h.data_ptr() for k, h in stash.host.items()}
    stash.restore(chained)
    # back in new tensors (not the stash's), the stash keeps its buffers for the next offload
    assert not {p.data.data_ptr() for p in params} & set(buffers.values())
    stash.offload(chained)
    assert {k: h.data_ptr() for k, h in stash.host.items()} == buffers and len(stash.moved) == len(buffers)
    stash.restore(chained)
    assert not stash.moved
    # the optimizer goes on exactly as one that never moved
    _step(params, adam, 2)
    _step(twin_params, twin, 2)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        for k, v in adam.state[p].items():
            assert torch.equal(v, twin.state[q][k]), k


def test_tensors_not_on_a_device_stay_where_they_are():
    params, adam = _adam(3)
    _step(params, adam, 4)
    ptrs = [p.data_ptr() for p in params]
    stash = HostStash(pin=False)  # the product's rule: CPU tensors do not move
    assert stash.offload(SimpleNamespace(optimizer=adam)) == 0 and not stash.host
    stash.restore(SimpleNamespace(optimizer=adam))
    assert [p.data_ptr() for p in params] == ptrs


def test_an_optimizer_shard_that_views_a_weight_stays_a_view():
    """fp32 weights with the distributed optimizer: its parameters are views of the weights' shards.
    Moving such a view frees nothing (the weight stays) and would come back as a copy (the weight's
    memory twice, and the optimizer no longer stepping on the weight itself): it stays where it is;
    Adam's moments still move."""
    weight = torch.nn.Parameter(torch.randn(12))
    shard = torch.nn.Parameter(weight.data.view(-1)[4:10])  # as distrib_optimizer builds an fp32 shard
    adam = torch.optim.Adam([shard], lr=0.1)
    shard.grad = torch.ones_like(shard)
    adam.step()
    stash = HostStash(pin=False, on_device=lambda t: True)
    keep = {weight.untyped_storage().data_ptr()}
    moved = stash.offload(SimpleNamespace(optimizer=adam), keep=keep)
    assert moved == sum(v.numel() * v.element_size() for v in adam.state[shard].values())  # the moments only
    stash.restore(SimpleNamespace(optimizer=adam))
    shard.grad = torch.ones_like(shard)
    before = weight.detach().clone()
    adam.step()
    assert shard.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert not torch.equal(weight[4:10], before[4:10]) and torch.equal(weight[:4], before[:4])  # stepped in place
