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
        "native CPU kernels ready: kvcache::paged_decode, kvcache::paged_flash, kvcache::packed_linear, "
        "kvcache::rotary, kvcache::rms_norm, kvcache::merge_partials, kvcache::silu_mul"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
