"""A pool registered over blockd's raw worker API, with no compute daemon behind it.

The tests use it to put blockd into states a real worker reaches only by timing:
a pool holding sequences (load) while another pool caches the same prefix, or a
burst of ten thousand events. It speaks the contract exactly as a worker does:
admit, commit the written blocks, release.
"""

from __future__ import annotations

import grpc

from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc


class FakePool:
    """One registered pool; `sequence ids` are the caller's, unique while live."""

    def __init__(
        self,
        channel: grpc.Channel,
        namespace: pb.Namespace,
        num_blocks: int,
        block_size: int,
        worker_address: str,
    ) -> None:
        self._stub = pb_grpc.BlockDirectoryServiceStub(channel)
        self.block_size = block_size
        self._registration = pb.RegisterPoolRequest(
            num_blocks=num_blocks, block_size=block_size, namespace=namespace, worker_address=worker_address
        )
        reply = self._stub.RegisterPool(self._registration, timeout=10)
        self.pool_id = reply.pool_id
        self.epoch = reply.epoch
        self._registration.pool_id = reply.pool_id
        self._registration.pool_token = reply.pool_token  # the owner's proof on reregister()

    @property
    def worker_address(self) -> str:
        return self._registration.worker_address

    def step(self, **ops: list) -> pb.StepResponse:
        return self._stub.Step(pb.StepRequest(pool_id=self.pool_id, epoch=self.epoch, **ops), timeout=30)

    def admit(self, sequence_id: int, tokens: list[int]) -> list[int]:
        """The new sequence's block table (it must be admitted)."""
        [result] = self.step(admits=[pb.AdmitOp(sequence_id=sequence_id, token_ids=tokens)]).admits
        assert result.admitted, f"pool {self.pool_id} could not admit {len(tokens)} tokens"
        return list(result.block_ids)

    def cache(self, sequence_id: int, tokens: list[int], num_blocks: int) -> None:
        """Admit `tokens`, commit their first `num_blocks` blocks, release: the prefix
        stays cached (evictable) in this pool."""
        table = self.admit(sequence_id, tokens)
        width = num_blocks * self.block_size
        self.step(
            commits=[
                pb.CommitOp(sequence_id=sequence_id, block_ids=table[:num_blocks], token_ids=tokens[:width])
            ],
            releases=[pb.ReleaseOp(sequence_id=sequence_id)],
        )

    def release(self, *sequence_ids: int) -> None:
        self.step(releases=[pb.ReleaseOp(sequence_id=s) for s in sequence_ids])

    def reregister(self) -> None:
        """RegisterPool again under the same id: the pool is reset (every reference and
        index entry dropped, a CLEARED event) at a new epoch."""
        self.epoch = self._stub.RegisterPool(self._registration, timeout=10).epoch
