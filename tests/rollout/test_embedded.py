"""The embedded engine against independent references: greedy decoding and log-probs from full
no-cache float64 forwards of the same checkpoint, top-k/top-p support, batching invariance, stop
conditions, and weight updates."""

import pytest
import torch

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine, WeightUpdateError
from megatron_klear.rollout.embedded.sampling import sample_seed
from tests.rollout.conftest import PROMPTS, full_logits, greedy_reference


@pytest.fixture(scope="module")
def engine(tiny_hf):
    return EmbeddedEngine.from_pretrained(tiny_hf["untied"])


def test_loads_float32_eval_with_config_eos(engine):
    assert engine.vocab_size == 389  # the model's vocabulary, larger than the tokenizer's
    assert engine.eos_token_ids == [2]
    assert not engine.model.training
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in engine.model.parameters())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1, max_new_tokens=12, seed=0), SamplingParams(temperature=1e-4, max_new_tokens=12, seed=1)],
    ids=["top_k=1", "T=1e-4"],
)
def test_greedy_equals_stepwise_full_forward(engine, ref_untied, params):
    out = engine.generate(PROMPTS, params, n=2)
    for prompt, samples in zip(PROMPTS, out):
        ref_tokens, ref_reason = greedy_reference(ref_untied, prompt, params.max_new_tokens, {2})
        for c in samples:
            assert c.token_ids == ref_tokens
            assert c.finish_reason == ref_reason
            assert len(c.logprobs) == len(c.token_ids)


def test_logprobs_are_full_vocab_log_softmax_before_filtering(engine, ref_untied):
    t = 0.7
    params = SamplingParams(temperature=t, top_p=0.9, top_k=20, max_new_tokens=16, seed=5)
    out = engine.generate(PROMPTS, params, n=3)
    filtered_gap = []
    for prompt, samples in zip(PROMPTS, out):
        for c in samples:
            z = full_logits(ref_untied, prompt, c.token_ids) / t
            tok = torch.tensor(c.token_ids)
            ref = torch.log_softmax(z, -1).gather(1, tok[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-5)
            # the log-prob renormalised over the top-20 support is visibly different: the check
            # above would fail for an engine returning filtered log-probs
            top = z.topk(20, dim=-1).values
            filtered_gap.append((ref - (z.gather(1, tok[:, None]).squeeze(1) - torch.logsumexp(top, -1))).abs().min())
    assert min(filtered_gap) > 1e-2


def test_top_k_restricts_the_support(engine, ref_untied):
    out = engine.generate(PROMPTS, SamplingParams(top_k=2, max_new_tokens=16, seed=2), n=3)
    ranks = []
    for prompt, samples in zip(PROMPTS, out):
        for c in samples:
            z = full_logits(ref_untied, prompt, c.token_ids)
            rank = (z > z.gather(1, torch.tensor(c.token_ids)[:, None])).sum(1)
            ranks += rank.tolist()
    assert set(ranks) == {0, 1}  # always among the two largest logits, and both get drawn


def test_top_p_restricts_the_support(engine, ref_untied):
    top_p = 0.3
    out = engine.generate(PROMPTS, SamplingParams(top_p=top_p, max_new_tokens=16, seed=4), n=3)
    ranks = []
    for prompt, samples in zip(PROMPTS, out):
        for c in samples:
            p = torch.softmax(full_logits(ref_untied, prompt, c.token_ids), -1)
            tok = torch.tensor(c.token_ids)[:, None]
            p_tok = p.gather(1, tok)
            mass_before = (p * (p > p_tok)).sum(1)  # mass of the strictly more probable tokens
            assert bool((mass_before < top_p + 1e-6).all()), mass_before.max()
            ranks += (p > p_tok).sum(1).tolist()
    assert max(ranks) >= 3  # a nucleus of several tokens, not greedy decoding


def test_batch_equals_each_prompt_alone(engine, tiny_hf):
    # frequent stop ids make rows finish at different steps, exercising the row dropping
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=list(range(40, 60)), seed=11)
    batch = engine.generate(PROMPTS, params, n=3)
    lengths = {len(c.token_ids) for samples in batch for c in samples}
    assert len(lengths) >= 3 and {c.finish_reason for s in batch for c in s} == {"stop", "length"}
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate_with_seeds([prompt], params, [[sample_seed(11, i, j) for j in range(3)]])[0]
        for a, b in zip(alone, batch[i]):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # at most 4 rows at a time (rows join as others finish) changes nothing either
    small = EmbeddedEngine(engine.model, max_running_requests=4)
    chunked = small.generate(PROMPTS, params, n=3)
    assert [[c.token_ids for c in s] for s in chunked] == [[c.token_ids for c in s] for s in batch]
    # same seed, same samples; another seed, other samples; samples of one prompt differ
    assert engine.generate(PROMPTS, params, n=3) == batch
    other = engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 12}), n=3)
    assert [[c.token_ids for c in s] for s in other] != [[c.token_ids for c in s] for s in batch]
    assert len({tuple(c.token_ids) for c in batch[0]}) > 1


