"""The hand-written half of the contract, beside the generated code in kvcache/: the
block hash rule (`block_hash`) and its published test vectors. Pure: no gRPC, no I/O."""
