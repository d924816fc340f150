"""The engine: SpeculativeDecoder and its one block loop for every batch size (batch 1 is a batch of
one), the KV-cache sessions, drafts and their verifier, CUDA graphs and the device path."""
