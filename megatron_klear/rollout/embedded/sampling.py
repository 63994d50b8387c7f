"""Token sampling for the embedded rollout engine: temperature, top-k, top-p, per-sample seeds.

What is sampled, and what log-prob is returned
----------------------------------------------
At each step, for each sequence, with ``z`` the model's logits over its FULL vocabulary (the model's
``vocab_size``, which may exceed the tokenizer's, e.g. Qwen3's 151936 > 151669):

0. a repetition penalty ``r != 1`` (:func:`apply_repetition_penalty`), as SGLang 0.5.23 applies it:
   on the tokens this sample has generated so far (not the prompt's), ``z < 0`` times ``r``,
   otherwise divided by ``r``, before the temperature (``srt/sampling/penaltylib/
   repetition_penalty.py``; ``model_runner._preprocess_logits`` ahead of the sampler's division).
1. ``p = softmax(z / temperature)`` (float32, computed as ``exp(log_softmax)``).
2. top-k (``top_k >= 1``): only the ``top_k`` most probable tokens stay candidates.
3. top-p (``top_p < 1``): walking the tokens from most to least probable, a token stays a candidate
   while the probability mass of the tokens strictly before it is ``< top_p`` -- the smallest set
   whose mass reaches ``top_p`` (the most probable token always stays). The mass is measured on the
   full distribution ``p``, not renormalised after top-k (SGLang's joint top-k/top-p rule).
4. The token is drawn from ``p`` restricted to the candidates (renormalised), by inverse CDF with
   one uniform number per sequence and step (see :class:`SampleStream`).

The log-prob returned for the sampled token is ``log_softmax(z / temperature)[token]`` over the
full vocabulary, i.e. BEFORE the top-k/top-p filtering -- the quantity
:mod:`megatron_klear.training.logprobs` recomputes in the trainer (``logits / T``, no filtering),
so that rollout and trainer log-probs agree up to numerics. It is therefore not the log of the
probability with which the token was actually drawn when top-k/top-p cut the support.

Seeds
-----
Sample ``j`` of prompt ``i`` of a call with base seed ``s`` draws its uniforms from its own
``torch.Generator`` seeded with :func:`sample_seed` ``(s, i, j)``. Its tokens therefore depend only on
its prompt, the sampling parameters, the weights and that seed -- not on the other sequences of
the batch, the batch size or the padding (up to float rounding in the model's forward).

Who picks ``s``, ``i`` and ``j``:

- :meth:`EmbeddedEngine.generate` (in process): ``s = params.seed`` (random when None), ``i`` the
  prompt's index in the call, ``j`` the sample's (:func:`request_seeds`).
- the stand-in server (:mod:`megatron_klear.rollout.sglang_standin`), per ``/generate`` request:
  ``s`` = that prompt's ``sampling_params.sampling_seed`` (random when absent), ``i`` the prompt's
  index *in that request*, ``j`` the sample's index among its ``n``. The server decodes whatever requests are
  waiting together, but each sample keeps the seed its own request gives it, so its tokens are the
  same whether the request arrives alone or with hundreds of others. (A request with the prompts
  ``[a, b]`` and one seed therefore equals the in-process ``generate([a, b], seed)``; the same
  prompts sent as two one-prompt requests get ``i = 0`` each.)
"""

from __future__ import annotations

import hashlib

import torch

