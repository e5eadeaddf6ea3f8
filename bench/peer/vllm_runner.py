"""Runs inside vLLM's own virtualenv (never the project's): one LLM, several workloads.

    .venv-vllm/bin/python bench/peer/vllm_runner.py REQUEST.json RESULT.json

REQUEST: {"model": dir, "dtype": "float32" | "bfloat16" | "auto" (the checkpoint's),
"block_size": 32, "max_num_seqs": N, "max_model_len": L, "kv_cache_gib": G, "repeats": r,
"workloads": [{"name": str, "system": [ids], "conversations": [[[turn ids], ...], ...],
"max_tokens": n}]}. Round k sends turn k of
every conversation at once as one offline `LLM.generate` (prefix caching on, greedy,
`ignore_eos`); its prompt is the system tokens, then every earlier turn followed by the
output vLLM itself generated for it, then turn k (a chat re-sending its whole history).
A one-turn workload is a plain batch. Each repeat starts from an empty prefix cache; the
repeat with the shortest total wall time is kept. Imports only vLLM and the standard library.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request.get("kv_cache_gib", 4)))
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=request["model"],
        block_size=request["block_size"],
        enable_prefix_caching=True,
        max_num_seqs=request["max_num_seqs"],
        max_model_len=request["max_model_len"],
        seed=0,
        dtype=request.get("dtype", "float32"),
    )
    warm = [TokensPrompt(prompt_token_ids=[7 + i for i in range(64)])] * 2
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    results = []
    for workload in request["workloads"]:
        params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
        best = None
        for _ in range(request.get("repeats", 1)):
            llm.reset_prefix_cache()
            run = _run(llm, workload, params, TokensPrompt)
            if best is None or sum(run["round_walls"]) < sum(best["round_walls"]):
                best = run
        results.append(best)
    with open(sys.argv[2], "w") as f:
        json.dump({"vllm_version": _version(), "results": results}, f)


def _run(llm, workload: dict, params, tokens_prompt) -> dict:
    conversations = workload["conversations"]
    histories = [list(workload["system"]) for _ in conversations]
    walls, prompts_sent, outputs, cached = [], [], [], []
    for turn in range(max(len(c) for c in conversations)):
        live = [i for i, c in enumerate(conversations) if turn < len(c)]
        prompts = [histories[i] + conversations[i][turn] for i in live]
        started = time.perf_counter()
        done = llm.generate([tokens_prompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        walls.append(time.perf_counter() - started)
        for i, prompt, out in zip(live, prompts, done):
            generated = list(out.outputs[0].token_ids)
            histories[i] = prompt + generated
            prompts_sent.append(prompt)
            outputs.append(generated)
            cached.append(out.num_cached_tokens or 0)
    return {
        "name": workload["name"],
        "round_walls": walls,
        "prompts": prompts_sent,
        "outputs": outputs,
        "cached": cached,
    }


def _version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
