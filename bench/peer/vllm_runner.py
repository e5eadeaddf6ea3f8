"""Runs inside vLLM's own virtualenv (never the project's): one LLM, several workloads.

    .venv-vllm/bin/python bench/peer/vllm_runner.py REQUEST.json RESULT.json

REQUEST: {"model": dir, "block_size": 32, "max_num_seqs": N, "max_model_len": L,
"kv_cache_gib": G, "workloads": [{"name": str, "rounds": [[[token ids], ...], ...],
"max_tokens": n}], "repeats": r}. A workload's rounds run one after another (a multi-turn
chat sends turn k of every conversation as round k); each round is one offline
`LLM.generate` call with prefix caching on, greedy, `ignore_eos`. The best (shortest) of
`repeats` timings is kept (each repeat on fresh prompts is not possible offline, so the
prefix cache is reset before each repeat). Writes outputs, cached tokens and wall times.
This file imports only vLLM and the standard library.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    request = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request.get("kv_cache_gib", 4)))
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=request["model"], block_size=request["block_size"], enable_prefix_caching=True,
              max_num_seqs=request["max_num_seqs"], max_model_len=request["max_model_len"],
              max_num_batched_tokens=request.get("max_num_batched_tokens"), seed=0, dtype="float32")
    results = []
    warm = [TokensPrompt(prompt_token_ids=[7 + i for i in range(64)])] * 2
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for workload in request["workloads"]:
        params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
        best = None
        for _ in range(request.get("repeats", 1)):
            llm.reset_prefix_cache()
            walls, outputs, cached = [], [], []
            for prompts in workload["rounds"]:
                started = time.perf_counter()
                done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                walls.append(time.perf_counter() - started)
                outputs.append([list(d.outputs[0].token_ids) for d in done])
                cached.append([d.num_cached_tokens or 0 for d in done])
            if best is None or sum(walls) < sum(best["round_walls"]):
                best = {"name": workload["name"], "round_walls": walls, "outputs": outputs, "cached": cached}
        results.append(best)
    json.dump({"vllm_version": _version(), "results": results}, open(sys.argv[2], "w"))


def _version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
