"""`python -m computed.kernels`: build (or load) the native CPU kernels and say which."""

from __future__ import annotations

import sys

from computed import kernels


def main() -> int:
    op = kernels.paged_decode()
    if op is None:
        print(f"native CPU kernels unavailable ({kernels.error()}); computed uses torch's kernels")
        return 0
    print(
        f"native CPU kernels ready in {kernels.build_dir()} (kvcache::paged_decode, paged_flash, packed_linear, "
        "rotary, rms_norm, merge_partials, silu_mul, write_kv, layer_qkv, layer_out, forward_layers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