def test_stop_token_and_max_new_tokens(engine, ref_untied):
    prompt = PROMPTS[0]
    greedy, _ = greedy_reference(ref_untied, prompt, 10, set())
    out = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=10, seed=0, stop_token_ids=[]), n=1)[0][0]
    assert out.token_ids == greedy and out.finish_reason == "length"  # no EOS in the greedy path
    stop_at = 4
    stop_tok = greedy[stop_at]
    first = greedy.index(stop_tok)
    out = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=10, stop_token_ids=[stop_tok]))[0][0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop" and out.finished
    assert len(out.logprobs) == first + 1
    for m in (1, 3):
        out = engine.generate([prompt], SamplingParams(top_k=1, max_new_tokens=m))[0][0]
        assert out.token_ids == greedy[:m] and out.finish_reason == "length"


def test_eos_ids_from_config_and_generation_config(tiny_hf, ref_untied):
    from tests.rollout.conftest import load_reference

    model = load_reference(tiny_hf["untied"]).float()
    greedy, _ = greedy_reference(ref_untied, PROMPTS[1], 8, set())
    a, b = greedy[2], greedy[5]
    model.config.eos_token_id = [b, 2]
    model.generation_config.eos_token_id = a
    eng = EmbeddedEngine(model)
    assert eng.eos_token_ids == sorted({a, b, 2})
    out = eng.generate([PROMPTS[1]], SamplingParams(top_k=1, max_new_tokens=8))[0][0]
    first = min(k for k, t in enumerate(greedy) if t in {a, b, 2})
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"


def test_bad_inputs_are_clear_errors(engine):
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\] = 389"):
        engine.generate([[1, 2], [389]], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="n must be"):
        engine.generate([[1]], SamplingParams(), n=0)


def _tensors(path):
    from megatron_klear.checkpoint.hf_io import HFReader

    reader = HFReader(path)
    return {k: reader.get(k) for k in sorted(reader.keys())}


def test_update_weights_switches_to_the_other_model(tiny_hf, other_hf):
    eng = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    other = EmbeddedEngine.from_pretrained(other_hf)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=10, seed=3)
    before, want = eng.generate(PROMPTS, params, n=2), other.generate(PROMPTS, params, n=2)
    assert before != want
    # bf16 tensors (a generator of them) are converted into the float32 model
    eng.update_weights(((k, v.to(torch.bfloat16)) for k, v in _tensors(other_hf).items()), version=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(dict(eng.model.named_parameters())[name], _tensors(other_hf)[name].to(torch.bfloat16).float())
    eng.update_weights(_tensors(other_hf).items(), version=2)
    assert eng.weight_version == 2
    got = eng.generate(PROMPTS, params, n=2)
    # every token is tagged with the version that sampled it (the other engine never had one)
    assert all(c.versions == [2] * len(c.token_ids) for row in got for c in row)
    assert all(c.versions == [None] * len(c.token_ids) for row in want for c in row)
    assert _untagged(got) == _untagged(want)
    eng.load_weights_from_dir(tiny_hf["untied"], version=3)
    again = eng.generate(PROMPTS, params, n=2)
    assert _untagged(again) == _untagged(before) and eng.weight_version == 3
    assert all(c.versions == [3] * len(c.token_ids) for row in again for c in row)


def _untagged(rows):
    """Completions without their weight versions (to compare samples of differently tagged engines)."""
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in row] for row in rows]