# Uniform numbers drawn per generator refill: one torch call per sequence every this many steps.
UNIFORM_BLOCK = 64
# Float64 temporaries of the sampler are bounded to about this many elements per row chunk.
SAMPLER_CHUNK_ELEMENTS = 1 << 24


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of prompt ``prompt_index`` in a call seeded ``seed``.

    A hash, so that nearby base seeds (e.g. ``seed + step``) give unrelated streams instead of
    streams shifted by one sample.
    """
    digest = hashlib.blake2b(f"{int(seed)}/{int(prompt_index)}/{int(sample_index)}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def request_seeds(seed: int, num_prompts: int, n: int) -> list:
    """Per prompt, the seeds of its ``n`` samples in a call (or request) seeded ``seed``:
    ``seeds[i][j] = sample_seed(seed, i, j)``."""
    return [[sample_seed(seed, i, j) for j in range(int(n))] for i in range(int(num_prompts))]


class SampleStream:
    """One sequence's ``torch.Generator``, handing out one float64 uniform in [0, 1) per step.

    Uniforms are drawn in blocks of :data:`UNIFORM_BLOCK`; the t-th uniform of a sequence is the
    t-th number of its generator whatever the block size, the step at which the sequence joined a
    batch or the other sequences decoded beside it."""

    def __init__(self, seed: int):
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(int(seed))
        self._block: list = []
        self._pos = 0

    def next(self) -> float:
        if self._pos == len(self._block):
            self._block = torch.rand(UNIFORM_BLOCK, generator=self._gen, dtype=torch.float64).tolist()
            self._pos = 0
        self._pos += 1
        return self._block[self._pos - 1]


def next_uniforms(streams) -> torch.Tensor:
    """The next uniform of each of ``streams``, as a float64 tensor."""
    return torch.tensor([s.next() for s in streams], dtype=torch.float64)


def _sample_chunk(logits, temperature, top_k, top_p, uniforms):
    vocab = logits.shape[-1]
    x = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(x / temperature, dim=-1)
    probs = logp.exp()
    if 0 < top_k < vocab:
        cand_probs, cand_ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    elif top_p < 1.0:
        cand_probs, cand_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    else:  # the whole vocabulary, in vocabulary order (inverse CDF needs no sorting)
        cand_probs, cand_ids = probs, None
    if top_p < 1.0:
        mass_before = torch.cumsum(cand_probs.double(), dim=-1) - cand_probs.double()
        cand_probs = torch.where(mass_before < top_p, cand_probs, torch.zeros_like(cand_probs))
    cdf = torch.cumsum(cand_probs.double(), dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total (u * total may round up to it), so that the first position whose
    # cdf exceeds the target exists and is never a zero-probability (filtered) candidate.
    target = torch.minimum(
        uniforms.to(cdf.device).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    pos = torch.searchsorted(cdf, target, right=True)
    tokens = pos.squeeze(1) if cand_ids is None else cand_ids.gather(1, pos).squeeze(1)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def apply_repetition_penalty(logits: torch.Tensor, row: int, generated: list, penalty: float) -> None:
    """SGLang's repetition penalty on ``logits[row]`` (in place): each token id in ``generated`` (the
    sample's output so far) has its logit multiplied by ``penalty`` when negative, divided by it
    otherwise. vLLM and HF also count the prompt's tokens; SGLang does not."""
    if penalty == 1.0 or not generated:
        return
    ids = torch.tensor(sorted(set(generated)), dtype=torch.long, device=logits.device)
    z = logits[row, ids]
    logits[row, ids] = torch.where(z < 0, z * penalty, z / penalty)


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, uniforms: torch.Tensor):
    """Sample one token per row of ``logits`` ``[rows, vocab]`` (see the module docstring).

    ``uniforms``: ``[rows]`` float64 in [0, 1). Returns ``(tokens, logprobs)``: int64 ``[rows]`` and
    ``log_softmax(logits / temperature)`` of each token over the full vocabulary (unfiltered), in
    float32 (float64 for float64 logits). Rows go in chunks to bound the float64 temporaries.
    """
    if logits.dim() != 2 or uniforms.shape != logits.shape[:1]:
        raise ValueError(
            "sample_tokens: logits [rows, vocab] and uniforms [rows], got "
            f"{tuple(logits.shape)} and {tuple(uniforms.shape)}"
        )
    rows_per_chunk = max(1, SAMPLER_CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    tokens, logprobs = [], []
    for start in range(0, logits.shape[0], rows_per_chunk):
        sl = slice(start, start + rows_per_chunk)
        t, lp = _sample_chunk(logits[sl], temperature, top_k, top_p, uniforms[sl])
        tokens.append(t)
        logprobs.append(lp)
    if not tokens:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float32)
    return torch.cat(tokens), torch.cat(logprobs)
