"""The SGLang-API client with several servers: prompts split across URLs come back in order and
equal what one in-process engine produces; weights loaded from disk reach every server; a bad
response is an error naming what is missing."""
import pytest

from megatron_klear.rollout.base import SamplingParams
from megatron_klear.rollout.embedded import EmbeddedEngine
from megatron_klear.rollout.embedded_http import EmbeddedHTTPEngine
from megatron_klear.rollout.sglang import EngineError, SGLangEngine, parse_completion
from tests.rollout.conftest import PROMPTS


def test_two_servers_split_prompts_and_reload_weights(tiny_hf, other_hf):
    greedy = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8)
    servers = [EmbeddedHTTPEngine.launch(tiny_hf["untied"], startup_timeout=120) for _ in range(2)]
    try:
        client = SGLangEngine([s.url for s in servers], check=True)
        prompts = PROMPTS * 2  # more prompts than servers, uneven chunks
        got = client.generate(prompts, greedy, n=2)
        want = EmbeddedEngine.from_pretrained(tiny_hf["untied"]).generate(prompts, greedy, n=2)
        assert [[c.token_ids for c in row] for row in got] == [[c.token_ids for c in row] for row in want]
        for row_got, row_want in zip(got, want):
            for a, b in zip(row_got, row_want):
                assert a.finish_reason == b.finish_reason
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        client.load_from_disk(other_hf)  # every server now runs the other model
        other = EmbeddedEngine.from_pretrained(other_hf).generate(prompts, greedy, n=1)
        assert [[c.token_ids for c in row] for row in client.generate(prompts, greedy)] == [[c.token_ids for c in row] for row in other]
    finally:
        for s in servers:
            s.close()


def test_malformed_responses_are_named():
    with pytest.raises(EngineError, match="return_logprob"):
        parse_completion({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(EngineError, match="do not match output_ids"):
        parse_completion({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                                              "output_token_logprobs": [[-0.1, 1, None], [-0.2, 3, None]]}})
    with pytest.raises(EngineError, match="abort"):
        parse_completion({"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort"},
                                                           "output_token_logprobs": [[-0.1, 1, None]]}})
    c = parse_completion({"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                              "output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]]}})
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 2], [-0.5, -0.25], "stop")


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(EngineError, match="127.0.0.1:9/health does not answer"):
        SGLangEngine(["http://127.0.0.1:9"], timeout=2, check=True)