def test_update_weights_errors_name_the_tensor(tiny_hf):
    eng = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    good = _tensors(tiny_hf["untied"])
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(WeightUpdateError, match="unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        eng.update_weights([("model.layers.9.mlp.up_proj.weight", good[name])])
    eng.generate([[1]], SamplingParams(max_new_tokens=1))  # nothing copied yet: still usable
    bad_shape = dict(good, **{name: good[name][:, :-1]})
    with pytest.raises(WeightUpdateError, match=rf"'{name}' has shape \(96, 63\), the model expects \(96, 64\)"):
        eng.update_weights(bad_shape.items())
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(WeightUpdateError, match=r"1 parameter\(s\) not given: model.norm.weight"):
        eng.update_weights(missing.items())
    with pytest.raises(RuntimeError, match="inconsistent after a failed update"):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    with pytest.raises(WeightUpdateError, match="'model.norm.weight' given twice"):
        eng.update_weights(list(good.items()) + [("model.norm.weight", good["model.norm.weight"])])
    eng.update_weights(good.items())  # a complete update makes it usable again
    eng.generate([[1]], SamplingParams(max_new_tokens=1))


def test_update_weights_tied_embeddings(tiny_hf):
    eng = EmbeddedEngine.from_pretrained(tiny_hf["tied"])
    good = _tensors(tiny_hf["tied"])
    assert "lm_head.weight" not in good
    embed = good["model.embed_tokens.weight"]
    eng.update_weights({**good, "model.embed_tokens.weight": embed * 2}.items())
    assert torch.equal(eng.model.get_output_embeddings().weight, embed * 2)  # the tie holds
    eng.update_weights({**good, "lm_head.weight": embed}.items())
    with pytest.raises(WeightUpdateError, match="'lm_head.weight' differs"):
        eng.update_weights({**good, "lm_head.weight": embed + 1}.items())


def test_from_config_then_update_weights(tiny_hf, ref_untied):
    import json
    import os

    with open(os.path.join(tiny_hf["untied"], "config.json")) as f:
        cfg = json.load(f)
    eng = EmbeddedEngine.from_config(cfg, seed=0)
    assert not eng.model.training
    eng.update_weights(_tensors(tiny_hf["untied"]).items())
    ref_tokens, _ = greedy_reference(ref_untied, PROMPTS[2], 6, {2})
    assert eng.generate([PROMPTS[2]], SamplingParams(top_k=1, max_new_tokens=6))[0][0].token_ids == ref_tokens


def test_bfloat16_engine_logprobs_near_the_float64_reference(tiny_hf, ref_untied):
    eng = EmbeddedEngine.from_pretrained(tiny_hf["untied"], dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    out = eng.generate(PROMPTS[:2], SamplingParams(temperature=0.8, max_new_tokens=12, seed=1), n=2)
    for prompt, samples in zip(PROMPTS, out):
        for c in samples:
            z = full_logits(ref_untied, prompt, c.token_ids) / 0.8
            ref = torch.log_softmax(z, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            # bf16 weights: about 0.03 off here; a log-prob of the wrong position is off by > 1
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, rtol=0, atol=0.15)


def test_eos_ids_include_the_tokenizers_as_sglang(tiny_hf, tmp_path):
    from megatron_klear.models.tiny import ENDOFTEXT_ID, IM_END_ID, build_tokenizer
    from megatron_klear.rollout.embedded import eos_token_ids_of, load_tokenizer

    engine = EmbeddedEngine.from_pretrained(tiny_hf["untied"])
    assert engine.eos_token_ids == [IM_END_ID]  # instruct: config, generation config and tokenizer agree
    base_tok = build_tokenizer(str(tmp_path / "tok"), flavor="base")
    assert eos_token_ids_of(engine.model, base_tok) == sorted([ENDOFTEXT_ID, IM_END_ID])
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer files there


def test_generate_requests_mixes_parameters_and_reports_each_prompt(engine):
    from megatron_klear.rollout.embedded import PromptRequest

    reqs = [
        PromptRequest(PROMPTS[0], SamplingParams(temperature=0.7, top_k=20, max_new_tokens=6), [11, 12]),
        PromptRequest(PROMPTS[1], SamplingParams(top_p=0.8, max_new_tokens=9, stop_token_ids=[7]), [13]),
        PromptRequest(PROMPTS[2], SamplingParams(top_k=1), [14], max_new_tokens=0),
        PromptRequest(PROMPTS[2], SamplingParams(top_k=1, max_new_tokens=4), [15], ignore_eos=True),
    ]
    seen = []
    out = engine.generate_requests(reqs, on_prompt_done=lambda i, cs: seen.append(i))
    assert sorted(seen) == [0, 1, 2, 3] and seen[0] == 2  # the empty one first, then as each finishes
    assert out[2][0].token_ids == [] and out[2][0].finish_reason == "length"
    assert len(out[3][0].token_ids) == 4 and out[3][0].finish_reason == "length"
    for i, r in enumerate(reqs):  # each as if alone
        if r.max_new_tokens == 0 or r.ignore_eos:
            continue
        alone = engine.generate_with_seeds([r.prompt], r.params, [r.seeds])[0]
        assert [c.token_ids for c in alone] == [c.token_ids for c in out[i]]
        assert [c.finish_reason for c in alone] == [c.finish_reason for c in out[i]]


def test_update_weights_of_a_moe_model_by_per_expert_names(tmp_path):
    """transformers fuses a MoE layer's experts into [E, 2I, H] / [E, H, I] parameters; weights
    arrive (checkpoints, SGLang's protocol, the trainer's sync) one tensor per expert."""
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    a = make_tiny_qwen3_moe(str(tmp_path / "a"), seed=1, num_layers=3, mlp_only_layers=(1,))
    b = make_tiny_qwen3_moe(str(tmp_path / "b"), seed=2, num_layers=3, mlp_only_layers=(1,))
    eng, other = EmbeddedEngine.from_pretrained(a), EmbeddedEngine.from_pretrained(b)
    want = other.weights.checksums()
    assert eng.weights.checksums() != want
    tensors = _tensors(b)
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in tensors
    fused = dict(eng.model.named_parameters())["model.layers.2.mlp.experts.gate_up_proj"]
    eng.update_weights(tensors.items(), version=1)
    assert eng.weights.checksums() == want  # every expert's slice in place, as transformers' own loader puts it
    assert torch.equal(fused[7, 40:], tensors["model.layers.2.mlp.experts.7.up_proj.weight"])
    params = SamplingParams(top_k=1, max_new_tokens=6)
    assert _untagged(eng.generate(PROMPTS, params)) == _untagged(other.generate(PROMPTS, params))
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.3.down_proj.weight"}
    with pytest.raises(WeightUpdateError, match=r"1 parameter\(s\) not given: model.layers.0.mlp.experts.3.down_proj"):
        eng.update_weights(missing.items())
    eng.load_weights_from_dir(a)
    assert eng.weights.checksums() == EmbeddedEngine.from_pretrained(a).weights.checksums()
    # a partial update by name (the HTTP server's session commit, adopting what it received)
    gate = tensors["model.layers.0.mlp.experts.5.gate_proj.weight"].clone()
    eng.weights.load_named_weights({"model.layers.0.mlp.experts.5.gate_proj.weight": gate}, adopt=True)
    layer0 = dict(eng.model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(layer0[5, :40], gate)
    assert torch.equal(
        layer0[4],
        dict(EmbeddedEngine.from_pretrained(a).model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"][4],
    )


def test_moe_engine_records_the_experts_of_every_token_it_fed(tmp_path):
    """rollout.router_replay: with record_routing, each completion carries the experts every token
    fed to the model was routed to (prompt + response but the last token), as a teacher-forced
    transformers forward of the whole sequence routes them -- across left-padded batched prefill,
    several samples per prompt and rows leaving the batch as they finish."""
    from megatron_klear.models.tiny import make_tiny_qwen3_moe

    model_dir = make_tiny_qwen3_moe(str(tmp_path / "m"), seed=3, num_layers=3, mlp_only_layers=(1,))
    eng = EmbeddedEngine.from_pretrained(model_dir)
    prompts = [[5, 17, 33], [7, 8, 9, 10, 11, 12, 13], [100]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1, stop_token_ids=list(range(0, 389, 4)))
    assert all(c.routed_experts is None for cs in eng.generate(prompts, params, n=2) for c in cs)
    eng.record_routing = True
    outs = eng.generate(prompts, params, n=2)
    lengths = {len(c.token_ids) for cs in outs for c in cs}
    assert len(lengths) > 1  # rows finished at different steps
    for prompt, completions in zip(prompts, outs):
        for c in completions:
            seq = prompt + c.token_ids[:-1]
            with torch.no_grad():
                out = eng.model(input_ids=torch.tensor([seq]), output_router_logits=True)
            want = torch.stack([logits.topk(2, dim=-1).indices for logits in out.router_logits], dim=1)
            assert c.routed_experts.shape == (len(seq), 2, 2) and c.routed_experts.dtype == torch.int16
            assert torch.equal(c.routed_experts.long().sort(-1).values, want.sort(-1).values)
