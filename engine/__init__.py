"""The worker engine both pools share: model loading and ragged batches (modeling), per-request KV
sessions, the sampler, the call batcher, prompt lookup (ngram: the router uses it too), the worker gRPC
server plumbing and the offline model pair.
Torch is imported only by the modules that compute (modeling, sampling)."""
