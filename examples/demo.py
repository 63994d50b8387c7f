#!/usr/bin/env python
"""`make demo`: the pipeline end to end on a tiny Qwen3-shaped model, on the CPU.

1. A random tiny Qwen3 HF checkpoint (awkward sizes: vocab 389, head_dim 24 != 64/4, GQA).
2. HF -> Megatron torch_dist conversion, then HF logits parity at TP=2 x PP=2 (4 gloo processes).
3. Long-CoT style SFT on synthetic arithmetic chats: preprocessing into the indexed dataset, then
   training at TP=2 (2 processes) with checkpoints.
4. Export of the trained checkpoint back to HF, a bit-exactness check of the round trip of the
   base model, and a greedy answer from the SFT model through transformers.
5. GPPO RL from the SFT model: the embedded rollout engine samples 8 responses per arithmetic
   prompt, the grading pool scores them with math-verify, the actor trains at TP=2 and the new
   weights go back to the engine, for a few steps.
"""
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runs", "demo")
PY = sys.executable


def sh(*args, **kw):
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, check=True, cwd=ROOT, **kw)


def torchrun(n, *args):
    import socket

    with socket.socket() as s:  # a port the OS says is free, not a fixed one another job may hold
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sh(PY, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(port), *args)


def banner(text):
    print(f"\n=== {text} ===", flush=True)


def main():
    t0 = time.time()
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    hf_base, mg_base = f"{OUT}/hf-base", f"{OUT}/mg-base"

    banner("1. tiny Qwen3 HF checkpoint")
    sh(PY, "tools/make_tiny_model.py", "--out", hf_base, "--layers", "4")

    banner("2. HF -> Megatron, and logits parity at TP=2 x PP=2")
    sh(PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf_base, "--out", mg_base, "--tp", "2", "--pp", "2")
    torchrun(4, "tools/check_parity.py", "--hf-dir", hf_base, "--ckpt", mg_base, "--tp", "2", "--pp", "2")

    banner("3. SFT: preprocess synthetic chats, train at TP=2")
    from megatron_klear.data.synthetic import write_sft_jsonl

    write_sft_jsonl(f"{OUT}/train.jsonl", 512, seed=0)
    sh(PY, "tools/preprocess_sft.py", "--input", f"{OUT}/train.jsonl", "--tokenizer", hf_base,
       "--output-prefix", f"{OUT}/sft-data", "--max-length", "512")
    torchrun(2, "-m", "megatron_klear.sft", "--config", "examples/configs/sft_tiny_cpu.yaml",
             f"model.path={mg_base}", f"data.prefix={OUT}/sft-data", f"train.save_dir={OUT}/sft-run")
    metrics = [json.loads(x) for x in open(f"{OUT}/sft-run/metrics.jsonl")]

    banner("4. export to HF, round trip, generation")
    step = int(open(f"{OUT}/sft-run/latest_checkpointed_iteration.txt").read())
    sh(PY, "tools/convert_megatron_to_hf.py", "--ckpt", mg_base, "--out", f"{OUT}/hf-roundtrip")
    sh(PY, "tools/convert_megatron_to_hf.py", "--ckpt", f"{OUT}/sft-run/iter_{step:07d}", "--out", f"{OUT}/hf-sft")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_klear.checkpoint.hf_io import HFReader

    a, b = HFReader(hf_base), HFReader(f"{OUT}/hf-roundtrip")
    exact = a.keys() == b.keys() and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    tok = AutoTokenizer.from_pretrained(f"{OUT}/hf-sft")
    model = AutoModelForCausalLM.from_pretrained(f"{OUT}/hf-sft").eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        # the export's generation_config.json stops at EOS and at the chat template's <|im_end|>
        out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)

    banner("5. GPPO: embedded engine -> math grader -> actor at TP=2 -> weight sync")
    from megatron_klear.data.synthetic import write_rl_prompts_jsonl

    write_rl_prompts_jsonl(f"{OUT}/rl-prompts.jsonl", 128, seed=1)
    torchrun(2, "-m", "megatron_klear.rl", f"model.path={OUT}/hf-sft", "model.dtype=fp32", "parallel.tp=2",
             f"rl.prompts=[{OUT}/rl-prompts.jsonl]", "rl.prompts_per_step=8", "rl.oversample_prompts=12",
             "rl.responses_per_prompt=8", "rl.mini_batch_prompts=4", "rl.max_tokens_per_micro_batch=1024", "rl.max_prompt_length=128",
             "rollout.max_new_tokens=40", "optim.lr=2e-5", "optim.min_lr=2e-5", "optim.decay_style=constant",
             "train.steps=4", f"train.save_dir={OUT}/rl-run", "reward.workers=1")
    rl = [json.loads(x) for x in open(f"{OUT}/rl-run/metrics.jsonl")]

    banner("summary")
    print(f"round trip HF -> Megatron -> HF bit-exact: {exact}")
    print(f"SFT loss: {metrics[0]['loss']:.3f} (step 1) -> {metrics[-1]['loss']:.3f} (step {metrics[-1]['step']}), "
          f"{metrics[-1]['tokens_per_s']:.0f} tokens/s")
    print(f"SFT model, greedy, 'What is 12 + 7?': {answer!r}")
    for m in rl:
        trained = f"{m['rollout/samples_trained']} samples trained, " if m.get("actor/optimizer_steps") else "no group with reward spread, "
        print(f"GPPO step {m['step']}: mean reward {m['rollout/reward_mean']:+.3f}, accuracy {m['rollout/accuracy']:.3f}, "
              f"{trained}engine/trainer log-prob mismatch {m.get('actor/logprob_mismatch_max', float('nan')):.1e}")
    print(f"outputs in {OUT} ({time.time() - t0:.0f}s)")
    if not exact or metrics[-1]["loss"] >= metrics[0]["loss"]:
        print("demo FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
