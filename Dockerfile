# One image for both daemons (and kvctl): docker compose picks the command per service.
#   docker build -t kvcache .                                   # torch's CPU build
#   docker build -t kvcache:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# TORCH_SPEC and TORCH_INDEX mean what they mean to the Makefile (`make torch TORCH_INDEX=...`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# gcc: mypyc builds blockd's compiled core at image build time (below). g++: computed builds
# its native CPU kernels at its first start (for the CPU it runs on, so not at image build
# time), into COMPUTED_KERNEL_BUILD_DIR; without it, torch's kernels run.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
ENV COMPUTED_KERNEL_BUILD_DIR=/tmp/kvcache-kernels

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# torch first, in its own layer: it is by far the largest and changes least often.
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY kvcache ./kvcache
COPY kvcache_contract ./kvcache_contract
COPY blockd ./blockd
COPY computed ./computed
COPY clients ./clients
COPY gateway ./gateway
# Installs the dependencies and the kvctl/blockd/computed scripts. The daemons run
# as `python -m ...` from /app, so they import this source tree.
# blockd's directory core compiled with mypyc (blockd/native.py) into /app/build/native,
# which `python -m blockd` loads (BLOCKD_NATIVE=auto); mypy is needed only to build it.
RUN chmod -R a+rX /app \
    && pip install . mypy \
    && python -m blockd.native \
    && chmod -R a+rX /app/build \
    && useradd --system --uid 10001 --home-dir /app kvcache

USER kvcache
EXPOSE 50051 50052 8000
# Overridden per service in docker-compose.yml.
CMD ["python", "-m", "blockd", "--listen", "0.0.0.0:50051"]
